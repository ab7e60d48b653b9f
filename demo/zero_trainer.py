#!/usr/bin/env python3
"""A stand-in for DeepSpeed v0.14.5: plain-PyTorch ZeRO-2 data-parallel training on CPU (gloo).

This is NOT DeepSpeed. It trains a tiny GPT with ZeRO stage 2 (each rank owns one partition of
the flat fp32 parameters, its gradients and its Adam state) and reads and writes checkpoints in
DeepSpeed v0.14.5's ZeRO-2 layout, so that the demo and the end-to-end tests run where DeepSpeed
cannot be installed:

  <save_dir>/latest                                        the tag, written by rank 0 after its
                                                           own files, before the final barrier
  <save_dir>/global_step<N>/mp_rank_00_model_states.pt     module, param_shapes, dp_world_size, ...
  <save_dir>/global_step<N>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per rank

with DeepSpeed's keys, nesting, dtypes and pickled class names
(deepspeed.runtime.fp16.loss_scaler.LossScaler, deepspeed.utils.tensor_fragment.fragment_address,
deepspeed.runtime.zero.config.ZeroStageEnum), its partition rules (the flat group padded to a
multiple of 2*dp, rank r owning [r*P, (r+1)*P), the fp32 partition saved without the padding,
the Adam state over the padded partition), and its refusal to load optimizer state saved at
another data-parallel size (ZeRORuntimeException "The checkpoint being loaded used a DP world
size of ..."). It knows nothing about ucp. What it does not reproduce: DeepSpeed's
zero_to_fp32.py copy into the save directory, fp16/bf16, gradient accumulation, LR schedulers.

Data: a fixed global batch per step (seeded by the step) split evenly over the ranks, and the
printed loss is the mean over the global batch, so losses compare across data-parallel sizes.

Launch one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (launch.py).
"""
import dataclasses
import enum
import glob
import json
import os
import sys
import types
from collections import OrderedDict

import torch
import torch.distributed as dist

from tinygpt import TinyGPT, argument_parser, global_batch

DS_VERSION = "0.14.5"


# DeepSpeed's classes that its checkpoints pickle, as stand-ins carrying DeepSpeed's module and
# class names, so torch.save writes them as DeepSpeed does and torch.load finds them.
class LossScaler:
    """deepspeed.runtime.fp16.loss_scaler.LossScaler (a static scale of 1 in fp32 training)."""

    def __init__(self, scale=1.0):
        self.cur_scale = scale
        self.dynamic = False


@dataclasses.dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name)
    """deepspeed.utils.tensor_fragment.fragment_address: a parameter's slice of a partition."""
    numel: int
    start: int


class ZeroStageEnum(int, enum.Enum):
    """deepspeed.runtime.zero.config.ZeroStageEnum, pickled by member name."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3

    def __reduce_ex__(self, protocol):
        return getattr, (type(self), self.name)


class ZeRORuntimeException(Exception):
    """deepspeed.runtime.zero.utils.ZeRORuntimeException."""


def _register(module_name, cls):
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module_name], cls.__name__, cls)
    cls.__module__ = module_name


_register("deepspeed.runtime.fp16.loss_scaler", LossScaler)
_register("deepspeed.utils.tensor_fragment", fragment_address)
_register("deepspeed.runtime.zero.config", ZeroStageEnum)
_register("deepspeed.runtime.zero.utils", ZeRORuntimeException)


class Zero2:
    """ZeRO stage 2 over one parameter group: flat fp32 parameters, reduced gradients and Adam.

    The model's parameters become views of one flat buffer padded to a multiple of 2*dp; rank r
    owns [r*P, (r+1)*P) and keeps an fp32 master copy of it that torch.optim.Adam updates.
    """

    def __init__(self, model, opt_params, clip_grad):
        self.rank, self.dp = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = {p: n for n, p in model.named_parameters()}
        numel = sum(p.numel() for p in self.params)
        align = 2 * self.dp
        self.flat = torch.zeros((numel + align - 1) // align * align)
        offset = 0
        self.offsets = []
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.data.reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            self.offsets.append(offset)
            offset += p.numel()
        self.partition = self.flat.numel() // self.dp
        self.padding = self.flat.numel() - numel if self.rank == self.dp - 1 else 0
        self.fp32 = self.my_slice(self.flat).clone().float().detach()
        self.fp32.requires_grad = True
        self.adam = torch.optim.Adam([self.fp32], **opt_params)
        self.clip_grad = clip_grad
        self.loss_scaler = LossScaler()
        self.overflow = False
        self.slice_mappings = [self._slice_mappings()]

    def my_slice(self, flat):
        return flat.narrow(0, self.rank * self.partition, self.partition)

    def _slice_mappings(self):
        start, end = self.rank * self.partition, (self.rank + 1) * self.partition
        mappings = OrderedDict()
        for p, offset in zip(self.params, self.offsets):
            if offset < end and offset + p.numel() > start:
                first, last = max(offset, start), min(offset + p.numel(), end)
                mappings[self.names[p]] = fragment_address(numel=last - first, start=first - start)
        return mappings

    def step(self):
        grads = torch.zeros_like(self.flat)
        for p, offset in zip(self.params, self.offsets):
            grads[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None
        grads.div_(self.dp)
        dist.all_reduce(grads)
        grad = self.my_slice(grads).clone()
        norm_sq = torch.norm(grad.double()).square().float()
        dist.all_reduce(norm_sq)
        norm = norm_sq.sqrt()
        if self.clip_grad > 0:
            clip = torch.clamp((norm + 1e-6) / self.clip_grad, min=1.0)
            grad.mul_(1.0 / clip)
        self.fp32.grad = grad
        self.adam.step()
        self.fp32.grad = None
        self.my_slice(self.flat).copy_(self.fp32.detach())
        parts = list(self.flat.split(self.partition))
        dist.all_gather(parts, self.fp32.detach().clone())

    def state_dict(self):
        # DeepSpeed saves a slice of the master partition itself (requires_grad stays set).
        lean = self.fp32[:self.fp32.numel() - self.padding]
        return {
            "loss_scaler": self.loss_scaler,
            "dynamic_loss_scale": False,
            "overflow": self.overflow,
            "clip_grad": self.clip_grad,
            "base_optimizer_state": self.adam.state_dict(),
            "single_partition_of_fp32_groups": [lean],
            "zero_stage": ZeroStageEnum.gradients,
            "group_paddings": [self.padding],
            "partition_count": [self.dp],
            "ds_version": DS_VERSION,
            "param_slice_mappings": self.slice_mappings,
        }

    def load_state_dict(self, sd):
        self.loss_scaler = sd.get("loss_scaler", self.loss_scaler)
        self.overflow = sd.get("overflow", self.overflow)
        self.clip_grad = sd.get("clip_grad", self.clip_grad)
        self.adam.load_state_dict(sd["base_optimizer_state"])
        saved = sd["single_partition_of_fp32_groups"][0]
        with torch.no_grad():
            self.fp32.zero_()
            self.fp32[:saved.numel()].copy_(saved)


class Engine:
    """Training state and DeepSpeed-compatible save_checkpoint / load_checkpoint."""

    def __init__(self, model, config):
        self.model = model
        self.config = config
        opt = config["optimizer"]["params"]
        self.optimizer = Zero2(model, dict(opt), config["gradient_clipping"])
        self.rank, self.dp = dist.get_rank(), dist.get_world_size()
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0

    def train_step(self, xs, ys):
        loss = self.model(xs, ys)
        loss.backward()
        self.optimizer.step()
        self.global_steps += 1
        self.global_samples += self.config["train_batch_size"]
        return loss

    def _model_states(self, client_state):
        state = {
            "module": self.model.state_dict(),
            "buffer_names": [n for n in self.model.state_dict() if n not in self.optimizer.names.values()],
            "optimizer": None,
            "param_shapes": [OrderedDict((self.optimizer.names[p], p.shape) for p in self.optimizer.params)],
            "frozen_param_shapes": OrderedDict(),
            "shared_params": {},
            "frozen_param_fragments": OrderedDict(),
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "sparse_tensor_module_names": set(),
            "skipped_steps": self.skipped_steps,
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "dp_world_size": self.dp,
            "mp_world_size": 1,
            "ds_config": self.config,
            "ds_version": DS_VERSION,
        }
        state.update(client_state)
        return state

    def save_checkpoint(self, save_dir, tag, client_state):
        """DeepSpeed's order: model states (rank 0), every rank's zero file, `latest` (rank 0)."""
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
        dist.barrier()
        tag_dir = os.path.join(save_dir, tag)
        os.makedirs(tag_dir, exist_ok=True)
        if self.rank == 0:
            torch.save(self._model_states(client_state), os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
        for rank in range(self.dp):
            if rank == self.rank:
                os.makedirs(tag_dir, exist_ok=True)
            dist.barrier()
        zero = {"optimizer_state_dict": self.optimizer.state_dict(), "ds_config": self.config, "ds_version": DS_VERSION}
        torch.save(zero, os.path.join(tag_dir, f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt"))
        if self.rank == 0:
            with open(os.path.join(save_dir, "latest"), "w") as f:
                f.write(tag)
        dist.barrier()

    def load_checkpoint(self, load_dir, tag=None):
        """Returns (load_path, client_state), or (None, None) without a `latest` file."""
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                print(f"Unable to find latest file at {latest}", file=sys.stderr)
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        ckpt_list = sorted(glob.glob(os.path.join(load_dir, str(tag), "mp_rank_*_model_states.pt")))
        assert len(ckpt_list) > 0, f"no model states file in {os.path.join(load_dir, str(tag))}"
        checkpoint = torch.load(ckpt_list[0], map_location="cpu")
        self.model.load_state_dict(checkpoint["module"], strict=True)
        loaded_dp = checkpoint["dp_world_size"]
        self.global_steps = checkpoint["global_steps"]
        self.global_samples = checkpoint.get("global_samples", self.global_steps * self.config["train_batch_size"])
        self.skipped_steps = checkpoint["skipped_steps"]
        if self.dp != loaded_dp:
            raise ZeRORuntimeException("The checkpoint being loaded used a DP "
                                       f"world size of {loaded_dp} but the "
                                       f"current world size is {self.dp}. Automatic adjustment "
                                       "of ZeRO's optimizer state partitioning with a new world size is not "
                                       "currently supported.")
        names = []
        for rank in range(loaded_dp):
            name = os.path.join(load_dir, str(tag), f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            if not os.path.exists(name):
                old = name.replace("_optim_states.pt", "optim_states.pt")
                if os.path.exists(old):
                    name = old
            names.append(name)
        zero = torch.load(names[self.rank], map_location="cpu")
        self.optimizer.load_state_dict(zero["optimizer_state_dict"])
        deepspeed_keys = {"module", "sparse_tensor_module_names", "skipped_steps", "global_steps", "dp_world_size",
                          "mp_world_size", "data_sampler", "random_ltd", "lr_scheduler", "optimizer"}
        return ckpt_list[0], {k: v for k, v in checkpoint.items() if k not in deepspeed_keys}

    def dump_state(self, path):
        """This rank's optimizer state as a torch file, for bit comparisons."""
        state = self.optimizer.adam.state[self.optimizer.fp32]
        torch.save({
            "fp32_partition": self.optimizer.fp32.detach().clone(),
            "exp_avg": state["exp_avg"].clone(),
            "exp_avg_sq": state["exp_avg_sq"].clone(),
            "step": state["step"].clone(),
            "flat_params": self.optimizer.flat.clone(),
            "global_steps": self.global_steps,
        }, path)


def main():
    args = argument_parser(__doc__.split("\n")[0]).parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.global_bs % world == 0, f"--global_bs {args.global_bs} is not divisible by {world} ranks"
    micro = args.global_bs // world
    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.d, args.nlayer, args.nhead, args.seq)
    # The configuration DeepSpeed records in its checkpoints (torch.optim.Adam, no fp16/bf16).
    config = {
        "train_batch_size": args.global_bs,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": False},
    }
    engine = Engine(model, config)

    if args.load_dir:
        load_path, _ = engine.load_checkpoint(args.load_dir, tag=args.load_tag)
        if rank == 0:
            print(f"LOADED {load_path} global_steps={engine.global_steps} at {world} ranks", flush=True)
        if args.dump_state:
            engine.dump_state(args.dump_state.format(rank=rank))

    losses = {}
    for step in range(engine.global_steps + 1, args.steps + 1):
        x, y = global_batch(step, args.global_bs, args.vocab, args.seq)
        loss = engine.train_step(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = (mean / world).item()
        if rank == 0:
            print(f"STEP {step} loss {losses[step]:.8f}", flush=True)
        if args.save_dir and step in args.save_at:
            engine.save_checkpoint(args.save_dir, f"global_step{step}", {"my_step": step})
            if rank == 0:
                print(f"SAVED {args.save_dir}/global_step{step}", flush=True)

    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"trainer": "zero_trainer (DeepSpeed stand-in)", "world": world, "losses": losses}, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()

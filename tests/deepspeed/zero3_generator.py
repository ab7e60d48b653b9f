"""ZeRO-3 checkpoints written the way DeepSpeed v0.14.5 lays them out, without DeepSpeed.

  write_tag(tag_dir, state, dp, garbage_padding)

`state` (make_state) is one training state: parameter groups with their own hyperparameters, the
full fp32 master weights and Adam moments of every trainable parameter, frozen parameters and a
buffer. write_tag saves it as a DeepSpeedZeroOptimizer_Stage3 run at DP size `dp` would:
per rank zero_pp_rank_<r>_mp_rank_00_model_states.pt and [bf16_]zero_pp_rank_<r>_mp_rank_00_
optim_states.pt, with DeepSpeed's rules (runtime/zero/stage3.py, partition_parameters.py,
engine.py _save_checkpoint / _get_zero_param_shapes / _get_zero_frozen_param_attributes /
_get_shared_params):
  - every parameter padded to a multiple of dp; rank r holds elements [r*c, (r+1)*c), c = ceil(n/dp);
  - each optimizer parameter group split into sub groups (_create_fp16_sub_groups) where the
    partition elements reach zero_optimization.sub_group_size; one flat group per sub group:
    param_shapes[i], fp32_flat_groups[i], optimizer_state_dict.state[i]; param_groups list the
    sub groups of each group;
  - frozen parameters (no requires_grad): frozen_param_shapes and, per rank, frozen_param_fragments
    (the rank's padded piece, in the module dtype);
  - shared_params filled on rank 0 only.
Padding elements are zeros, or with garbage_padding the uninitialised values a training save holds
(fp32 flat groups only, as RESAVED.txt finding 1 observed).
"""

import collections
import math
import os

import torch

import ds_objects

SUB_GROUP_SIZE = 100


def make_state(bf16):
    """A deterministic training state: two parameter groups (at sub_group_size 100 the first is
    split into three sub groups at dp 1..3, into two at dp 4 and 5), three frozen parameters."""
    gen = torch.Generator().manual_seed(7)
    groups = [
        {"hyper": {"lr": 0.003, "betas": (0.9, 0.95), "eps": 1e-08, "weight_decay": 0.0},
         "params": [("enc.weight", (20, 15)), ("enc.bias", (300,)), ("norm.weight", (10,)),
                    ("norm.bias", (17,))]},
        {"hyper": {"lr": 0.001, "betas": (0.8, 0.99), "eps": 1e-06, "weight_decay": 0.1},
         "params": [("head.weight", (5, 9)), ("head.bias", (7,)), ("scale", (13,))]},
    ]
    for group in groups:
        group["tensors"] = {
            name: {key: torch.randn(shape, generator=gen) for key in ("fp32", "exp_avg")}
            for name, shape in group["params"]}
        for name, shape in group["params"]:
            group["tensors"][name]["exp_avg_sq"] = torch.rand(shape, generator=gen)
    dtype = torch.bfloat16 if bf16 else torch.float32
    frozen = collections.OrderedDict(
        (name, torch.randn(shape, generator=gen).to(dtype))
        for name, shape in (("emb.weight", (7, 9)), ("emb.pos", (31,)), ("gate", (2, 3))))
    return {"groups": groups, "frozen": frozen, "dtype": dtype, "bf16": bf16,
            "buffer": torch.arange(16, dtype=torch.int64)}


def sub_groups(params, dp):
    """_create_fp16_sub_groups over (name, shape) pairs at dp."""
    pieces = [math.ceil(math.prod(shape) / dp) for _, shape in params]
    if SUB_GROUP_SIZE >= sum(pieces):
        return [params]
    out, current, size = [], [], 0
    for i, param in enumerate(params):
        current.append(param)
        size += pieces[i]
        if size >= SUB_GROUP_SIZE or i == len(params) - 1:
            out.append(current)
            current, size = [], 0
    return out


def piece(tensor, dp, rank, padding):
    """Rank `rank`'s padded piece of the flattened tensor."""
    flat = tensor.reshape(-1)
    c = math.ceil(flat.numel() / dp)
    part = flat[rank * c:(rank + 1) * c]
    pad = c - part.numel()
    return torch.cat([part, padding(pad, flat.dtype)]) if pad else part.clone()


def config(state):
    return {"train_batch_size": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.003}},
            "zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP_SIZE},
            "bf16": {"enabled": state["bf16"]}}


def write_tag(tag_dir, state, dp, garbage_padding=False):
    os.makedirs(tag_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(dp)

    def zeros(n, dtype):
        return torch.zeros(n, dtype=dtype)

    def garbage(n, dtype):
        return (torch.rand(n, generator=gen) * 1e19).to(dtype)

    flat_groups, members = [], []
    for group in state["groups"]:
        members.append([])
        for sub in sub_groups(group["params"], dp):
            members[-1].append(len(flat_groups))
            flat_groups.append((group, sub))
    ds_config = config(state)
    prefix = "bf16_" if state["bf16"] else ""
    for rank in range(dp):
        module = collections.OrderedDict([("pos", state["buffer"])])
        for group in state["groups"]:
            for name, _ in group["params"]:
                module[name] = torch.empty(0, dtype=state["dtype"])
        for name in state["frozen"]:
            module[name] = torch.empty(0, dtype=state["dtype"])
        model = {
            "module": module,
            "buffer_names": ["pos"],
            "optimizer": None,
            "param_shapes": [collections.OrderedDict((name, torch.Size(shape))
                                                     for name, shape in sub)
                             for _, sub in flat_groups],
            "frozen_param_shapes": collections.OrderedDict(
                (name, t.shape) for name, t in state["frozen"].items()),
            "shared_params": {"tied.weight": "enc.weight"} if rank == 0 else {},
            "frozen_param_fragments": collections.OrderedDict(
                (name, piece(t, dp, rank, zeros)) for name, t in state["frozen"].items()),
            "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
            "sparse_tensor_module_names": set(),
            "skipped_steps": 0, "global_steps": 5, "global_samples": 40,
            "dp_world_size": dp, "mp_world_size": 1,
            "ds_config": ds_config, "ds_version": "0.14.5", "my_step": 5,
        }
        ds_objects.save(model, f"{tag_dir}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt")

        states, fp32 = {}, []
        for i, (group, sub) in enumerate(flat_groups):
            def flat(key, padding):
                return torch.cat([piece(group["tensors"][name][key], dp, rank, padding)
                                  for name, _ in sub])
            master = flat("fp32", garbage if garbage_padding else zeros)
            master.requires_grad_(True)
            fp32.append(master)
            states[i] = {"step": torch.tensor(5.0), "exp_avg": flat("exp_avg", zeros),
                         "exp_avg_sq": flat("exp_avg_sq", zeros)}
        loss_scaler = ds_objects.LossScaler()
        loss_scaler.cur_scale = 1.0
        loss_scaler.dynamic = False
        param_groups = []
        for group, indices in zip(state["groups"], members):
            param_group = dict(group["hyper"])
            param_group.update({"amsgrad": False, "maximize": False, "foreach": None,
                                "capturable": False, "differentiable": False, "fused": False,
                                "params": indices})
            param_groups.append(param_group)
        optim = {
            "optimizer_state_dict": {
                "zero_stage": ds_objects.ZeroStageEnum.weights,
                "loss_scaler": loss_scaler,
                "dynamic_loss_scale": False,
                "overflow": False,
                "partition_count": dp,
                "optimizer_state_dict": {"state": states, "param_groups": param_groups},
                "fp32_flat_groups": fp32,
            },
            "ds_config": ds_config,
            "ds_version": "0.14.5",
        }
        ds_objects.save(optim, f"{tag_dir}/{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")

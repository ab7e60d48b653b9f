#!/usr/bin/env python3
"""DeepSpeed-MoE layers in a Megatron-style tensor-parallel GPT (the layout of Megatron-DeepSpeed's
MoE runs at TP > 1), on CPU with gloo: ZeRO-1 or 2, fp32 or bf16, an `mpu` passed to
deepspeed.initialize.

The model is ../shared/tools/deepspeed-cpu/train_tp.py's TPGPT (Megatron's parameter names,
column/row-parallel attention, a vocabulary-parallel embedding and output layer) with each layer's
MLP replaced by a deepspeed.moe.layer.MoE of --experts experts at expert-parallel size --ep, top-1,
each expert a whole (not tensor-parallel) MLP: DeepSpeed's default, without
enable_expert_tensor_parallelism. Its expert-parallel groups are then runs of --ep consecutive
global ranks across the TP ranks (utils/groups.py's _create_expert_and_data_parallel without
mp_size; with --data_before_expert, use_data_before_expert_parallelism, runs of NPROC/E), and each
TP rank routes 1/TP of the tokens. With --expert_tp (enable_expert_tensor_parallelism) each expert
is a TPExpertMLP split over the TP ranks as Megatron's ParallelMLP, and the expert-parallel groups
are those runs over each TP rank's DP ranks (_create_expert_data_and_model_parallel); each TP rank
then writes its own slice of every expert. Ranks are Megatron's: rank = dp_rank * TP +
tp_rank. The gating is RNG-free and drops no token; the gate and every GLOBAL expert get weights of
their own from generators seeded by their layer and id, so the function does not depend on the
TP, DP or EP layout. The global batch of every step is fixed (train.py's); the MoE auxiliary loss is
not added (it depends on the local batch).

Run from ../shared/tools/deepspeed-cpu (its train.py and train_tp.py are imported) with launch.py:
  launch.py NPROC PORT train_moe_tp.py --tp T --ep E [--stage S] [--dtype bf16] --steps N
            [--data_before_expert] [--expert_tp] [--save_dir DIR --save_at STEP ...]
            [--load_dir DIR] --out JSON
A --save_at step that is the loaded one saves what the load gave, before any step. Each save's
client state is Megatron-DeepSpeed's: checkpoint_version and a Megatron-like `args` of the run's
sizes (TP, DP, the padded vocabulary), which a reshard must set for its target, and its
enable_expert_tensor_parallelism.
DP = NPROC / T; E must divide NPROC (with --expert_tp, DP). Rank 0 prints `STEP n loss x` and
writes {"losses": ...}.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
import train as T  # noqa: E402  (the shared trainer: data, gloo shims)
import train_tp as TP  # noqa: E402  (the Megatron-style model and mpu)
from train_moe_pipe import ExpertMLP, init_experts  # noqa: E402  (this folder's)

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import deepspeed.moe.mappings  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402


class MoEMLP(MoE):
    """The layer's MLP: the MoE's output alone, as Megatron-DeepSpeed's layer uses it."""

    def forward(self, h):
        return super().forward(h)[0]


class MoeGPT(TP.TPGPT):
    """TPGPT whose embedding mask takes the weights' dtype (TPGPT's float32 one would promote a
    bf16 run's activations to float32, which its bf16 layer norms refuse on CPU)."""

    def forward(self, idx, targets):
        start = self.r * self.vl
        outside = (idx < start) | (idx >= start + self.vl)
        weight = self.word_embeddings.weight
        local = F.embedding((idx - start).masked_fill(outside, 0), weight)
        x = TP._ReduceFromTP.apply(local * (~outside).unsqueeze(-1).to(weight.dtype))
        x = x + self.position_embeddings.weight[:idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        h = self.final_layernorm(x)
        logits = TP._GatherFromTP.apply(F.linear(TP._CopyToTP.apply(h), self.output_layer.weight))
        logits = logits[..., :self.vocab]
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))


def gather_tokens(input_, dim=0):
    """deepspeed.moe.mappings._gather_tokens over gloo: the TP ranks' tensors along `dim`."""
    mpu = TP.MPU_
    if mpu.tp == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(mpu.tp)]
    tdist.all_gather(parts, input_.contiguous(), group=mpu.tp_group)
    return torch.cat(parts, dim=dim).contiguous()


class TPExpertMLP(torch.nn.Module):
    """An expert split over the TP ranks as Megatron's ParallelMLP splits an MLP (what
    enable_expert_tensor_parallelism expects of an expert): dense_h_to_4h column-parallel (TP rank
    t holds rows [t*H/T, (t+1)*H/T) of its weight and bias), dense_4h_to_h row-parallel (those
    columns of its weight; its bias whole, added after the sum over the TP ranks)."""

    def __init__(self, d, hidden, tp):
        super().__init__()
        self.dense_h_to_4h = torch.nn.Linear(d, hidden // tp)
        self.dense_4h_to_h = torch.nn.Linear(hidden // tp, d)

    def forward(self, x):
        h = F.gelu(self.dense_h_to_4h(TP._CopyToTP.apply(x)))
        return TP._ReduceFromTP.apply(F.linear(h, self.dense_4h_to_h.weight)) + \
            self.dense_4h_to_h.bias


def init_tp_experts(moe, layer, ep_rank, seed, tp, tp_rank):
    """init_experts' weights of each global expert, whole (an ExpertMLP's, parameter after
    parameter), and TP rank tp_rank's slices of them: the function of the whole experts."""
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    for local, expert in enumerate(experts):
        gen = torch.Generator().manual_seed(seed + 1000 * layer + ep_rank * len(experts) + local)
        d, rows = expert.dense_h_to_4h.weight.shape[1], expert.dense_h_to_4h.weight.shape[0]
        whole = [torch.rand(shape, generator=gen) * 0.2 - 0.1
                 for shape in [(rows * tp, d), (rows * tp,), (d, rows * tp), (d,)]]
        part = slice(tp_rank * rows, (tp_rank + 1) * rows)
        with torch.no_grad():
            expert.dense_h_to_4h.weight.copy_(whole[0][part])
            expert.dense_h_to_4h.bias.copy_(whole[1][part])
            expert.dense_4h_to_h.weight.copy_(whole[2][:, part])
            expert.dense_4h_to_h.bias.copy_(whole[3])


def init_moe(moe, layer, ep_rank, seed, mpu, expert_tp):
    """The gate from a generator seeded by its layer, layer L's expert G by (L, G)."""
    gen = torch.Generator().manual_seed(seed + 7000 + layer)
    with torch.no_grad():
        for p in moe.deepspeed_moe.gate.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) * 0.2 - 0.1)
    if expert_tp:
        init_tp_experts(moe, layer, ep_rank, seed, mpu.tp, mpu.tp_rank)
    else:
        init_experts(moe, layer, ep_rank, seed)


def uc_info(vocab, vp):
    """train_tp.py's record of the TP layout, the gate replicated over the TP ranks, and a
    TPExpertMLP's split as Megatron's MLP's (its dense_h_to_4h column-parallel, as Megatron
    names one that no pattern names)."""
    info = TP.uc_info(vocab, vp)
    expert = r'layers\.\d+\.mlp\.deepspeed_moe\.experts\.deepspeed_experts\.\d+\.'
    info['tp_replicated_parameter_patterns'] += [
        r'layers\.\d+\.mlp\.deepspeed_moe\.gate\.wg\.weight', expert + r'dense_4h_to_h\.bias']
    info['parameter_with_row_parallelism_patterns'].append(expert + r'dense_4h_to_h\.weight')
    return info


def save(engine, args, step, mpu, padded_vocab, pp=1):
    """The tag global_step<step>, with Megatron-DeepSpeed's client state: its checkpoint_version
    and a Megatron-like args Namespace of this run's sizes (`pp` pipeline stages)."""
    megatron_args = argparse.Namespace(
        num_layers=args.nlayer, hidden_size=args.d, num_attention_heads=args.nhead,
        seq_length=args.seq, padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=args.vocab_div, tensor_model_parallel_size=mpu.tp,
        pipeline_model_parallel_size=pp, data_parallel_size=mpu.dp, num_experts=[args.experts],
        enable_expert_tensor_parallelism=args.expert_tp)
    engine.save_checkpoint(args.save_dir, tag=f'global_step{step}',
                           client_state={'checkpoint_version': 2.0, 'args': megatron_args})


def add_arguments(p):
    """The arguments this trainer shares with train_moe_3d.py: the grid, the experts, the run and
    the model's sizes."""
    p.add_argument('--tp', type=int, default=2)
    p.add_argument('--ep', type=int, default=2)
    p.add_argument('--experts', type=int, default=4)
    p.add_argument('--expert_tp', action='store_true',
                   help='enable_expert_tensor_parallelism: each expert a TPExpertMLP')
    p.add_argument('--steps', type=int, default=6)
    p.add_argument('--save_dir', default=None)
    p.add_argument('--save_at', type=int, nargs='*', default=[])
    p.add_argument('--load_dir', default=None)
    p.add_argument('--out', default=None)
    p.add_argument('--vocab', type=int, default=67)
    p.add_argument('--vocab_div', type=int, default=4,
                   help='pad vocab to a multiple of vocab_div*TP')
    p.add_argument('--d', type=int, default=32)
    p.add_argument('--nlayer', type=int, default=2)
    p.add_argument('--nhead', type=int, default=4)
    p.add_argument('--seq', type=int, default=16)
    p.add_argument('--seed', type=int, default=1234)
    p.add_argument('--local_rank', type=int, default=-1)


def main():
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument('--stage', type=int, choices=[1, 2], default=1)
    p.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32')
    p.add_argument('--data_before_expert', action='store_true',
                   help='the ds_config\'s use_data_before_expert_parallelism')
    args = p.parse_args()
    T.install_gloo_shim(bf16=args.dtype == 'bf16')
    deepspeed.init_distributed(dist_backend='gloo')
    # torch's gloo has no _allgather_base: DeepSpeed's list-based fallbacks (train.py's).
    import deepspeed.comm.comm as dscomm
    dscomm.cdb.all_gather_function = None
    dscomm.cdb.reduce_scatter_function = None
    # DeepSpeed's MoE gathers the tokens over the TP ranks into one flat buffer, which needs
    # all_gather_into_tensor: without it (above) the buffer stays unwritten. The same
    # concatenation from torch's list all_gather.
    deepspeed.moe.mappings._gather_tokens = gather_tokens
    TP.MPU_ = mpu = TP.MPU(args.tp)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    micro = T.GLOBAL_BS // mpu.dp
    assert micro * mpu.dp == T.GLOBAL_BS and world % args.ep == 0

    torch.manual_seed(args.seed)
    model = MoeGPT(args.vocab, args.d, args.nlayer, args.nhead, args.seq, args.tp, mpu.tp_rank,
                     args.vocab_div)
    # Runs of E consecutive global ranks, or with use_data_before_expert_parallelism runs of
    # world / E consecutive ranks are one expert-parallel rank's.
    # With expert tensor parallelism those groups lie within each TP rank's data-parallel group
    # instead (_create_expert_data_and_model_parallel): the same runs over its DP ranks.
    placed, over = (mpu.dp_rank, mpu.dp) if args.expert_tp else (rank, world)
    ep_rank = placed // (over // args.ep) if args.data_before_expert else placed % args.ep
    for index, layer in enumerate(model.layers):
        if args.expert_tp:
            # The expert capacity is split over the TP ranks, so it must be a multiple of T: a
            # fixed one (drop_tokens) of every token of the rank (capacity_factor E) drops none.
            expert, capacity_factor, drop_tokens = TPExpertMLP(args.d, 2 * args.d, mpu.tp), \
                float(args.experts), True
        else:
            expert, capacity_factor, drop_tokens = ExpertMLP(args.d, 2 * args.d), 1.0, False
        layer.mlp = MoEMLP(hidden_size=args.d, expert=expert, num_experts=args.experts,
                           ep_size=args.ep, k=1, capacity_factor=capacity_factor,
                           eval_capacity_factor=capacity_factor, min_capacity=4,
                           use_residual=False, noisy_gate_policy=None, drop_tokens=drop_tokens,
                           use_rts=False, top2_2nd_expert_sampling=False,
                           enable_expert_tensor_parallelism=args.expert_tp)
        init_moe(layer.mlp, index, ep_rank, args.seed, mpu, args.expert_tp)
    # An MoE save takes the record from the module (its client_state may not carry it).
    model.universal_checkpoint_info = uc_info(args.vocab, model.vp)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {'params': list(model.parameters()), 'name': 'p'})
    zero = {"stage": args.stage}
    if args.stage == 2:
        zero.update({"contiguous_gradients": True, "reduce_scatter": True})
    cfg = {
        "train_batch_size": T.GLOBAL_BS,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True,
                                                  "adam_w_mode": False}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "bf16": {"enabled": args.dtype == 'bf16'},
        "steps_per_print": 1000000,
    }
    if args.data_before_expert:
        cfg["use_data_before_expert_parallelism"] = True
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg,
                                           mpu=mpu)
    start = 0
    if args.load_dir:
        engine.load_checkpoint(args.load_dir)
        start = engine.global_steps
        if rank == 0:
            print(f'LOADED global_steps={start}', flush=True)
        if start in args.save_at:  # DeepSpeed's own files of what it loaded
            save(engine, args, start, mpu, model.vp)
    losses = {}
    for step in range(start + 1, args.steps + 1):
        x, y = T.global_batch(step, args.vocab, args.seq)
        xs = x[mpu.dp_rank * micro:(mpu.dp_rank + 1) * micro]
        ys = y[mpu.dp_rank * micro:(mpu.dp_rank + 1) * micro]
        loss = engine(xs, ys)
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().clone()
        tdist.all_reduce(value, group=mpu.dp_group)
        losses[step] = (value / mpu.dp).item()
        if rank == 0:
            print(f'STEP {step} loss {losses[step]:.8f}', flush=True)
        if step in args.save_at:
            save(engine, args, step, mpu, model.vp)
    if rank == 0 and args.out:
        with open(args.out, 'w') as f:
            json.dump({'tp': mpu.tp, 'dp': mpu.dp, 'ep': args.ep, 'losses': losses}, f, indent=1)
    dist.barrier()


if __name__ == '__main__':
    main()

#!/usr/bin/env python3
"""DeepSpeed-MoE layers in a PipelineModule (the layout of a Mixtral-style run at PP > 1), on CPU
with gloo: ZeRO-1, fp32.

The layers, global indices 0..nlayer+1: a token embedding, nlayer blocks (LayerNorm, then a
deepspeed.moe.layer.MoE of --experts experts at expert-parallel size --ep, top-1, each expert an
MLP; the block adds its output to its input), and the head (LayerNorm, Linear). The gating is
RNG-free and drops no token (train_moe.py's settings), and every GLOBAL expert gets weights of its
own from a generator seeded by its layer and id, so the function does not depend on the DP or EP
layout. partition_method --partition ('uniform': the stages hold equal runs of layers). The optimizer's groups
are DeepSpeed's split_params_into_different_moe_groups_for_optimizer (the dense group, then one
'ep_size_<E>' group of experts). The global batch of every step is fixed (train.py's), so losses
compare across topologies; the MoE auxiliary loss is not added (it depends on the local batch).

Run from ../shared/tools/deepspeed-cpu (its train.py is imported) with its launch.py:
  launch.py NPROC PORT train_moe_pipe.py --pp P --ep E [--partition METHOD] --steps N
            [--save_dir DIR --save_at STEP ...] [--load_dir DIR] --out JSON
DP = NPROC / P, and E must divide it. Rank 0 prints `STEP n loss x` and writes
{"losses": {step: loss}} to --out.
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
import train as T  # noqa: E402  (the shared trainer: data, gloo shims)

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402
import pipeline_training  # noqa: E402  (this folder's, the loop)


class ExpertMLP(nn.Sequential):

    def __init__(self, d, hidden):
        super().__init__(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))


class MoEBlock(nn.Module):

    def __init__(self, d, experts, ep):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.moe = MoE(hidden_size=d, expert=ExpertMLP(d, 2 * d), num_experts=experts, ep_size=ep,
                       k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4,
                       use_residual=False, noisy_gate_policy=None, drop_tokens=False,
                       use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, x):
        out, _, _ = self.moe(self.ln(x))
        return x + out


class Head(nn.Module):

    def __init__(self, d, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def init_experts(moe, layer, ep_rank, seed):
    """Each global expert's own weights: layer L's expert G from a generator seeded by (L, G)."""
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    for local, expert in enumerate(experts):
        gen = torch.Generator().manual_seed(seed + 1000 * layer + ep_rank * len(experts) + local)
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_(torch.rand(p.shape, generator=gen) * 0.2 - 0.1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--pp', type=int, default=2)
    p.add_argument('--ep', type=int, default=2)
    p.add_argument('--partition', default='uniform', help="PipelineModule's partition_method")
    p.add_argument('--experts', type=int, default=4)
    p.add_argument('--steps', type=int, default=6)
    p.add_argument('--save_dir', default=None)
    p.add_argument('--save_at', type=int, nargs='*', default=[])
    p.add_argument('--load_dir', default=None)
    p.add_argument('--out', default=None)
    p.add_argument('--vocab', type=int, default=67)
    p.add_argument('--d', type=int, default=32)
    p.add_argument('--nlayer', type=int, default=4)
    p.add_argument('--seq', type=int, default=16)
    p.add_argument('--seed', type=int, default=1234)
    p.add_argument('--local_rank', type=int, default=-1)
    args = p.parse_args()
    T.install_gloo_shim(bf16=False)

    deepspeed.init_distributed(dist_backend='gloo')
    # torch's gloo has no _allgather_base: DeepSpeed's list-based fallbacks (train.py's).
    import deepspeed.comm.comm as dscomm
    dscomm.cdb.all_gather_function = None
    dscomm.cdb.reduce_scatter_function = None
    world = dist.get_world_size()
    dp = world // args.pp
    micro = T.GLOBAL_BS // dp
    assert micro * dp == T.GLOBAL_BS and dp % args.ep == 0

    torch.manual_seed(args.seed)
    layers = [LayerSpec(nn.Embedding, args.vocab, args.d)]
    layers += [LayerSpec(MoEBlock, args.d, args.experts, args.ep) for _ in range(args.nlayer)]
    layers += [LayerSpec(Head, args.d, args.vocab)]

    def loss_fn(out, y):
        return F.cross_entropy(out.float().reshape(-1, args.vocab), y.reshape(-1))

    model = PipelineModule(layers=layers, num_stages=args.pp, loss_fn=loss_fn,
                           partition_method=args.partition, base_seed=args.seed)
    # DeepSpeed's pipeline grid: rank = stage * dp + data rank; the expert-parallel groups are
    # runs of E data ranks, so this rank holds global experts [e * n, (e + 1) * n), e its data
    # rank mod E.
    ep_rank = (dist.get_rank() % dp) % args.ep
    for index, module in enumerate(model.forward_funcs):
        for moe in (m for m in module.modules() if isinstance(m, MoE)):
            init_experts(moe, int(model._local_start) + index, ep_rank, args.seed)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {'params': list(model.parameters()), 'name': 'p'})
    cfg = {
        "train_batch_size": T.GLOBAL_BS,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True,
                                                  "adam_w_mode": False}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1000000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    pipeline_training.train(engine, args, micro, 1, world)


if __name__ == '__main__':
    main()

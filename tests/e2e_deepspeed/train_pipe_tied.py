#!/usr/bin/env python3
"""A DeepSpeed PipelineModule with a tied embedding on DeepSpeed's own pipeline grid (no model
axis, so no universal_checkpoint_info and layer files that name no TP rank), on CPU with gloo.

The layers, global indices 0..nlayer+3: the word embedding (TiedLayerSpec 'embed'), the position
embedding, nlayer transformer blocks of ../shared/tools/deepspeed-cpu/train.py, the final norm, and
the word embedding again (TiedLayerSpec 'embed' with a forward_fn: the LM head uses its weight,
so it has no layer file). DeepSpeed keeps a copy of the tied module on the first and the last
stage, named tied_modules.embed.weight on both, and reduces their gradients together.
partition_method 'parameters'. The global batch of every step is fixed (train.py's), so losses
compare across topologies.

Run from ../shared/tools/deepspeed-cpu (its train.py is imported) with its launch.py:
  launch.py NPROC PORT train_pipe_tied.py --pp P [--stage 0|1] [--dtype fp32|bf16] --steps N
            [--save_dir DIR --save_at STEP ...] [--load_dir DIR [--universal]] --out JSON
DP = NPROC / P. --stage 0 with --dtype bf16 makes DeepSpeed pick its BF16 optimizer (BLOOM's
configuration). Rank 0 prints `STEP n loss x` and writes {"losses": {step: loss}} to --out.
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
import train as T  # noqa: E402  (the shared trainer: blocks, data, gloo shims)

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402
import pipeline_training  # noqa: E402  (this folder's, the loop)


class WordEmbedding(nn.Embedding):
    """Token ids to vectors; on the last stage its weight is the LM head's."""


class AddPositions(nn.Module):

    def __init__(self, seq, d):
        super().__init__()
        self.wpe = nn.Embedding(seq, d)

    def forward(self, x):
        return x + self.wpe(torch.arange(x.shape[1]))


def logits(embedding, x):
    return F.linear(x, embedding.weight)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--pp', type=int, default=2)
    p.add_argument('--stage', type=int, default=1)
    p.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32')
    p.add_argument('--steps', type=int, default=6)
    p.add_argument('--save_dir', default=None)
    p.add_argument('--save_at', type=int, nargs='*', default=[])
    p.add_argument('--load_dir', default=None)
    p.add_argument('--universal', action='store_true')
    p.add_argument('--out', default=None)
    p.add_argument('--vocab', type=int, default=67)
    p.add_argument('--d', type=int, default=48)
    p.add_argument('--nlayer', type=int, default=2)
    p.add_argument('--seq', type=int, default=16)
    p.add_argument('--local_rank', type=int, default=-1)
    args = p.parse_args()
    T.install_gloo_shim(bf16=(args.dtype == 'bf16'))

    deepspeed.init_distributed(dist_backend='gloo')
    # torch 1.13's gloo has no _allgather_base: DeepSpeed's list-based fallbacks (train.py's).
    import deepspeed.comm.comm as dscomm
    dscomm.cdb.all_gather_function = None
    dscomm.cdb.reduce_scatter_function = None
    world = dist.get_world_size()
    dp = world // args.pp
    gas = 2
    micro = T.GLOBAL_BS // (dp * gas)
    assert micro * dp * gas == T.GLOBAL_BS

    torch.manual_seed(1234)
    layers = [TiedLayerSpec('embed', WordEmbedding, args.vocab, args.d),
              LayerSpec(AddPositions, args.seq, args.d)]
    layers += [LayerSpec(T.Block, args.d, 4, 4 * args.d) for _ in range(args.nlayer)]
    layers += [LayerSpec(nn.LayerNorm, args.d),
               TiedLayerSpec('embed', WordEmbedding, args.vocab, args.d, forward_fn=logits)]

    def loss_fn(out, y):
        return F.cross_entropy(out.float().reshape(-1, args.vocab), y.reshape(-1))

    model = PipelineModule(layers=layers, num_stages=args.pp, loss_fn=loss_fn,
                           partition_method='parameters', base_seed=1234)
    cfg = {
        "train_batch_size": T.GLOBAL_BS,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True,
                                                  "adam_w_mode": False}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 1000000,
        "checkpoint": {"load_universal": bool(args.universal)},
    }
    if args.dtype == 'bf16':
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                           config=cfg)
    pipeline_training.train(engine, args, micro, gas, world)


if __name__ == '__main__':
    main()

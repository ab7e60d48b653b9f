#!/usr/bin/env python3
"""A DeepSpeed trainer with AutoEP expert parallelism (DeepSpeed 0.19: the config's
"expert_parallel": {"enabled": true, "autoep_size": E, "preset_model": "mixtral"}) on CPU with
gloo, for the AutoEP checks.

The model is a tiny Hugging Face MixtralForCausalLM (transformers): 2 layers, width 32, each
MLP 4 experts (top-2 routing). AutoEP replaces each MLP by a layer whose experts are fused
tensors (experts.w1/w2/w3, one row per local expert): expert-parallel rank e holds experts
[e·4/E, (e+1)·4/E). A ZeRO-1/2 save writes every expert's rows in its own
layer_<L>_expert_<G>_mp_rank_00_model_states.pt and the fused tensors' optimizer state in an
"ep_size_<E>" group partitioned over the expert-data-parallel ranks; a ZeRO-3 save
(--zero_stage 3) writes no expert file: the fused tensors are a flat group of their own in the
zero_pp_rank files, partitioned over those ranks. Every rank (every tensor-parallel group, with
--tp) trains on its own micro batch of a fixed global batch.

DeepSpeed 0.19.8's AutoEP retargets transformers' output recorders at engine set-up, which fails
on transformers 5.x's registry ("_CanRecordRegistry.get() takes 2 positional arguments but 3 were
given"); the loss does not use the recorded router logits, so that step is skipped here.

Launch with launch.py (RANK, WORLD_SIZE, MASTER_ADDR/PORT set); rank 0 prints `STEP n loss x`
for every step it trains and writes {"losses": {step: loss}} to --out.
Usage: train_autoep.py [--ep E] [--tp T] [--zero_stage S] [--dtype fp32|bf16]
         [--deepspeed_config JSON] [--freeze REGEX] --steps N
         [--save_dir DIR [--save_step K]] [--load_dir DIR --load_tag TAG [--universal]]
         --out JSON
  Trains up to global step N (from the loaded step, or 0) and saves global_step<K> to
  --save_dir once step K (default N) is trained: with --load_dir and N the loaded step, a resave
  of the loaded state; with K < N the run goes on to N, as the save's uninterrupted run. The
  config is built from the arguments (expert-parallel size E, default 2; AutoTP's
  tensor-parallel size T, default 1, with "preset_model": "mixtral": DeepSpeed 0.19.8 then folds
  the experts, each expert whole on its tensor-parallel ranks), then the entries of the
  --deepspeed_config file merged in (a nested object into the section of its name), as a trainer
  that takes its config from a file states it on its command line. --freeze: the model's
  parameters whose names REGEX matches (re.search) are frozen before deepspeed.initialize, which
  carries the flag to AutoEP's fused expert tensors.
"""
import argparse
import json
import re
import sys

import deepspeed
import deepspeed.comm as dist
import deepspeed.ops
import torch
from deepspeed.module_inject.auto_ep_presets import base as autoep_base

# The shared-memory collectives op would be compiled at run time; gloo does without it.
deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False
autoep_base.TransformersTopLevelRouterLogitsAdapter.retarget_transformers_output_recorders = \
    lambda *args, **kwargs: None

VOCAB, SEQ, WIDTH, EXPERTS, GLOBAL_BATCH = 64, 8, 32, 4, 8


def model():
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           num_local_experts=EXPERTS, num_experts_per_tok=2,
                           max_position_embeddings=2 * SEQ, tie_word_embeddings=False)
    return MixtralForCausalLM(config)


def merged(config, entries):
    out = dict(config)
    for key, value in entries.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--ep', type=int, default=2)
    parser.add_argument('--tp', type=int, default=1)
    parser.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32')
    parser.add_argument('--deepspeed_config')
    parser.add_argument('--freeze')
    parser.add_argument('--zero_stage', type=int, choices=(1, 2, 3), default=1)
    parser.add_argument('--steps', type=int, required=True)
    parser.add_argument('--save_dir')
    parser.add_argument('--save_step', type=int)
    parser.add_argument('--load_dir')
    parser.add_argument('--load_tag')
    parser.add_argument('--universal', action='store_true')
    parser.add_argument('--out', required=True)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend='gloo')
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1234)
    # AutoTP's ranks g·T .. g·T+T-1 are one tensor-parallel group, which sees one micro batch.
    dp, dp_rank = world // args.tp, rank // args.tp
    config = {
        'train_micro_batch_size_per_gpu': GLOBAL_BATCH // dp,
        'gradient_accumulation_steps': 1,
        'optimizer': {'type': 'Adam', 'params': {'lr': 1e-2, 'torch_adam': True,
                                                 'adam_w_mode': False}},
        'zero_optimization': {'stage': args.zero_stage},
        'expert_parallel': {'enabled': True, 'autoep_size': args.ep, 'preset_model': 'mixtral'},
        'bf16': {'enabled': args.dtype == 'bf16'},
        'steps_per_print': 1000000,
        'checkpoint': {'load_universal': args.universal},
    }
    if args.tp > 1:
        config['tensor_parallel'] = {'autotp_size': args.tp, 'preset_model': 'mixtral'}
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            config = merged(config, json.load(f))
    mixtral = model()
    for name, parameter in mixtral.named_parameters():
        if args.freeze and re.search(args.freeze, name):
            parameter.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=mixtral, model_parameters=mixtral.parameters(),
                                           config=config)
    if args.load_dir:
        path, _ = engine.load_checkpoint(args.load_dir, tag=args.load_tag)
        if path is None:
            sys.exit(f'no checkpoint loaded from {args.load_dir}/{args.load_tag}')
    micro = GLOBAL_BATCH // dp
    losses = {}
    save_step = args.steps if args.save_step is None else args.save_step
    if args.save_dir and engine.global_steps == save_step:
        engine.save_checkpoint(args.save_dir, tag=f'global_step{save_step}')
    for step in range(engine.global_steps + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
        tokens = tokens[dp_rank * micro:(dp_rank + 1) * micro]
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses[step] = (total / world).item()  # tensor-parallel peers compute the same loss
        if rank == 0:
            print(f'STEP {step} loss {losses[step]:.8f}', flush=True)
        if args.save_dir and step == save_step:
            engine.save_checkpoint(args.save_dir, tag=f'global_step{save_step}')
    dist.barrier()
    if rank == 0:
        with open(args.out, 'w') as f:
            json.dump({'losses': losses}, f)


if __name__ == '__main__':
    main()

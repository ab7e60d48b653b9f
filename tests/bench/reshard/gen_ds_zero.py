#!/usr/bin/python3
"""Writes a DeepSpeed v0.14.5 ZeRO-1/2 checkpoint tag without DeepSpeed, fast, for the benchmark.

The files have the names, zip layout and pickle structure DeepSpeed's engine writes
(engine._save_checkpoint / _save_zero_checkpoint with DeepSpeedZeroOptimizer.state_dict), so a
reader cannot tell them from a real save except by the numbers, which are seeded random data:

  SAVE_DIR/latest                                   "<tag>" (no newline)
  SAVE_DIR/<tag>/mp_rank_00_model_states.pt          module tensors are views into one flat buffer
  SAVE_DIR/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   r = 0..dp-1

Partitioning follows stage_1_and_2.py: one param group, params in registration order, the flat
group padded with zeros to a multiple of 2*dp (nccl_start_alignment_factor 2), partition size
P = padded/dp, padding held by the last rank (group_paddings), param_slice_mappings as
mixed_precision_linkage._init_lp_to_hp_mapping computes them. Adam state (step, exp_avg,
exp_avg_sq) is the torch.optim.Adam state_dict of the rank's flat partition.

DeepSpeed's pickled classes (LossScaler, fragment_address, ZeroStageEnum) are the real ones when
DeepSpeed is importable, otherwise stand-ins registered under the same module names, which pickle
to the same bytes. The model is TinyGPT of ../../../../shared/tools/deepspeed-cpu/train.py (same
parameter names and order) at any size: --preset tiny and odd reproduce the fixtures' models.

Usage: gen_ds_zero.py SAVE_DIR [--preset gpt2|tiny|odd] [--dp 4] [--stage 2] [--dtype fp32|bf16]
The tag is written to SAVE_DIR/<tag>.partial and renamed when complete.
"""
import argparse
import dataclasses
import enum
import os
import shutil
import sys
import time
import types
from collections import OrderedDict

import torch
from torch import nn

PRESETS = {
    # GPT-2 small with an untied head: 163M params, 2.6 GB at fp32 (model + master + 2 moments).
    'gpt2': dict(vocab=50257, d=768, nlayer=12, seq=1024),
    # The fixtures' models (../../../../shared/fixtures/deepspeed/README.txt).
    'tiny': dict(vocab=67, d=48, nlayer=2, seq=16),
    'odd': dict(vocab=67, d=30, nlayer=2, seq=16),
}
GLOBAL_BATCH = 8
NCCL_START_ALIGNMENT_FACTOR = 2


def deepspeed_classes():
    """(LossScaler, fragment_address, ZeroStageEnum): DeepSpeed's own, else same-named stand-ins."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
        return LossScaler, fragment_address, ZeroStageEnum
    except ImportError:
        pass
    if 'deepspeed' in sys.modules:
        raise SystemExit('gen_ds_zero: a partial deepspeed package is loaded; cannot add stand-ins')

    class LossScaler:

        def __init__(self, scale=1):
            self.cur_scale = scale
            self.dynamic = False

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 (DeepSpeed's name)
        numel: int
        start: int

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3
        max_stage = 3

    for cls, module in ((LossScaler, 'deepspeed.runtime.fp16.loss_scaler'),
                        (fragment_address, 'deepspeed.utils.tensor_fragment'),
                        (ZeroStageEnum, 'deepspeed.runtime.zero.config')):
        parts = module.split('.')
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault('.'.join(parts[:i]), types.ModuleType('.'.join(parts[:i])))
        cls.__module__ = module
        cls.__qualname__ = cls.__name__
        setattr(sys.modules[module], cls.__name__, cls)
    return LossScaler, fragment_address, ZeroStageEnum


class Block(nn.Module):

    def __init__(self, d, hidden):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, device='meta')
        self.qkv = nn.Linear(d, 3 * d, device='meta')
        self.proj = nn.Linear(d, d, device='meta')
        self.ln2 = nn.LayerNorm(d, device='meta')
        self.fc1 = nn.Linear(d, hidden, device='meta')
        self.fc2 = nn.Linear(hidden, d, device='meta')


class TinyGpt(nn.Module):
    """Parameter names, shapes and order of train.py's TinyGPT; meta tensors (no memory)."""

    def __init__(self, vocab, d, nlayer, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d, device='meta')
        self.wpe = nn.Embedding(seq, d, device='meta')
        self.blocks = nn.ModuleList([Block(d, 4 * d) for _ in range(nlayer)])
        self.ln_f = nn.LayerNorm(d, device='meta')
        self.head = nn.Linear(d, vocab, bias=False, device='meta')
        self.register_buffer('pos_ids', torch.arange(seq), persistent=True)


def seeded(numel, std, generator, chunk=1 << 22):
    """fp32[numel] ~ N(0, std^2), filled chunk by chunk (deterministic for a given generator)."""
    out = torch.empty(numel, dtype=torch.float32)
    for begin in range(0, numel, chunk):
        out[begin:begin + chunk].normal_(0.0, std, generator=generator)
    return out


def ds_config(dp, stage, dtype, lr):
    """The config train.py passes, as DeepSpeed keeps it (torch_adam/adam_w_mode popped)."""
    cfg = {
        'train_batch_size': GLOBAL_BATCH,
        'train_micro_batch_size_per_gpu': GLOBAL_BATCH // dp,
        'gradient_accumulation_steps': 1,
        'optimizer': {
            'type': 'Adam',
            'params': {'lr': lr, 'betas': [0.9, 0.95], 'eps': 1e-8, 'weight_decay': 0.0}
        },
        'gradient_clipping': 1.0,
        'zero_optimization': {'stage': stage},
        'steps_per_print': 1000000,
        'wall_clock_breakdown': False,
        'checkpoint': {'load_universal': False},
    }
    if dtype == 'bf16':
        cfg['bf16'] = {'enabled': True}
    return cfg


def slice_mappings(params, partition_start, partition_size, fragment_address):
    """param_slice_mappings of one rank: the params overlapping [start, start+size) of the flat group."""
    mapping = OrderedDict()
    offset = 0
    for name, numel in params:
        end = offset + numel
        if offset < partition_start + partition_size and end > partition_start:
            fragment_start = max(offset, partition_start)
            fragment_end = min(end, partition_start + partition_size)
            mapping[name] = fragment_address(start=fragment_start - partition_start,
                                             numel=fragment_end - fragment_start)
        offset = end
    return mapping


def generate(save_dir, tag, preset, dp, stage, dtype, seed, step, lr):
    loss_scaler_cls, fragment_address, zero_stage_enum = deepspeed_classes()
    model = TinyGpt(**PRESETS[preset])
    named = [(name, p.numel()) for name, p in model.named_parameters()]
    numel = sum(n for _, n in named)
    alignment = NCCL_START_ALIGNMENT_FACTOR * dp
    padded = (numel + alignment - 1) // alignment * alignment
    padding = padded - numel
    partition = padded // dp
    config = ds_config(dp, stage, dtype, lr)
    generator = torch.Generator().manual_seed(seed)

    # The fp32 master weights of the whole flat group; in fp32 training the module's flat buffer
    # holds the same values, in bf16 their rounding. Padding stays zero, as in DeepSpeed.
    master = torch.zeros(padded, dtype=torch.float32)
    master[:numel] = seeded(numel, 0.02, generator)

    tmp = os.path.join(save_dir, tag + '.partial')
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    flat = master if dtype == 'fp32' else master.to(torch.bfloat16)
    module = model.state_dict()
    offset = 0
    for name, param in model.named_parameters():
        module[name] = flat.narrow(0, offset, param.numel()).view(param.shape)
        offset += param.numel()
    state = dict(module=module,
                 buffer_names=[name for name, _ in model.named_buffers()],
                 optimizer=None,
                 param_shapes=[OrderedDict((name, p.shape) for name, p in model.named_parameters())],
                 frozen_param_shapes=OrderedDict() if stage == 2 else None,
                 shared_params={},
                 frozen_param_fragments=OrderedDict() if stage == 2 else None,
                 lr_scheduler=None,
                 data_sampler=None,
                 random_ltd=None,
                 sparse_tensor_module_names=set(),
                 skipped_steps=0,
                 global_steps=step,
                 global_samples=step * GLOBAL_BATCH,
                 dp_world_size=dp,
                 mp_world_size=1,
                 ds_config=config,
                 ds_version='0.14.5',
                 my_step=step)
    torch.save(state, os.path.join(tmp, 'mp_rank_00_model_states.pt'))
    del state, module, flat

    prefix = 'bf16_' if dtype == 'bf16' else ''
    for rank in range(dp):
        rank_padding = padding if rank == dp - 1 else 0
        lean = partition - rank_padding
        exp_avg = torch.zeros(partition)
        exp_avg[:lean] = seeded(lean, 1e-3, generator)
        exp_avg_sq = torch.zeros(partition)
        exp_avg_sq[:lean] = seeded(lean, 1e-3, generator).square_()
        fp32_partition = master[rank * partition:(rank + 1) * partition].clone().requires_grad_(True)
        optimizer_state_dict = {
            'loss_scaler': loss_scaler_cls(scale=1.0),
            'dynamic_loss_scale': False,
            'overflow': False,
            'clip_grad': 1.0,
            'base_optimizer_state': {
                'state': {0: {'step': torch.tensor(float(step)), 'exp_avg': exp_avg,
                              'exp_avg_sq': exp_avg_sq}},
                # DeepSpeed hands the config's betas list to Adam: one object, pickled once.
                'param_groups': [{'lr': lr, 'betas': config['optimizer']['params']['betas'], 'eps': 1e-8, 'weight_decay': 0.0,
                                  'amsgrad': False, 'maximize': False, 'foreach': None,
                                  'capturable': False, 'differentiable': False, 'fused': False,
                                  'params': [0]}],
            },
            'single_partition_of_fp32_groups': [fp32_partition[:lean]],
            'zero_stage': zero_stage_enum.gradients if stage == 2 else zero_stage_enum.optimizer_states,
            'group_paddings': [rank_padding],
            'partition_count': [dp],
            'ds_version': '0.14.5',
            'param_slice_mappings': [slice_mappings(named, rank * partition, partition, fragment_address)],
        }
        zero_sd = dict(optimizer_state_dict=optimizer_state_dict, ds_config=config, ds_version='0.14.5')
        torch.save(zero_sd, os.path.join(tmp, f'{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt'))

    final = os.path.join(save_dir, tag)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    with open(os.path.join(save_dir, 'latest'), 'w') as f:
        f.write(tag)
    return numel, padding


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('save_dir')
    parser.add_argument('--preset', choices=sorted(PRESETS), default='gpt2')
    parser.add_argument('--dp', type=int, default=4)
    parser.add_argument('--stage', type=int, choices=[1, 2], default=2)
    parser.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32')
    parser.add_argument('--seed', type=int, default=1234)
    parser.add_argument('--step', type=int, default=5)
    parser.add_argument('--tag', default=None, help='default global_step<step>')
    parser.add_argument('--lr', type=float, default=3e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tag = args.tag or f'global_step{args.step}'
    os.makedirs(args.save_dir, exist_ok=True)
    start = time.monotonic()
    numel, padding = generate(args.save_dir, tag, args.preset, args.dp, args.stage, args.dtype, args.seed,
                              args.step, args.lr)
    tag_dir = os.path.join(args.save_dir, tag)
    size = sum(os.path.getsize(os.path.join(tag_dir, f)) for f in os.listdir(tag_dir))
    print(f'gen_ds_zero: {tag_dir}: {args.preset} {numel} params (+{padding} padding), ZeRO-{args.stage} '
          f'{args.dtype} dp={args.dp}, {size / 2**30:.2f} GiB in {time.monotonic() - start:.1f} s')


if __name__ == '__main__':
    main()

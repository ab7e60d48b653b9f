#!/usr/bin/env python3
"""ZeRO-1/2 with `round_robin_gradients` and a Megatron-style mpu's tensor parallelism, in a
pipeline too, end to end under LD_PRELOAD=libucp.so (CPU, gloo), with the release under test.

`"zero_optimization": {"round_robin_gradients": true}` merged into the trainer's config: every
flat buffer holds its parameters round-robin over the DP ranks (param_shapes lists that order),
while DeepSpeed computes param_slice_mappings in the unpermuted order, so its ds_to_universal cuts
the wrong bytes for each parameter (at TP=2 it fails: "assert all(slices[0].equal(other_slice)
...)" in merge_tp_slices, the TP ranks' copies of a replicated parameter differing; 0.19.8, by
hand). The oracles are the uninterrupted run's losses and round trips. CASES, 67 tokens each:
  - tp2dp2: ../shared/tools/deepspeed-cpu/train_tp.py --stage 2, to tp1dp4 and tp4dp1 (other
    round-robin orders), live at tp1dp4 (tp2dp1 the same way by hand);
  - tp1pp2dp2: train_3d.py --untie (PipelineModule, its layer files; ZeRO-1), to tp1pp1dp2 and
    tp2pp2dp1, live at tp1pp1dp2 (tp2pp1dp2 the same way by hand).

One CTest test, the steps of ds_z3_tp_e2e.py for each case, in WORK/tp_round_robin/<case>:
  1. The run saves global_step3 without and with the preload: the same bytes and losses,
     indexed at save.
  2. `ucp export --format deepspeed-universal` writes, for every parameter, an fp32 master weight
     equal to the model's weight in the save's module (fp32 training keeps the two equal): what
     ds_to_universal gets wrong in this mode.
  3. `ucp reshard` to each target: DeepSpeed's plain load of ucp's files there, the same config,
     trains steps 4..6 within 1e-5 of the uninterrupted run, and ucp's files resharded back to the
     save grid are the save.
  4. A plain load_checkpoint at the resume grid under the preload (UCP_TOPOLOGY naming tp and pp):
     losses bit-identical to DeepSpeed's load of `ucp reshard`'s files there, every file served
     `ucp reshard`'s.

Usage: ds_tp_round_robin_e2e.py --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI
                                --deepspeed VERSION [--required]
"""
import json
import os
import shutil
import sys

import torch

import ds_z3_tp_e2e as z3
from ds_z3_tp_e2e import Case

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'deepspeed'))
import harness  # noqa: E402

ROUND_ROBIN = {'zero_optimization': {'round_robin_gradients': True}}
CASES = [Case('tp2dp2', (2, 2), 67, [(1, 4), (4, 1)], (1, 4), stage=2, config=ROUND_ROBIN),
         Case('tp1pp2dp2', (1, 2, 2), 67, [(1, 1, 2), (2, 2, 1)], (1, 1, 2), stage=1,
              config=ROUND_ROBIN, trainer='train_3d.py', trainer_args=['--untie'])]


def module_weights(report, args, tag_dir):
    """The save's weights by parameter name: from a pipeline's layer files of one TP rank (each
    file's keys named by the index's adapter_state.pipeline), else from the module of ucp's
    T=1 x DP=1 files (whole tensors, ucp's merge of the TP ranks' modules); None on a failure."""
    with open(os.path.join(tag_dir, '.ucp', 'index.json')) as index_file:
        index = json.load(index_file)
    pipeline = index['adapter_state'].get('pipeline')
    if pipeline is not None:
        weights = {}
        for layer in pipeline['layers']:
            path = os.path.join(tag_dir, index['files'][layer['file']]['path'])
            state = torch.load(path, map_location='cpu', weights_only=False)
            weights.update({name: state[key] for key, name in layer['params'].items()})
        return weights
    whole = os.path.join(args.work, 'whole')
    shutil.rmtree(whole, ignore_errors=True)
    status, output = harness.run_ucp_output(args.ucp, 'reshard', tag_dir, '--to', 'tp=1,dp=1',
                                            '--out', whole)
    if not report.check(status == 0, f'ucp reshard to tp1dp1 exited {status}: {output[-2000:]}'):
        return None
    return torch.load(os.path.join(whole, z3.TAG, 'mp_rank_00_model_states.pt'),
                      map_location='cpu', weights_only=False)['module']


def check_export(report, args, env, tag_dir):
    """Every parameter's fp32 in `ucp export`'s folder equals its weight in the save's module."""
    del env  # ds_to_universal mislabels this tag: nothing to run
    export = os.path.join(args.work, 'export')
    shutil.rmtree(export, ignore_errors=True)
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if not report.check(status == 0, f'ucp export of {tag_dir} exited {status}: {output[-2000:]}'):
        return
    module = module_weights(report, args, tag_dir)
    if module is None:
        return
    zero = os.path.join(export, 'zero')
    names = sorted(os.listdir(zero))
    report.check(sorted(n for n in names if n != 'optimizer_state.pt') == sorted(module),
                 f'export parameters {names}, module {sorted(module)}')
    differ = []
    for name, weight in module.items():
        fp32 = torch.load(os.path.join(zero, name, 'fp32.pt'), map_location='cpu',
                          weights_only=False)
        fp32 = fp32['param'] if isinstance(fp32, dict) else fp32
        # The vocabulary: the export's rows unpadded, the module's padded at T=1 with zeros.
        rows = fp32.shape[0] if fp32.dim() else 0
        if not (fp32.shape[1:] == weight.shape[1:] and rows <= weight.shape[0] and
                torch.equal(fp32, weight[:rows]) and not weight[rows:].any()):
            differ.append(name)
    report.check(not differ, f'export fp32 of {differ} differs from the module weights')
    print(f'ucp export: the fp32 of each of {len(module)} parameters = its module weight')


def main():
    z3.run_cases('tp_round_robin', CASES, check_export)


if __name__ == '__main__':
    main()

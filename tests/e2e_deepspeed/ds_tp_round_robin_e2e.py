#!/usr/bin/env python3
"""ZeRO-2 with `round_robin_gradients` and a Megatron-style mpu's tensor parallelism, end to end
under LD_PRELOAD=libucp.so (CPU, gloo), with the release under test.

../shared/tools/deepspeed-cpu/train_tp.py --stage 2 (67 tokens: padded to 68, 72 and 80 at TP=1,
2 and 4), `"zero_optimization": {"round_robin_gradients": true}` merged into its config: every TP
rank's flat buffer holds its slices round-robin over the DP ranks (param_shapes lists that order),
while DeepSpeed computes param_slice_mappings in the unpermuted order. Its ds_to_universal
therefore cuts the wrong bytes for each parameter, and fails on such a tag ("assert all(slices[0]
.equal(other_slice) ...)" in merge_tp_slices: the TP ranks' copies of a replicated parameter
differ; 0.19.8, by hand), so the oracles are the uninterrupted run's losses and round trips.

One CTest test, the steps of ds_z3_tp_e2e.py for a T=2 x DP=2 save, in WORK/tp_round_robin:
  1. The run saves global_step3 without and with the preload: the same bytes and losses,
     indexed at save.
  2. `ucp export --format deepspeed-universal` writes, for every parameter, an fp32 master weight
     equal to the model's weight ucp reads from the module (the flat buffer's views; fp32
     training keeps the two equal): what ds_to_universal gets wrong in this mode.
  3. `ucp reshard` to T=1 x DP=4, T=4 x DP=1 and T=2 x DP=1 (other round-robin orders): DeepSpeed's
     plain load of ucp's files there, the same config, trains steps 4..6 within 1e-5 of the
     uninterrupted run, and ucp's files resharded back to T=2 x DP=2 are the save.
  4. A plain load_checkpoint at T=1 x DP=4 under the preload (UCP_TOPOLOGY=tp=1): losses
     bit-identical to DeepSpeed's load of `ucp reshard`'s files there, every file served
     `ucp reshard`'s.

Usage: ds_tp_round_robin_e2e.py --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI
                                --deepspeed VERSION [--required]
"""
import argparse
import os
import shutil
import sys

import torch

import ds_e2e
import ds_z3_tp_e2e as z3
from ds_z3_tp_e2e import Case

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'deepspeed'))
import harness  # noqa: E402

CASE = Case('', (2, 2), 67, [(1, 4), (4, 1), (2, 1)], (1, 4), stage=2,
            config={'zero_optimization': {'round_robin_gradients': True}})


def check_export(report, args, env, tag_dir):
    """Every parameter's fp32 in `ucp export`'s folder equals its weight in the module of ucp's
    T=1 x DP=1 files (whole tensors, from the save's module views)."""
    del env  # ds_to_universal fails on this tag: nothing to run
    export = os.path.join(args.work, 'export')
    whole = os.path.join(args.work, 'whole')
    for out in (export, whole):
        shutil.rmtree(out, ignore_errors=True)
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if not report.check(status == 0, f'ucp export of {tag_dir} exited {status}: {output[-2000:]}'):
        return
    status, output = harness.run_ucp_output(args.ucp, 'reshard', tag_dir, '--to', 'tp=1,dp=1',
                                            '--out', whole)
    if not report.check(status == 0, f'ucp reshard to tp1dp1 exited {status}: {output[-2000:]}'):
        return
    module = torch.load(os.path.join(whole, z3.TAG, 'mp_rank_00_model_states.pt'),
                        map_location='cpu', weights_only=False)['module']
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
    parser = argparse.ArgumentParser()
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    if not os.path.isfile(os.path.join(args.tools, 'train_tp.py')):
        ds_e2e.skip(f'no DeepSpeed trainer train_tp.py at {args.tools}')
    env = ds_e2e.trainer_environment(args)
    args.work = os.path.join(args.work, 'tp_round_robin')
    report = harness.Report('tp round robin')
    z3.check_case(report, args, env, CASE, export_check=check_export)
    report.exit()


if __name__ == '__main__':
    main()

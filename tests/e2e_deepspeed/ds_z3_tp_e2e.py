#!/usr/bin/env python3
"""ZeRO-3 with a Megatron-style mpu's tensor parallelism, end to end under LD_PRELOAD=libucp.so
(CPU, gloo), with the release under test.

../shared/tools/deepspeed-cpu/train_tp.py --stage 3: a GPT of column/row-parallel attention and
MLP and a vocabulary-parallel embedding and output layer (padded to a multiple of 4·TP), the mpu
given to deepspeed.initialize, universal_checkpoint_info recording Megatron's patterns (no AutoTP
affine map). DeepSpeed writes zero_pp_rank_<dp>_mp_rank_<tp>_{model,optim}_states.pt, each
parameter's TP slice partitioned over the DP ranks. Its ds_to_universal converts the save (at
TP=1 keeping the vocabulary's padding rows, at TP>1 dropping them), but its universal load of the
conversion at another TP size is wrong (0.19.8, by hand with 67 tokens: at T=1 x DP=4 every
parameter after the padded embedding sits 12 elements early in rank 0's flat group, steps 4..6
4.20902395 4.20460224 4.20231104 where the run gives 4.14673376 3.99525166 3.96607852; at
T=2 x DP=1 it stops, "start (32352) + length (6912) exceeds dimension size (32880)"), so the
oracles are the uninterrupted run's losses and round trips.

One CTest test, for each of CASES (in WORK/z3_tp/<work>: a T=2 x DP=2 save of 68 tokens, padded
to 72 and 80 at TP=2 and 4; a T=1 x DP=2 save of 67 tokens, padded to 68 at TP=1, where the
export and ucp's atoms keep the padding row)
  1. The save grid's run saves global_step3 without and with the preload: the same bytes and
     losses, indexed at save.
  2. `ucp export --format deepspeed-universal` = ds_to_universal's files, every object and bit.
  3. `ucp reshard` to each target: DeepSpeed's plain (strict) load of ucp's files there trains
     steps 4..6 within TOLERANCE of the uninterrupted run, and ucp's files resharded back to the
     save grid are the save, every object and bit but the run's micro batch.
  4. A plain load_checkpoint at the case's resume grid under the preload, told the TP degree by
     UCP_TOPOLOGY: losses bit-identical to DeepSpeed's load of `ucp reshard`'s files there, every
     file served `ucp reshard`'s.

Usage: ds_z3_tp_e2e.py --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI --deepspeed VERSION
                       [--required]
"""
import argparse
import json
import os
import shutil
import sys

import ds_e2e
from ds_e2e import fail, float32_bits, losses, print_losses

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'deepspeed'))
import harness  # noqa: E402

TAG = 'global_step3'
SAVE_AT, STEPS = 3, 6
# |Δloss| allowed against the uninterrupted run: float32 sums over other TP and DP splits.
TOLERANCE = 1e-5


class Case:
    """A save at `save` of `vocab` tokens in WORK/<work>, resharded to each of `targets` and
    resumed under the preload at `resume`, each grid (tp, dp) or (tp, pp, dp); ZeRO stage `stage`,
    `config` (where given) merged into the DeepSpeed config of `trainer`, run with
    `trainer_args` besides the grid's."""

    def __init__(self, work, save, vocab, targets, resume, stage=3, config=None,
                 trainer='train_tp.py', trainer_args=()):
        self.work, self.save, self.vocab = work, save, vocab
        self.targets, self.resume = targets, resume
        self.stage, self.config = stage, config
        self.trainer, self.trainer_args = trainer, list(trainer_args)


CASES = [Case('tp2dp2', (2, 2), 68, [(1, 4), (4, 1), (2, 1)], (1, 4)),
         Case('padded_tp1', (1, 2), 67, [(4, 1)], (4, 1))]


def axes(grid):
    """[(axis, degree)] of a grid (tp, dp) or (tp, pp, dp)."""
    return list(zip(('tp', 'dp') if len(grid) == 2 else ('tp', 'pp', 'dp'), grid))


def name_of(grid):
    return ''.join(f'{axis}{degree}' for axis, degree in axes(grid))


def spec_of(grid, without=()):
    """`ucp reshard --to`'s and UCP_TOPOLOGY's form of `grid`, leaving out the axes `without`."""
    return ','.join(f'{axis}={degree}' for axis, degree in axes(grid) if axis not in without)


def world_of(grid):
    world = 1
    for degree in grid:
        world *= degree
    return world


def launch(args, env, case, grid, name, extra):
    """The case's trainer at `grid` through STEPS; returns (status, seconds, output)."""
    script = [case.trainer]
    if case.config:
        script = [ds_e2e.WITH_DS_CONFIG, json.dumps(case.config)] + script
    degrees = [f'--{axis}={degree}' for axis, degree in axes(grid) if axis != 'dp']
    command = [sys.executable, 'launch.py', str(world_of(grid)), ds_e2e.PORT] + script + \
        degrees + case.trainer_args + [
            '--stage', str(case.stage), '--vocab', str(case.vocab), '--steps', str(STEPS),
            '--out', os.path.join(args.work, name + '.json')] + extra
    log = os.path.join(args.work, name + '.log')
    return ds_e2e.run_past_flakes(lambda: ds_e2e.run_launcher(command, args.tools, env, log),
                                  STEPS, ds_e2e.save_dir_of(extra))


def reshard(args, source, grid, name):
    out = os.path.join(args.work, name)
    shutil.rmtree(out, ignore_errors=True)
    status, output = harness.run_ucp_output(args.ucp, 'reshard', source, '--to', spec_of(grid),
                                            '--out', out)
    if status != 0:
        fail(f'ucp reshard {source} to {name_of(grid)} exited {status}: {output[-2000:]}')
    return os.path.join(out, TAG)


def compare(report, expected, got, what):
    """The tag `got` holds `expected`'s .pt files, every object and bit but the run's micro
    batch."""
    names = sorted(n for n in os.listdir(expected) if n.endswith('.pt'))
    have = sorted(n for n in os.listdir(got) if n.endswith('.pt'))
    report.check(have == names, f'{what}: files {have}, expected {names}')
    for name in names:
        report.diffs(harness.compare_files(os.path.join(expected, name), os.path.join(got, name),
                                           harness.RUN_CONFIG_FIELDS), f'{what}/{name}')


def check_export(report, args, env, tag_dir):
    """`ucp export --format deepspeed-universal` of `tag_dir` = ds_to_universal's files, in
    WORK/export and WORK/export_universal."""
    universal = os.path.join(args.work, 'export_universal', TAG)
    shutil.rmtree(os.path.dirname(universal), ignore_errors=True)
    ds_e2e.ds_to_universal(env, tag_dir, universal)
    export = os.path.join(args.work, 'export')
    shutil.rmtree(export, ignore_errors=True)
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if report.check(status == 0, f'ucp export of {tag_dir} exited {status}: {output[-2000:]}'):
        names = harness.compare_export(report, 'export', universal, export)
        print(f'ucp export = ds_to_universal: {len(names)} files')


def check_target(report, args, env, case, tag_dir, grid, full):
    """DeepSpeed's plain load of ucp's files at `grid` trains within TOLERANCE of `full`, and
    those files resharded back to the case's save grid are the save. Returns the load's losses."""
    name = name_of(grid)
    out = reshard(args, tag_dir, grid, 'reshard_' + name)
    status, _, output = launch(args, env, case, grid, 'load_' + name,
                               ['--load_dir', os.path.dirname(out)])
    if status != 0:
        fail(f'DeepSpeed\'s load of ucp\'s {name} files exited {status}:\n{output[-3000:]}')
    got = losses(os.path.join(args.work, f'load_{name}.json'))
    print_losses(f'losses {name} (DeepSpeed\'s load of ucp\'s files)', got)
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    worst = max(abs(got[s] - full[s]) for s in steps)
    report.check(sorted(got) == steps and worst <= TOLERANCE,
                 f'{name}: max |Δloss| {worst:.3g} against the uninterrupted run')
    back = reshard(args, out, case.save, f'reshard_{name}_back')
    compare(report, tag_dir, back, f'{name} -> {name_of(case.save)}')
    print(f'{name}: max |Δloss| {worst:.3g}; back = the save')
    return got


def check_live_resume(args, env, case, oracle):
    """A plain load_checkpoint of WORK/ckpt at the case's resume grid under the preload, told the
    TP (and pp) degree by UCP_TOPOLOGY: losses bit-identical to `oracle` (DeepSpeed's load of
    ucp's files there), every file it reads that the save lacks served as `ucp reshard` wrote
    it."""
    degrees = dict(axes(case.resume))
    logs = os.path.join(args.work, 'logs_preload')
    shutil.rmtree(logs, ignore_errors=True)
    run_env = dict(ds_e2e.preload_env(env, args.lib, logs),
                   UCP_TOPOLOGY=spec_of(case.resume, without=('dp',)))
    tag_dir = os.path.join(args.work, 'ckpt', TAG)
    status, seconds, output = launch(args, run_env, case, case.resume, 'preload',
                                     ['--load_dir', os.path.dirname(tag_dir)])
    if status != 0:
        fail(f'plain load_checkpoint at {name_of(case.resume)} under the preload exited '
             f'{status}:\n{output[-3000:]}\nucp logs:\n{ds_e2e.log_tail(logs)}')
    got = losses(os.path.join(args.work, 'preload.json'))
    print_losses(f'losses {name_of(case.resume)} under the preload ({seconds:.1f} s)', got)
    if {s: float32_bits(v) for s, v in got.items()} != \
            {s: float32_bits(v) for s, v in oracle.items()}:
        fail('the resume under the preload differs from DeepSpeed\'s load of ucp\'s files')
    print('losses bit-identical to DeepSpeed\'s load of `ucp reshard`\'s files')
    resharded = os.path.join(args.work, 'reshard_' + name_of(case.resume), TAG)
    served = sorted(n for n in os.listdir(resharded) if n.endswith('.pt'))
    view = f'tp{degrees["tp"]}-pp{degrees.get("pp", 1)}-dp{degrees["dp"]}'
    ds_e2e.check_served(os.path.join(tag_dir, '.ucp', 'views', view), resharded, served,
                        spec_of(case.resume), logs)


def check_case(report, args, env, case, export_check=check_export):
    """Steps 1-4 of the module's docstring for `case`, in WORK/<case.work>; step 2 by
    `export_check(report, args, env, tag_dir)`."""
    args = argparse.Namespace(**dict(vars(args), work=os.path.join(args.work, case.work)))
    label = f'{name_of(case.save)} ZeRO-{case.stage}, {case.vocab} tokens'

    def run(name, run_env, save_dir):
        return launch(args, run_env, case, case.save, name,
                      ['--save_dir', save_dir, '--save_at', str(SAVE_AT)])
    tag_dir, _, _ = ds_e2e.save_with_and_without_preload(args, env, args.work, label, run)
    full = losses(os.path.join(args.work, 'plain.json'))
    export_check(report, args, env, tag_dir)
    loaded = {grid: check_target(report, args, env, case, tag_dir, grid, full)
              for grid in case.targets}
    print_losses('losses uninterrupted', {s: full[s] for s in range(SAVE_AT + 1, STEPS + 1)})
    check_live_resume(args, env, case, loaded[case.resume])


def run_cases(work, cases, export_check=check_export):
    """The test's command line read, check_case for each of `cases` in WORK/<work>; exits with
    the report (skipped without the shared trainers)."""
    parser = argparse.ArgumentParser()
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    if not os.path.isfile(os.path.join(args.tools, 'train_tp.py')):
        ds_e2e.skip(f'no DeepSpeed trainer train_tp.py at {args.tools}')
    env = ds_e2e.trainer_environment(args)
    args.work = os.path.join(args.work, work)
    report = harness.Report(work)
    for case in cases:
        check_case(report, args, env, case, export_check)
    report.exit()


def main():
    run_cases('z3_tp', CASES)


if __name__ == '__main__':
    main()

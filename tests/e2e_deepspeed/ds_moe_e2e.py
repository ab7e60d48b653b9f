#!/usr/bin/env python3
"""Real DeepSpeed-MoE end to end under LD_PRELOAD=libucp.so (CPU, gloo).

train_moe.py of ../shared/tools/deepspeed-cpu: train.py's model with each block's MLP a
deepspeed.moe.layer.MoE of 4 experts at expert-parallel size 2 (top-1, no token dropping, no
random gating: the function does not depend on the layout), ZeRO-2, fp32, a fixed global batch.
Saved at DP=4, resumed at DP=2, where DeepSpeed refuses the plain load ("used a DP world size of
4 but the current world size is 2") and has no universal path (ds_to_universal fails on MoE
tags). One CTest test per step, sharing WORK:

  save     DP=4 without and with the preload: steps 1..STEPS, saves tag global_step<SAVE_AT>;
           under the preload the save must leave a committed index, DeepSpeed's files byte for
           byte those of the run without it, and the same losses.
  preload  the plain load_checkpoint at DP=2 under the preload, steps SAVE_AT+1..STEPS. With no
           DeepSpeed oracle, the losses are held to the uninterrupted DP=4 run's within
           TOLERANCE, and the served files must be the bytes `ucp reshard --to dp=2` writes.
  preload_ep1  the same at DP=2 with the trainer at expert-parallel size 1 (every rank holds all
           4 experts), stated only on its command line as Megatron-LM's
           --expert-model-parallel-size 1 (megatron_args.py): ucp's log must name it as the
           evidence; served files `ucp reshard --to dp=2,ep=1`'s.

Usage: ds_moe_e2e.py STEP --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI --deepspeed VERSION
                      [--required]
Exit status 77 with the reason when that DeepSpeed is not importable (ds_e2e.py's rule).
"""
import argparse
import os
import shutil
import subprocess
import sys

import ds_e2e
from ds_e2e import fail, log_tail, losses, preload_env, print_losses

SAVE_AT, STEPS = 3, 6
TAG = f'global_step{SAVE_AT}'
SAVE_DP, RESUME_DP = 4, 2
SAVE_EP = 2
TRAINER = ['train_moe.py', '--stage', '2', '--experts', '4', '--k', '1']
# |Δloss| allowed against the uninterrupted DP=4 run: float32 summation over 2 against 4 partial
# gradients (the fixtures' uninterrupted DP=4 and DP=2 runs differ by up to 4.8e-7).
TOLERANCE = 1e-5


MEGATRON_ARGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'megatron_args.py')
EP_FLAG = '--expert-model-parallel-size'


def launch(args, env, nproc, name, extra, ep=None):
    """train_moe.py at `nproc` ranks: at SAVE_EP, or with `ep` given as Megatron's flag."""
    trainer = TRAINER + ['--ep', str(SAVE_EP)] if ep is None else \
        [MEGATRON_ARGS] + TRAINER + [EP_FLAG, str(ep)]
    command = [sys.executable, 'launch.py', str(nproc), ds_e2e.PORT] + trainer + \
        ['--steps', str(STEPS), '--out', os.path.join(args.work, name + '.json')] + extra
    return ds_e2e.run_past_flakes(
        lambda: ds_e2e.run_launcher(command, args.tools, env, os.path.join(args.work, name + '.log')),
        STEPS, ds_e2e.save_dir_of(extra))


def step_save(args, env):
    def run(name, run_env, save_dir):
        return launch(args, run_env, SAVE_DP, name,
                      ['--save_dir', save_dir, '--save_at', str(SAVE_AT)])
    tag_dir, _, files = ds_e2e.save_with_and_without_preload(
        args, env, args.work, f'DP={SAVE_DP} MoE', run)
    if not any(n.startswith('layer_0_expert_') for n in files):
        fail(f'no expert files among {files}')
    inspect = subprocess.run([args.ucp, 'inspect', tag_dir], capture_output=True, text=True)
    if 'adapter deepspeed-moe' not in inspect.stdout:
        fail(f'the index is not the deepspeed-moe adapter\'s:\n{inspect.stdout[:500]}'
             f'{inspect.stderr}')
    print(f'index committed by the deepspeed-moe adapter; {len(files)} files byte-identical to '
          f'the run without the preload')


def step_preload(args, env, ep=None):
    """The resume at DP=2 under the preload; with `ep`, at that expert-parallel size."""
    work = args.work
    name = 'preload' if ep is None else f'preload_ep{ep}'
    logs = os.path.join(work, 'logs_' + name)
    shutil.rmtree(logs, ignore_errors=True)
    status, seconds, output = launch(args, preload_env(env, args.lib, logs), RESUME_DP, name,
                                     ['--load_dir', os.path.join(work, 'ckpt')], ep)
    where = f'DP={RESUME_DP}' + ('' if ep is None else f' and expert-parallel size {ep}')
    if status != 0:
        fail(f'plain load_checkpoint at {where} under the preload exited {status}:\n'
             f'{output[-3000:]}\nucp logs:\n{log_tail(logs)}')
    print(f'{where}: plain resume under the preload: {seconds:.1f} s')
    if ep is not None:
        said = f'ep={ep} ({EP_FLAG} {ep})'
        logged = ''.join(open(os.path.join(logs, n), errors='replace').read()
                         for n in sorted(os.listdir(logs)))
        if said not in logged:
            fail(f'no ucp log names {said!r} as the evidence of the target:\n{log_tail(logs)}')
        print(f'ucp took the target from the trainer: {said}')
    got = losses(os.path.join(work, name + '.json'))
    full = losses(os.path.join(work, 'plain.json'))
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    if sorted(got) != steps:
        fail(f'resumed steps {sorted(got)}, expected {steps}')
    print_losses('losses preload', got)
    print_losses(f'losses DP={SAVE_DP} uninterrupted', {s: full[s] for s in steps})
    worst = max(abs(got[s] - full[s]) for s in steps)
    if worst > TOLERANCE:
        fail(f'max |Δloss| {worst:.3g} against the uninterrupted run exceeds {TOLERANCE}')
    print(f'max |Δloss| against the uninterrupted DP={SAVE_DP} run: {worst:.3g}')
    view = os.path.join(work, 'ckpt', TAG, '.ucp', 'views',
                        f'tp1-pp1-dp{RESUME_DP}' + ('' if ep is None else f'-ep{ep}'))
    to = f'dp={RESUME_DP}' + ('' if ep is None else f',ep={ep}')
    resharded = os.path.join(work, 'reshard_' + name)
    shutil.rmtree(resharded, ignore_errors=True)
    subprocess.run([args.ucp, 'reshard', os.path.join(work, 'ckpt', TAG), '--to', to, '--out',
                    resharded], check=True, stdout=subprocess.DEVNULL)
    resharded = os.path.join(resharded, TAG)
    # The expert files are the saved ones, passed through; the others are made for the target.
    served = sorted(n for n in os.listdir(resharded)
                    if n.endswith('.pt') and not n.startswith(('layer_', 'expp_')))
    for name in served:
        stored = os.path.join(view, 'served.' + name)
        if not os.path.isfile(stored):
            fail(f'{name} was not served from the view cache ({stored}); ucp logs:\n'
                 f'{log_tail(logs)}')
        if open(stored, 'rb').read() != open(os.path.join(resharded, name), 'rb').read():
            fail(f'{stored} differs from `ucp reshard`\'s {name}')
    print(f'served files equal `ucp reshard --to {to}`: {" ".join(served)}')


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('step', choices=['save', 'preload', 'preload_ep1'])
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    if not os.path.isfile(os.path.join(args.tools, TRAINER[0])):
        ds_e2e.skip(f'no DeepSpeed trainer {TRAINER[0]} at {args.tools}')
    env = ds_e2e.trainer_environment(args)
    args.work = os.path.join(args.work, 'moe')
    if args.step != 'save' and not os.path.isfile(os.path.join(args.work, 'save.json')):
        fail(f'no saved checkpoint in {args.work} (run the save step first)')
    {'save': step_save, 'preload': step_preload,
     'preload_ep1': lambda *a: step_preload(*a, ep=1)}[args.step](args, env)


if __name__ == '__main__':
    main()

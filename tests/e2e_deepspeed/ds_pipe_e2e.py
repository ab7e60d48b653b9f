#!/usr/bin/env python3
"""Real DeepSpeed pipeline parallelism end to end under LD_PRELOAD=libucp.so (CPU, gloo).

The trainer is ../shared/tools/deepspeed-cpu/train_pipe.py (PipelineModule of 4 layers,
partition_method 'uniform', ZeRO-1, fp32; the global batch of every step is fixed, so losses
compare across (pp, dp)). One CTest test per step, sharing WORK/pipe:

  save        PP=2 x DP=2 (4 ranks) without and with the preload: steps 1..STEPS, saves tag
              global_step<SAVE_AT>; under the preload the save must leave a committed index,
              DeepSpeed's files byte for byte those of the run without it, and the same losses.
  universal   DeepSpeed's own path, no preload: ds_to_universal.py, then the universal load at
              PP=1 x DP=2 and steps SAVE_AT+1..STEPS (the oracle).
  preload     the plain load_checkpoint at PP=1 x DP=2 under the preload with UCP_TOPOLOGY=pp=1
              (the world size alone cannot tell pp: see the README) and the same steps: every
              loss must have the same float32 bits as the universal run's; the served files must
              be the bytes `ucp reshard --to pp=1,dp=2` writes.
  preload_megatron_args  the same resume without UCP_TOPOLOGY, the trainer given its pp as
              Megatron's --pipeline-model-parallel-size (megatron_args.py): ucp must take pp=1
              from those arguments (its log names them) and the losses must be as above.

Usage: ds_pipe_e2e.py STEP [--dtype fp32|bf16] --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI
                      --deepspeed VERSION [--required]
--dtype bf16 runs the same steps in bf16 (DeepSpeed's ZeRO-1 bf16 optimizer, bf16_ optimizer
files), in WORK/pipe_bf16.
Exit status 77 with the reason when that DeepSpeed is not importable (ds_e2e.py's rule).
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

import ds_e2e
from ds_e2e import fail, float32_bits, log_tail, losses, preload_env, print_losses

SAVE_PP, SAVE_DP = 2, 2
RESUME_PP, RESUME_DP = 1, 2
SAVE_AT, STEPS = 3, 6
TAG = f'global_step{SAVE_AT}'
VIEW = f'tp1-pp{RESUME_PP}-dp{RESUME_DP}'


MEGATRON_ARGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'megatron_args.py')


def launch(args, env, pp, dp, log, extra, megatron_args=False):
    """Runs train_pipe.py at pp x dp ranks, given its pp as --pp or, with megatron_args, as
    Megatron's --pipeline-model-parallel-size (megatron_args.py); returns (exit status, seconds,
    output)."""
    trainer = ([MEGATRON_ARGS, 'train_pipe.py', '--pipeline-model-parallel-size', str(pp)]
               if megatron_args else ['train_pipe.py', '--pp', str(pp)]) + ['--dtype', args.dtype]
    command = [sys.executable, 'launch.py', str(pp * dp), ds_e2e.PORT] + trainer + extra
    return ds_e2e.run_launcher(command, args.tools, env, log)


def step_save(args, env, work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    logs = os.path.join(work, 'logs_save')
    runs = {}
    for name, run_env, save_dir in (('plain', env, 'ckpt_plain'),
                                    ('save', preload_env(env, args.lib, logs), 'ckpt')):
        status, seconds, output = launch(
            args, run_env, SAVE_PP, SAVE_DP, os.path.join(work, f'{name}.log'),
            ['--steps', str(STEPS), '--save_dir', os.path.join(work, save_dir),
             '--save_at', str(SAVE_AT), '--out', os.path.join(work, f'{name}.json')])
        if status != 0:
            fail(f'DeepSpeed pp{SAVE_PP}dp{SAVE_DP} training ({name}) exited {status}:\n'
                 f'{output[-3000:]}')
        runs[name] = losses(os.path.join(work, f'{name}.json'))
        print(f'pp{SAVE_PP}dp{SAVE_DP} run {"under" if name == "save" else "without"} the preload: '
              f'{seconds:.1f} s')
    print_losses(f'losses pp{SAVE_PP}dp{SAVE_DP}', runs['save'])
    if {s: float32_bits(v) for s, v in runs['save'].items()} != \
            {s: float32_bits(v) for s, v in runs['plain'].items()}:
        fail('the preload changed the losses of the saving run')
    tag_dir = os.path.join(work, 'ckpt', TAG)
    index = os.path.join(tag_dir, '.ucp', 'index.json')
    if not os.path.isfile(index):
        fail(f'no committed index {index} after the save; ucp logs:\n{log_tail(logs)}')
    files = sorted(n for n in os.listdir(tag_dir) if n.endswith('.pt'))
    prefix = 'bf16_' if args.dtype == 'bf16' else ''
    expected = sorted([f'layer_{layer:02d}-model_states.pt' for layer in range(4)] +
                      [f'mp_rank_{s:02d}_model_states.pt' for s in range(SAVE_PP)] +
                      [f'{prefix}zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt'
                       for s in range(SAVE_PP) for r in range(SAVE_DP)])
    if files != expected:
        fail(f'tag files {files}, expected {expected}')
    for name in files:
        plain = os.path.join(work, 'ckpt_plain', TAG, name)
        if open(plain, 'rb').read() != open(os.path.join(tag_dir, name), 'rb').read():
            fail(f'{name} saved under the preload differs from {plain}')
    print(f'index committed: {index} ({os.path.getsize(index)} bytes)')


def step_universal(args, env, work):
    tag_dir = os.path.join(work, 'ckpt', TAG)
    universal = os.path.join(work, 'universal')
    shutil.rmtree(universal, ignore_errors=True)
    start = time.monotonic()
    convert = subprocess.run(
        [sys.executable, os.path.join(env['DS_PACKAGE'], 'checkpoint', 'ds_to_universal.py'),
         '--input_folder', tag_dir, '--output_folder', os.path.join(universal, f'{TAG}_universal'),
         '--inject_missing_state'], env=env, capture_output=True, text=True)
    convert_seconds = time.monotonic() - start
    if convert.returncode != 0:
        fail(f'ds_to_universal.py exited {convert.returncode}:\n{convert.stderr[-2000:]}')
    status, seconds, output = ds_e2e.run_oracle(lambda: launch(
        args, env, RESUME_PP, RESUME_DP, os.path.join(work, 'universal.log'),
        ['--steps', str(STEPS), '--load_dir', universal, '--universal',
         '--out', os.path.join(work, 'universal.json')]))
    if status != 0:
        fail(f'DeepSpeed universal load at pp{RESUME_PP}dp{RESUME_DP} exited {status}:\n'
             f'{output[-3000:]}')
    print(f'ds_to_universal.py: {convert_seconds:.1f} s; pp{RESUME_PP}dp{RESUME_DP} universal '
          f'resume: {seconds:.1f} s')
    print_losses('losses universal', losses(os.path.join(work, 'universal.json')))


def step_preload(args, env, work, megatron_args=False):
    """The resume at the target under the preload: told pp by UCP_TOPOLOGY, or, with
    megatron_args, by nothing but the trainer's own --pipeline-model-parallel-size."""
    name = 'preload_megatron_args' if megatron_args else 'preload'
    logs = os.path.join(work, 'logs_' + name)
    shutil.rmtree(logs, ignore_errors=True)
    run_env = preload_env(env, args.lib, logs)
    if not megatron_args:
        run_env['UCP_TOPOLOGY'] = f'pp={RESUME_PP}'
    status, seconds, output = ds_e2e.run_resume(lambda: launch(
        args, run_env, RESUME_PP, RESUME_DP, os.path.join(work, name + '.log'),
        ['--steps', str(STEPS), '--load_dir', os.path.join(work, 'ckpt'),
         '--out', os.path.join(work, name + '.json')], megatron_args), STEPS)
    if status != 0:
        fail(f'plain load_checkpoint at pp{RESUME_PP}dp{RESUME_DP} under the preload exited '
             f'{status}:\n{output[-3000:]}\nucp logs:\n{log_tail(logs)}')
    print(f'pp{RESUME_PP}dp{RESUME_DP} plain resume under the preload'
          f'{" (pp from the trainer arguments)" if megatron_args else ""}: {seconds:.1f} s')
    if megatron_args:
        evidence = f'pp={RESUME_PP} (--pipeline-model-parallel-size {RESUME_PP})'
        logged = ''.join(open(os.path.join(logs, n), errors='replace').read()
                         for n in sorted(os.listdir(logs)))
        if evidence not in logged:
            fail(f'no ucp log names {evidence!r} as the evidence of the target:\n{log_tail(logs)}')
        print(f'ucp took the target from the trainer: {evidence}')
    got = losses(os.path.join(work, name + '.json'))
    oracle = losses(os.path.join(work, 'universal.json'))
    full = losses(os.path.join(work, 'save.json'))
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    if sorted(got) != steps or sorted(oracle) != steps:
        fail(f'resumed steps {sorted(got)}, universal steps {sorted(oracle)}, expected {steps}')
    print_losses('losses preload', got)
    print_losses('losses universal', oracle)
    print_losses(f'losses pp{SAVE_PP}dp{SAVE_DP} uninterrupted', {s: full[s] for s in steps})
    mismatched = [s for s in steps if float32_bits(got[s]) != float32_bits(oracle[s])]
    if mismatched:
        fail('losses differ from DeepSpeed\'s universal load at steps ' +
             ', '.join(f'{s} ({float32_bits(got[s])} vs {float32_bits(oracle[s])})'
                       for s in mismatched))
    print(f'losses bit-identical to DeepSpeed\'s universal load at steps {steps[0]}..{steps[-1]}')
    view = os.path.join(work, 'ckpt', TAG, '.ucp', 'views', VIEW)
    resharded = os.path.join(work, 'reshard')
    shutil.rmtree(resharded, ignore_errors=True)
    subprocess.run([args.ucp, 'reshard', os.path.join(work, 'ckpt', TAG), '--to',
                    f'pp={RESUME_PP},dp={RESUME_DP}', '--out', resharded], check=True,
                   stdout=subprocess.DEVNULL)
    resharded = os.path.join(resharded, TAG)
    served = sorted(n for n in os.listdir(resharded)
                    if n.endswith('.pt') and not n.startswith('layer_'))
    for name in served:
        stored = os.path.join(view, 'served.' + name)
        if not os.path.isfile(stored):
            fail(f'{name} was not served from the view cache ({stored}); ucp logs:\n'
                 f'{log_tail(logs)}')
        if open(stored, 'rb').read() != open(os.path.join(resharded, name), 'rb').read():
            fail(f'{stored} differs from `ucp reshard`\'s {name}')
    print(f'served files equal `ucp reshard --to pp={RESUME_PP},dp={RESUME_DP}`: {" ".join(served)}')


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('step', choices=['save', 'universal', 'preload', 'preload_megatron_args'])
    parser.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32',
                        help="train_pipe.py's dtype (bf16: DeepSpeed's ZeRO-1 bf16 optimizer)")
    parser.add_argument('--work', required=True)
    parser.add_argument('--tools', required=True)
    parser.add_argument('--lib', required=True)
    parser.add_argument('--ucp', required=True)
    ds_e2e.add_release_arguments(parser)
    args = parser.parse_args()
    for name in ('work', 'tools', 'lib', 'ucp'):
        setattr(args, name, os.path.abspath(getattr(args, name)))
    if not os.path.isfile(os.path.join(args.tools, 'train_pipe.py')):
        ds_e2e.skip(f'no DeepSpeed pipeline trainer at {args.tools}')
    env = ds_e2e.trainer_environment(args)
    work = os.path.join(args.work, 'pipe' if args.dtype == 'fp32' else 'pipe_' + args.dtype)
    if args.step != 'save' and not os.path.isfile(os.path.join(work, 'save.json')):
        fail(f'no saved checkpoint in {work} (run the save step first)')
    {'save': step_save, 'universal': step_universal, 'preload': step_preload,
     'preload_megatron_args': lambda *a: step_preload(*a, megatron_args=True)}[args.step](
        args, env, work)


if __name__ == '__main__':
    main()

#!/usr/bin/env python3
"""The Hugging Face Trainer with DeepSpeed ZeRO-2, saved at 4 processes and resumed at 2 with
`resume_from_checkpoint`, under LD_PRELOAD=libucp.so, with no code or flag change (CPU, gloo).

DeepSpeed's universal load cannot be reached from the Trainer (huggingface/transformers#33157):
the Trainer calls engine.load_checkpoint with load_universal off, so DeepSpeed refuses a new DP
size. The trainer is hf_trainer.py, a plain user script.
  1. 4 processes under the preload: steps 1..6, a checkpoint every 3 steps; checkpoint-3's
     DeepSpeed tag must get a committed index. Its losses at 4..6 are the uninterrupted run.
  2. 2 processes without the preload, resume_from_checkpoint=checkpoint-3: must fail with
     DeepSpeed's own refusal of the DP size.
  3. 2 processes under the preload, the same resume: steps 4..6 must give the uninterrupted run's
     losses within float reduction noise (the all-reduce sums 2 partial gradients, not 4).

Usage: hf_trainer_e2e.py --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI --deepspeed VERSION
                         [--required]
"""
import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_e2e  # noqa: E402 (the shared environment, launch and loss helpers)

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'hf_trainer.py')
SAVE_PROCESSES, RESUME_PROCESSES = 4, 2
SAVE_AT, STEPS = 3, 6
# |Δloss| allowed: summation order of 2 against 4 partial gradients (measured here: 1.2e-7).
TOLERANCE = 1e-5
REFUSAL = (f'The checkpoint being loaded used a DP world size of {SAVE_PROCESSES} but the '
           f'current world size is {RESUME_PROCESSES}')


def run(args, env, work, name, processes, extra):
    """hf_trainer.py over `processes` ranks; returns (exit status, output)."""
    log = os.path.join(work, name + '.log')
    command = [sys.executable, os.path.join(args.tools, 'launch.py'), str(processes),
               ds_e2e.PORT, TRAINER, '--output_dir', os.path.join(work, 'out'),
               '--steps', str(STEPS), '--save_every', str(SAVE_AT),
               '--out', os.path.join(work, name + '.json')] + extra
    status, _, output = ds_e2e.run_launcher(command, work, env, log)
    return status, output


def main():
    parser = argparse.ArgumentParser()
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    env = ds_e2e.trainer_environment(args)
    versions = subprocess.run([sys.executable, '-c',
                               'import transformers, accelerate; '
                               'print(transformers.__version__, accelerate.__version__)'],
                              env=env, capture_output=True, text=True)
    if versions.returncode != 0:
        ds_e2e.fail(f'transformers or accelerate does not import:\n{versions.stderr[-2000:]}')
    transformers_version, accelerate_version = versions.stdout.split()
    print(f'transformers {transformers_version}, accelerate {accelerate_version}', flush=True)
    work = os.path.join(args.work, 'hf_trainer_zero2')
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    logs = os.path.join(work, 'logs')

    status, output = run(args, ds_e2e.preload_env(env, args.lib, logs), work, 'save',
                         SAVE_PROCESSES, [])
    if status != 0:
        ds_e2e.fail(f'the {SAVE_PROCESSES}-process run exited {status}:\n{output[-3000:]}\n'
                    f'ucp logs:\n{ds_e2e.log_tail(logs)}')
    checkpoint = os.path.join(work, 'out', f'checkpoint-{SAVE_AT}')
    tag_dir = os.path.join(checkpoint, f'global_step{SAVE_AT}')
    if not os.path.isfile(os.path.join(tag_dir, '.ucp', 'index.json')):
        ds_e2e.fail(f'no committed index in {tag_dir}; ucp logs:\n{ds_e2e.log_tail(logs)}')
    full = ds_e2e.losses(os.path.join(work, 'save.json'))
    ds_e2e.print_losses(f'losses at {SAVE_PROCESSES} processes, uninterrupted', full)

    status, output = run(args, env, work, 'refusal', RESUME_PROCESSES, ['--resume', checkpoint])
    if status == 0 or REFUSAL not in output:
        ds_e2e.fail(f'the {RESUME_PROCESSES}-process resume without the preload exited {status} '
                    f'without DeepSpeed\'s refusal of the DP size:\n{output[-3000:]}')
    print(f'without the preload, the {RESUME_PROCESSES}-process resume fails with DeepSpeed\'s '
          f'refusal of the DP size', flush=True)

    status, output = run(args, ds_e2e.preload_env(env, args.lib, logs), work, 'resume',
                         RESUME_PROCESSES, ['--resume', checkpoint])
    if status != 0:
        ds_e2e.fail(f'the {RESUME_PROCESSES}-process resume under the preload exited {status}:\n'
                    f'{output[-3000:]}\nucp logs:\n{ds_e2e.log_tail(logs)}')
    got = ds_e2e.losses(os.path.join(work, 'resume.json'))
    ds_e2e.print_losses(f'losses at {RESUME_PROCESSES} processes, resumed under the preload', got)
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    if sorted(got) != steps:
        ds_e2e.fail(f'resumed steps {sorted(got)}, expected {steps}')
    worst = max(abs(got[s] - full[s]) for s in steps)
    print(f'max |Δloss| against the uninterrupted run: {worst:.3g} (allowed {TOLERANCE:g})')
    if worst > TOLERANCE:
        ds_e2e.fail('the resumed losses differ from the uninterrupted run\'s beyond float noise')


if __name__ == '__main__':
    main()

#!/usr/bin/env python3
"""DeepSpeed's checkpoint.checkpoint_serialization: false under LD_PRELOAD=libucp.so: torch's
legacy (non-zip) format, which ucp does not read. The tag must be left unindexed at once, with the
reason logged (not waited on as an archive still being written), and the trainer must see what it
sees without ucp.
  1. ZeRO-2 at DP=4 under the preload, steps 1..6, saving global_step3 in the legacy format:
     no index.json; a ucp log names the legacy serialization; losses bit-identical to the same
     run without the preload.
  2. The resume at the same DP=4 under the preload (a pass-through): steps 4..6 bit-identical to
     the uninterrupted run.
Usage: ds_legacy_e2e.py --work DIR --tools DIR --lib LIBUCP --deepspeed VERSION [--required]
"""
import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_e2e  # noqa: E402 (the shared environment, launch and loss helpers)

WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'with_ds_config.py')
LEGACY = '{"checkpoint": {"checkpoint_serialization": false}}'
PROCESSES, SAVE_AT, STEPS = 4, 3, 6
TAG = f'global_step{SAVE_AT}'


def train(args, env, work, name, extra):
    out = os.path.join(work, name + '.json')
    command = [sys.executable, 'launch.py', str(PROCESSES), ds_e2e.PORT, WRAPPER,
               LEGACY, 'train.py', '--stage', '2', '--dtype', 'fp32', '--steps', str(STEPS),
               '--out', out] + extra
    log = os.path.join(work, name + '.log')
    status = ds_e2e.run_past_flakes(
        lambda: ds_e2e.run_launcher(command, args.tools, env, log), STEPS,
        ds_e2e.save_dir_of(extra))[0]
    if status != 0:
        ds_e2e.fail(f'{name} exited {status}:\n{open(log, errors="replace").read()[-3000:]}')
    return {step: ds_e2e.float32_bits(value) for step, value in ds_e2e.losses(out).items()}


def main():
    parser = argparse.ArgumentParser()
    ds_e2e.add_run_arguments(parser, ('--work', '--tools', '--lib'))
    args = ds_e2e.parse_run_arguments(parser)
    env = ds_e2e.trainer_environment(args)
    work = os.path.join(args.work, 'legacy_serialization')
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ckpt, logs = os.path.join(work, 'ckpt'), os.path.join(work, 'logs')
    save = ['--save_dir', ckpt, '--save_at', str(SAVE_AT)]
    plain = train(args, env, work, 'plain', ['--save_dir', os.path.join(work, 'ckpt_plain'),
                                             '--save_at', str(SAVE_AT)])
    saved = train(args, ds_e2e.preload_env(env, args.lib, logs), work, 'save', save)
    if saved != plain:
        ds_e2e.fail(f'the preload changed the losses of the saving run: {saved} vs {plain}')
    tag_dir = os.path.join(ckpt, TAG)
    if os.path.exists(os.path.join(tag_dir, '.ucp', 'index.json')):
        ds_e2e.fail(f'{tag_dir} was indexed, though ucp does not read torch\'s legacy format')
    reason = [line for line in ds_e2e.log_tail(logs, lines=1000).splitlines()
              if 'legacy (non-zip) serialization' in line]
    if not reason:
        ds_e2e.fail(f'no ucp log names the legacy serialization:\n{ds_e2e.log_tail(logs)}')
    print(f'unindexed, logged: {reason[0].split(": ", 1)[1]}', flush=True)
    resumed = train(args, ds_e2e.preload_env(env, args.lib, logs), work, 'resume',
                    ['--load_dir', ckpt])
    steps = range(SAVE_AT + 1, STEPS + 1)
    if sorted(resumed) != list(steps) or any(resumed[s] != saved[s] for s in steps):
        ds_e2e.fail(f'the resume under the preload gave {resumed}; uninterrupted {saved}')
    print(f'the DP={PROCESSES} resume under the preload (a pass-through) is bit-identical to the '
          f'uninterrupted run at steps {SAVE_AT + 1}..{STEPS}')


if __name__ == '__main__':
    main()

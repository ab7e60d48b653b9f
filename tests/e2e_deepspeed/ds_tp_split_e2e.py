"""Real DeepSpeed v0.14.5: a TP=1 tag split to TP=2 under LD_PRELOAD=libucp.so (CPU, gloo).

DeepSpeed's own TP=1 x DP=2 resave of the tensor-parallel fixture
(../shared/fixtures/deepspeed/tp2_z1_fp32/resaved/tp1dp2_from_tp2dp2, copied: the index and the
views are written into the tag; its model states carry universal_checkpoint_info) is indexed with
`ucp index`, then train_tp.py resumes it at TP=2 x DP=2 with a plain engine.load_checkpoint
(load_universal off) under the preload, UCP_TOPOLOGY=tp=2 telling ucp the new TP degree. The
resave holds exactly the state of the fixture's TP=2 x DP=2 save (RESAVED.txt: every partition
bit-identical), so its losses at steps 6..10 must be bit-identical to DeepSpeed's universal load of
that state at TP=2 x DP=2 (losses/D_uc_tp2dp2_to_tp2dp2.json). Skipped, with the reason, where
`import deepspeed` fails.

Usage: ds_tp_split_e2e.py --fixtures DIR --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI
"""

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_e2e  # noqa: E402 (the shared environment, launch and loss helpers)


def main():
    parser = argparse.ArgumentParser()
    for option in ('--fixtures', '--work', '--tools', '--lib', '--ucp'):
        parser.add_argument(option, required=True)
    args = parser.parse_args()
    # The trainer runs in the tools folder.
    args.lib, args.ucp = os.path.abspath(args.lib), os.path.abspath(args.ucp)
    fixture = os.path.join(args.fixtures, 'tp2_z1_fp32')
    source = os.path.join(fixture, 'resaved', 'tp1dp2_from_tp2dp2')
    if not os.path.isdir(source):
        ds_e2e.skip(f'no TP=1 resave of the tensor-parallel fixture at {source}')
    env = ds_e2e.trainer_environment(args.tools)
    work = os.path.join(args.work, 'tp_split')
    shutil.rmtree(work, ignore_errors=True)
    ckpt = os.path.join(work, 'ckpt')
    shutil.copytree(os.path.join(source, 'global_step5'), os.path.join(ckpt, 'global_step5'))
    shutil.copy(os.path.join(source, 'latest'), ckpt)
    for root, dirs, files in os.walk(work):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    subprocess.run([args.ucp, 'index', os.path.join(ckpt, 'global_step5')], check=True,
                   stdout=subprocess.DEVNULL)

    logs = os.path.join(work, 'logs')
    out = os.path.join(work, 'preload.json')
    command = [sys.executable, 'launch.py', '4', str(ds_e2e.free_port()), 'train_tp.py',
               '--tp', '2', '--steps', '10', '--load_dir', ckpt, '--out', out]
    log = os.path.join(work, 'preload.log')
    with open(log, 'w') as output:
        status = subprocess.run(command, cwd=args.tools,
                                env=dict(ds_e2e.preload_env(env, args.lib, logs),
                                         UCP_TOPOLOGY='tp=2'),
                                stdout=output, stderr=subprocess.STDOUT).returncode
    if status != 0:
        ds_e2e.fail(f'plain load_checkpoint at TP=2 x DP=2 under the preload exited {status}:\n'
                    f'{open(log, errors="replace").read()[-3000:]}\nucp logs:\n'
                    f'{ds_e2e.log_tail(logs)}')
    got = ds_e2e.losses(out)
    oracle = ds_e2e.losses(os.path.join(fixture, 'losses', 'D_uc_tp2dp2_to_tp2dp2.json'))
    steps = list(range(6, 11))
    if sorted(got) != steps or sorted(oracle) != steps:
        ds_e2e.fail(f'resumed steps {sorted(got)}, universal steps {sorted(oracle)}, '
                    f'expected {steps}')
    ds_e2e.print_losses('losses TP=2 x DP=2 preload from TP=1', got)
    ds_e2e.print_losses('losses TP=2 x DP=2 universal', oracle)
    mismatched = [s for s in steps
                  if ds_e2e.float32_bits(got[s]) != ds_e2e.float32_bits(oracle[s])]
    if mismatched:
        ds_e2e.fail(f'losses differ from DeepSpeed\'s universal load at steps {mismatched}')
    print('losses bit-identical to DeepSpeed\'s universal load at steps 6..10')


if __name__ == '__main__':
    main()

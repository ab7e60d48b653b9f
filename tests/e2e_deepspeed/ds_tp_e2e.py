"""Real DeepSpeed v0.14.5 tensor parallelism under LD_PRELOAD=libucp.so (CPU, gloo, 127.0.0.1).

A tag of the tensor-parallel fixture (../shared/fixtures/deepspeed/tp2_z1_fp32; copied: the index
and the views are written into the tag) is indexed with `ucp index`, then train_tp.py resumes it
at another TP degree with a plain engine.load_checkpoint (load_universal off) under the preload,
UCP_TOPOLOGY telling ucp the new TP degree. Its losses at steps 6..10 must be bit-identical to
DeepSpeed's own universal load at that topology, run here from the fixture's ds_to_universal
output of the TP=2 x DP=2 save (tp2dp2/global_step5_universal): the fixture's recorded losses
came from another machine's CPU kernels, which may round differently. Two directions:
  merge  the TP=2 x DP=2 save resumed at TP=1 x DP=2 (recorded: D_uc_tp2dp2_to_tp1dp2.json)
  split  DeepSpeed's TP=1 x DP=2 resave (resaved/tp1dp2_from_tp2dp2, whose model states carry
         universal_checkpoint_info) resumed at TP=2 x DP=2. The resave holds exactly the state of
         the TP=2 x DP=2 save (RESAVED.txt: every partition bit-identical), so the oracle is
         DeepSpeed's universal load of that state at TP=2 x DP=2 (D_uc_tp2dp2_to_tp2dp2.json).
Skipped, with the reason, where `import deepspeed` fails.

Usage: ds_tp_e2e.py --direction merge|split --fixtures DIR --work DIR --tools DIR --lib LIBUCP
                    --ucp UCP_CLI
"""

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_e2e  # noqa: E402 (the shared environment, launch and loss helpers)

# direction -> (source tag's folder in the fixture, target tp, ranks, oracle loss log)
DIRECTIONS = {
    'merge': ('tp2dp2', 1, 2, 'D_uc_tp2dp2_to_tp1dp2.json'),
    'split': (os.path.join('resaved', 'tp1dp2_from_tp2dp2'), 2, 4, 'D_uc_tp2dp2_to_tp2dp2.json'),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--direction', required=True, choices=sorted(DIRECTIONS))
    for option in ('--fixtures', '--work', '--tools', '--lib', '--ucp'):
        parser.add_argument(option, required=True)
    ds_e2e.add_release_arguments(parser)
    args = parser.parse_args()
    # The trainer runs in the tools folder.
    args.lib, args.ucp = os.path.abspath(args.lib), os.path.abspath(args.ucp)
    folder, tp, ranks, oracle_log = DIRECTIONS[args.direction]
    fixture = os.path.join(args.fixtures, 'tp2_z1_fp32')
    source = os.path.join(fixture, folder)
    if not os.path.isdir(source):
        ds_e2e.skip(f'no tensor-parallel fixture tag at {source}')
    env = ds_e2e.trainer_environment(args)
    work = os.path.join(args.work, 'tp_' + args.direction)
    shutil.rmtree(work, ignore_errors=True)
    ckpt = os.path.join(work, 'ckpt')
    shutil.copytree(os.path.join(source, 'global_step5'), os.path.join(ckpt, 'global_step5'))
    shutil.copy(os.path.join(source, 'latest'), ckpt)
    # The oracle's source: the fixture's ds_to_universal output of the TP=2 x DP=2 save.
    universal = os.path.join(work, 'universal')
    shutil.copytree(os.path.join(fixture, 'tp2dp2', 'global_step5_universal'),
                    os.path.join(universal, 'global_step5_universal'))
    shutil.copy(os.path.join(fixture, 'tp2dp2', 'latest_universal'), universal)
    for root, dirs, files in os.walk(work):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    subprocess.run([args.ucp, 'index', os.path.join(ckpt, 'global_step5')], check=True,
                   stdout=subprocess.DEVNULL)

    topology = f'TP={tp} x DP={ranks // tp}'

    def resume(name, load_dir, run_env, extra):
        """train_tp.py at the target from `load_dir`, steps 6..10; returns its losses."""
        out = os.path.join(work, name + '.json')
        command = [sys.executable, 'launch.py', str(ranks), str(ds_e2e.free_port()), 'train_tp.py',
                   '--tp', str(tp), '--steps', '10', '--load_dir', load_dir, '--out', out] + extra
        log = os.path.join(work, name + '.log')
        with open(log, 'w') as output:
            status = subprocess.run(command, cwd=args.tools, env=run_env, stdout=output,
                                    stderr=subprocess.STDOUT).returncode
        if status != 0:
            ds_e2e.fail(f'{name} at {topology} exited {status}:\n'
                        f'{open(log, errors="replace").read()[-3000:]}\nucp logs:\n'
                        f'{ds_e2e.log_tail(logs)}')
        return ds_e2e.losses(out)

    logs = os.path.join(work, 'logs')
    # The oracle: DeepSpeed's universal load at the target, on this machine.
    oracle = resume('universal', universal, env, ['--universal'])
    recorded = ds_e2e.losses(os.path.join(fixture, 'losses', oracle_log))
    got = resume('preload', ckpt, dict(ds_e2e.preload_env(env, args.lib, logs),
                                       UCP_TOPOLOGY=f'tp={tp}'), [])
    steps = list(range(6, 11))
    if sorted(got) != steps or sorted(oracle) != steps:
        ds_e2e.fail(f'resumed steps {sorted(got)}, universal steps {sorted(oracle)}, '
                    f'expected {steps}')
    ds_e2e.print_losses(f'losses {topology} preload from {folder}', got)
    ds_e2e.print_losses(f'losses {topology} universal, here', oracle)
    ds_e2e.print_losses(f'losses {topology} universal, recorded in the fixture', recorded)
    mismatched = [s for s in steps
                  if ds_e2e.float32_bits(got[s]) != ds_e2e.float32_bits(oracle[s])]
    if mismatched:
        ds_e2e.fail(f'losses differ from DeepSpeed\'s universal load at steps {mismatched}')
    print('losses bit-identical to DeepSpeed\'s universal load at steps 6..10')


if __name__ == '__main__':
    main()

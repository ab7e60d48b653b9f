"""Real DeepSpeed tensor parallelism under LD_PRELOAD=libucp.so (CPU, gloo, 127.0.0.1).

train_tp.py resumes a tensor-parallel tag at another TP degree with a plain
engine.load_checkpoint (load_universal off) under the preload, UCP_TOPOLOGY telling ucp the new
TP degree. Its losses at steps 6..10 must be bit-identical to DeepSpeed's own universal load at
that topology, run here. Two directions:
  merge  TP=2 x DP=2 resumed at TP=1 x DP=2
  split  TP=1 x DP=2 (model states carrying universal_checkpoint_info) resumed at TP=2 x DP=2
and two sources of the tag:
  fixture (v0.14.5) ../shared/fixtures/deepspeed/tp2_z1_fp32, copied (the index and the views are
         written into the tag) and indexed with `ucp index`. merge: the TP=2 x DP=2 save; split:
         DeepSpeed's TP=1 x DP=2 resave (resaved/tp1dp2_from_tp2dp2), which holds exactly the
         state of the TP=2 x DP=2 save (RESAVED.txt), so for both the oracle is DeepSpeed's
         universal load of the fixture's ds_to_universal output of the TP=2 x DP=2 save (the
         fixture's recorded losses came from another machine's CPU kernels, which may round
         differently: printed, not compared).
  --live the release under test saves the tag itself, under the preload (steps 1..5, tag
         global_step5, its index committed at the save), and the oracle is that release's
         ds_to_universal.py of a copy of it, loaded with --universal at the target.
         --checkpoint-config JSON (the config's checkpoint section) picks the saving run's engine
         (with_ds_config.py), e.g. DeepSpeed's FastCheckpointEngine.
Skipped, with the reason, where `import deepspeed` fails (failed with --required).

Usage: ds_tp_e2e.py --direction merge|split [--live] --fixtures DIR --work DIR --tools DIR
                    --lib LIBUCP --ucp UCP_CLI --deepspeed VERSION [--required]
"""

import argparse
import json
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
# direction -> (tp, ranks) of the live save
LIVE_SAVES = {'merge': (2, 4), 'split': (1, 2)}
TAG = 'global_step5'


def run_trainer(args, env, work, name, tp, ranks, logs, extra, checkpoint_config=None):
    """train_tp.py at TP=tp over `ranks` processes, with `checkpoint_config` (a JSON object)
    added to its DeepSpeed config's checkpoint section; returns its losses (fails on a non-zero
    exit, with the tails of its output and of ucp's logs)."""
    out = os.path.join(work, name + '.json')
    trainer = ['train_tp.py']
    if checkpoint_config:
        trainer = [os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                'with_ds_config.py'),
                   json.dumps({'checkpoint': json.loads(checkpoint_config)})] + trainer
    command = [sys.executable, 'launch.py', str(ranks), ds_e2e.PORT] + trainer + \
        ['--tp', str(tp), '--out', out] + extra
    log = os.path.join(work, name + '.log')

    def launch():
        return ds_e2e.run_launcher(command, args.tools, env, log)

    status = ds_e2e.run_past_flakes(
        launch, int(extra[extra.index('--steps') + 1]), ds_e2e.save_dir_of(extra))[0]
    if status != 0:
        ds_e2e.fail(f'{name} at TP={tp} x DP={ranks // tp} exited {status}:\n'
                    f'{open(log, errors="replace").read()[-3000:]}\nucp logs:\n'
                    f'{ds_e2e.log_tail(logs)}')
    return ds_e2e.losses(out)


def fixture_source(args, work, ckpt, universal):
    """Copies the fixture's tag into `ckpt` and its ds_to_universal output into `universal`,
    indexes the tag; returns (a description, the fixture's recorded oracle losses)."""
    folder, _, _, oracle_log = DIRECTIONS[args.direction]
    fixture = os.path.join(args.fixtures, 'tp2_z1_fp32')
    source = os.path.join(fixture, folder)
    if not os.path.isdir(source):
        ds_e2e.skip(f'no tensor-parallel fixture tag at {source}')
    shutil.copytree(os.path.join(source, TAG), os.path.join(ckpt, TAG))
    shutil.copy(os.path.join(source, 'latest'), ckpt)
    # The oracle's source: the fixture's ds_to_universal output of the TP=2 x DP=2 save.
    shutil.copytree(os.path.join(fixture, 'tp2dp2', TAG + '_universal'),
                    os.path.join(universal, TAG + '_universal'))
    shutil.copy(os.path.join(fixture, 'tp2dp2', 'latest_universal'), universal)
    for root, dirs, files in os.walk(work):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    subprocess.run([args.ucp, 'index', os.path.join(ckpt, TAG)], check=True,
                   stdout=subprocess.DEVNULL)
    return f'the fixture\'s {folder}', ds_e2e.losses(os.path.join(fixture, 'losses', oracle_log))


def live_source(args, env, work, ckpt, universal):
    """Saves the tag with this release under the preload (steps 1..5) and converts a copy with
    its ds_to_universal.py; returns (a description, None)."""
    tp, ranks = LIVE_SAVES[args.direction]
    logs = os.path.join(work, 'logs_save')
    run_trainer(args, ds_e2e.preload_env(env, args.lib, logs), work, 'save', tp, ranks, logs,
                ['--steps', '5', '--save_dir', ckpt, '--save_at', '5'], args.checkpoint_config)
    tag_dir = os.path.join(ckpt, TAG)
    if not os.path.isfile(os.path.join(tag_dir, '.ucp', 'index.json')):
        ds_e2e.fail(f'no committed index in {tag_dir} after the save; ucp logs:\n'
                    f'{ds_e2e.log_tail(logs)}')
    copy = os.path.join(work, 'copy', TAG)
    shutil.copytree(tag_dir, copy, ignore=shutil.ignore_patterns('.ucp'))
    ds_e2e.ds_to_universal(env, copy, os.path.join(universal, TAG + '_universal'))
    with open(os.path.join(universal, 'latest_universal'), 'w') as f:
        f.write(TAG + '_universal')
    engine = f' with checkpoint {args.checkpoint_config}' if args.checkpoint_config else ''
    return f'a TP={tp} x DP={ranks // tp} save by DeepSpeed {args.deepspeed}{engine}', None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--direction', required=True, choices=sorted(DIRECTIONS))
    parser.add_argument('--live', action='store_true',
                        help='save the tag with this release rather than take the fixture\'s')
    parser.add_argument('--checkpoint-config', dest='checkpoint_config', default=None,
                        help='with --live: entries of the saving run\'s DeepSpeed config '
                             '"checkpoint" section, a JSON object (picks a checkpoint engine)')
    parser.add_argument('--name', default=None, help='the work folder\'s name')
    ds_e2e.add_run_arguments(parser, ('--fixtures', '--work', '--tools', '--lib', '--ucp'))
    args = ds_e2e.parse_run_arguments(parser)
    _, tp, ranks, _ = DIRECTIONS[args.direction]
    env = ds_e2e.trainer_environment(args)
    work = os.path.join(args.work, args.name or
                        ('tp_live_' if args.live else 'tp_') + args.direction)
    shutil.rmtree(work, ignore_errors=True)
    ckpt, universal = os.path.join(work, 'ckpt'), os.path.join(work, 'universal')
    os.makedirs(ckpt)
    if args.live:
        source, recorded = live_source(args, env, work, ckpt, universal)
    else:
        source, recorded = fixture_source(args, work, ckpt, universal)

    topology = f'TP={tp} x DP={ranks // tp}'
    logs = os.path.join(work, 'logs')
    resume = ['--steps', '10']
    # The oracle: DeepSpeed's universal load at the target, on this machine.
    oracle = run_trainer(args, env, work, 'universal', tp, ranks, logs,
                         resume + ['--load_dir', universal, '--universal'])
    got = run_trainer(args, dict(ds_e2e.preload_env(env, args.lib, logs), UCP_TOPOLOGY=f'tp={tp}'),
                      work, 'preload', tp, ranks, logs, resume + ['--load_dir', ckpt])
    steps = list(range(6, 11))
    if sorted(got) != steps or sorted(oracle) != steps:
        ds_e2e.fail(f'resumed steps {sorted(got)}, universal steps {sorted(oracle)}, '
                    f'expected {steps}')
    ds_e2e.print_losses(f'losses {topology} preload from {source}', got)
    ds_e2e.print_losses(f'losses {topology} universal, here', oracle)
    if recorded is not None:
        ds_e2e.print_losses(f'losses {topology} universal, recorded in the fixture', recorded)
    mismatched = [s for s in steps
                  if ds_e2e.float32_bits(got[s]) != ds_e2e.float32_bits(oracle[s])]
    if mismatched:
        ds_e2e.fail(f'losses differ from DeepSpeed\'s universal load at steps {mismatched}')
    print('losses bit-identical to DeepSpeed\'s universal load at steps 6..10')


if __name__ == '__main__':
    main()

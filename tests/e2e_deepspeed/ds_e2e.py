#!/usr/bin/env python3
"""Real DeepSpeed end to end under LD_PRELOAD=libucp.so (CPU, gloo, 127.0.0.1).

The trainer is ../shared/tools/deepspeed-cpu/train.py, run in place with its launch.py and env.sh
(tiny GPT, fixed global batch per step, loss = mean over the global batch, so losses compare
across DP sizes). One CTest test per step, sharing WORK/<config>:

  save        DP=4 without and with the preload: trains steps 1..STEPS, saves tag
              global_step<SAVE_AT>; under the preload the save must leave a committed index
              (<tag>/.ucp/index.json), DeepSpeed's files byte for byte those of the run without it,
              and the same losses bit for bit. Its losses after SAVE_AT are the uninterrupted run.
  universal   DeepSpeed's own universal path, no preload: ds_to_universal.py --inject_missing_state,
              then --universal load at DP=2 and steps SAVE_AT+1..STEPS (the oracle), in the
              configuration ORACLE_CONFIG names where that is not the saving one.
  preload     the plain load_checkpoint at DP=2 under the preload (no universal flag) and the same
              steps: each step's loss must have the same float32 bits as the universal run's; the
              served files must be the bytes `ucp reshard --to dp=2` writes, and under
              torch.load(weights_only=True) (torch >= 2.6's default) each must load, or be
              refused for the same global, as the saved files of its kind.
  refusal     the same DP=2 resume without the preload must fail with DeepSpeed's own error
              ("The checkpoint being loaded used a DP world size of 4 ...").
  atoms       DP=4 under the preload with UCP_MODE=atoms, steps 1..SAVE_AT: DeepSpeed's files
              byte for byte those of the run without the preload, and the index records a
              complete atoms store; then DeepSpeed's .pt files are deleted and the plain DP=2
              resume under the preload, served from the store alone, must give losses with the
              same float32 bits as the universal run's.

Usage: ds_e2e.py STEP --config NAME --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI
                 --deepspeed VERSION [--required]
The DeepSpeed release is the one this interpreter imports: DS_SRC names a source folder (as
env.sh uses it), else the installed `deepspeed` package; it must be VERSION. When it is not
importable or another version, the exit status is 77 (CTest SKIP_RETURN_CODE) with the reason,
or 1 with --required (the release the project's set-up installs must never be skipped).
Env: PRELOAD_FIRST (a sanitizer runtime preloaded before libucp.so).
"""
import argparse
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time

SKIP = 77
# train.py arguments per configuration: ZeRO stage and dtype; the model is train.py's default.
# z1_bf16opt: bf16 with fp32 gradient accumulation at stage 1, which makes DeepSpeed pick its
# BF16_Optimizer (BLOOM's configuration) rather than ZeRO's own bf16 path.
CONFIGS = {
    'z1_fp32': ['--stage', '1', '--dtype', 'fp32'],
    'z1_bf16opt': ['--stage', '1', '--dtype', 'bf16', '--grad_accum_fp32'],
    'z2_fp32': ['--stage', '2', '--dtype', 'fp32'],
    'z2_bf16': ['--stage', '2', '--dtype', 'bf16'],
    'z3_fp32': ['--stage', '3', '--dtype', 'fp32'],
    'z3_bf16': ['--stage', '3', '--dtype', 'bf16'],
    'z3_fp32_subgroups': ['--stage', '3', '--dtype', 'fp32'],
}
# Entries merged into a configuration's DeepSpeed config (with_ds_config.py). z3_fp32_subgroups:
# a sub_group_size below the model's per-rank partition, so that every optimizer file holds
# several sub groups, whose split differs between DP=4 and DP=2.
CONFIG_ENTRIES = {
    'z3_fp32_subgroups': {'zero_optimization': {'sub_group_size': 3000}},
}
# The configuration the oracle (DeepSpeed's universal load) trains with, where it is not the
# saving one. z3_fp32_subgroups: DeepSpeed 0.19.8's ZeRO-3 universal load puts one Adam step
# tensor into the state of every sub group (stage3.py, load_hp_checkpoint_state_from_checkpoint_
# dir_stage3: `state[fp32_param]['step'] = state_step`, not a copy), which each sub group's
# optimizer step then increments in place: with several sub groups the bias correction is wrong
# from the first step after the resume. ds_to_universal's files of the sub-grouped save are right
# (ucp exports the same bytes); loaded without sub groups they train as the uninterrupted run.
# The sub-grouped universal load still runs, its losses printed beside the oracle's.
ORACLE_CONFIG = {'z3_fp32_subgroups': 'z3_fp32'}
WITH_DS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'with_ds_config.py')
FORK_LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fork_launch.py')
SAVE_DP, RESUME_DP = 4, 2
SAVE_AT, STEPS = 3, 6
TAG = f'global_step{SAVE_AT}'
VIEW = f'tp1-pp1-dp{RESUME_DP}'
DP_REFUSAL = (f'The checkpoint being loaded used a DP world size of {SAVE_DP} but the current '
              f'world size is {RESUME_DP}')


def skip(reason):
    print(f'SKIPPED: {reason}', flush=True)
    sys.exit(SKIP)


def fail(message):
    print(f'FAIL: {message}', flush=True)
    sys.exit(1)


def add_run_arguments(parser, paths=('--work', '--tools', '--lib', '--ucp')):
    """The options every DeepSpeed e2e script takes: the folders and programs it runs with
    (`paths`) and the release it must run."""
    for option in paths:
        parser.add_argument(option, required=True)
    parser.add_argument('--deepspeed', required=True, metavar='VERSION',
                        help='the DeepSpeed version these tests must run')
    parser.add_argument('--required', action='store_true',
                        help='fail rather than skip when that version is not importable')


def parse_run_arguments(parser):
    """parser's arguments, every path of add_run_arguments absolute: the trainers run in the
    tools folder."""
    args = parser.parse_args()
    for name in ('work', 'tools', 'lib', 'ucp', 'fixtures'):
        if getattr(args, name, None):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    return args


def trainer_environment(args):
    """The environment of tools/env.sh (PYTHONPATH with DS_SRC and the hjson stand-in, CPU
    accelerator, ...), without any UCP_* variable of the caller; skips (or fails, with
    args.required) when DeepSpeed args.deepspeed cannot be imported. Prints the versions."""
    tools = args.tools
    unavailable = fail if args.required else skip
    base = {k: v for k, v in os.environ.items() if not k.startswith('UCP_') and k != 'LD_PRELOAD'}
    ds_src = base.get('DS_SRC', '')
    if not os.path.isfile(os.path.join(tools, 'train.py')):
        unavailable(f'no DeepSpeed trainer at {tools}')
    if ds_src:
        if not os.path.isdir(os.path.join(ds_src, 'deepspeed')):
            unavailable(f'DS_SRC={ds_src} holds no deepspeed/ package')
        env_sh = os.path.join(tools, 'env.sh')
        dump = subprocess.run(['bash', '-c', f'. "{env_sh}" && env -0'], env=base,
                              capture_output=True, check=True).stdout
        env = dict(item.split('=', 1) for item in dump.decode().split('\0') if '=' in item)
    else:
        # An installed deepspeed (a user's machine): env.sh's settings but its own package.
        env = dict(base, DS_ACCELERATOR='cpu', DS_BUILD_OPS='0', MASTER_ADDR='127.0.0.1',
                   OMP_NUM_THREADS='1', PYTHONDONTWRITEBYTECODE='1')
        env['PYTHONPATH'] = tools + (':' + base['PYTHONPATH'] if base.get('PYTHONPATH') else '')
    probe = subprocess.run([sys.executable, '-c', 'import deepspeed; print(deepspeed.__file__)'],
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or ['(no message)']
        how = f'with DS_SRC={ds_src}' if ds_src else 'and DS_SRC is not set'
        unavailable(f'`import deepspeed` fails under {sys.executable} {how}: {lines[-1]}')
    package = os.path.dirname(probe.stdout.strip().splitlines()[-1])
    version_file = os.path.join(os.path.dirname(package), 'version.txt')
    versions = subprocess.run(
        [sys.executable, '-c', 'import deepspeed, torch; print(deepspeed.__version__, torch.__version__)'],
        env=env, capture_output=True, text=True).stdout.strip().splitlines()[-1].split()
    # A source folder's version is its version.txt (DS_SRC without the generated version file
    # reports 0.0.0).
    version = open(version_file).read().strip() if os.path.isfile(version_file) else versions[0]
    if version != args.deepspeed:
        unavailable(f'DeepSpeed at {package} is version {version}; these tests need v{args.deepspeed}')
    print(f'DeepSpeed {version} ({package}) on torch {versions[1]}, {sys.executable}', flush=True)
    env['DS_PACKAGE'] = package
    return env


def model_states_names(config, dp):
    """DeepSpeed's model-states files at `dp`: one (ZeRO-1/2), or one per DP rank (ZeRO-3)."""
    if config.startswith('z3_'):
        return [f'zero_pp_rank_{r}_mp_rank_00_model_states.pt' for r in range(dp)]
    return ['mp_rank_00_model_states.pt']


# launch.py's rendezvous port, filled in by run_launcher.
PORT = '<port>'
# What torch says when another process took the port between free_port() and the rendezvous
# (other tests' gloo connections use ephemeral ports too); nothing has run then.
PORT_TAKEN = 'EADDRINUSE'


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def run_launcher(command, cwd, env, log):
    """Runs a launch.py command line whose port argument is PORT, with a free port, writing its
    output to `log`; when the port was taken before the rendezvous listened (PORT_TAKEN, nothing
    ran), runs it again with another, at most three times. Returns (exit status, seconds,
    output). Without LD_PRELOAD in `env` the ranks are forked by fork_launch.py from one process
    that imported the script's modules once: the same files and losses, for the trainers that
    import transformers about half the CPU, for the others (torch and DeepSpeed) a 4-rank run
    in 6.8 s instead of 9.7; a preloaded run keeps launch.py, each rank a process of its own."""
    if not env.get('LD_PRELOAD') and os.path.basename(command[1]) == 'launch.py':
        command = command[:1] + [FORK_LAUNCH] + command[2:]
    for attempt in range(3):
        start = time.monotonic()
        port = str(free_port())
        with open(log, 'w') as out:
            status = subprocess.run([port if part == PORT else part for part in command], cwd=cwd,
                                    env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        seconds = time.monotonic() - start
        output = open(log, errors='replace').read()
        if status == 0 or PORT_TAKEN not in output:
            break
        print(f'rendezvous port {port} was taken before it listened; running again', flush=True)
    return status, seconds, output


def ds_to_universal(env, tag_dir, universal):
    """DeepSpeed's own converter (env['DS_PACKAGE']'s ds_to_universal.py --inject_missing_state)
    of tag_dir into the folder `universal`; fails the test unless it ran. Prints its time."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, os.path.join(env['DS_PACKAGE'], 'checkpoint', 'ds_to_universal.py'),
         '--input_folder', tag_dir, '--output_folder', universal, '--inject_missing_state'],
        env=env, capture_output=True, text=True)
    if result.returncode != 0:
        fail(f'ds_to_universal.py exited {result.returncode}:\n{result.stdout[-2000:]}'
             f'{result.stderr[-2000:]}')
    print(f'ds_to_universal: {time.monotonic() - start:.1f} s')


def preload_env(env, lib, log_dir):
    os.makedirs(log_dir, exist_ok=True)
    first = os.environ.get('PRELOAD_FIRST', '')
    return dict(env, LD_PRELOAD=f'{first} {lib}'.strip(), UCP_LOG_DIR=log_dir, UCP_LOG_LEVEL='info')


def check_served(view, resharded, names, to, log_dir=None):
    """Each of `names` was served from the view cache `view`, the bytes `ucp reshard --to <to>`
    wrote into `resharded`; a failure shows the tail of ucp's logs in log_dir when given."""
    for name in names:
        stored = os.path.join(view, 'served.' + name)
        if not os.path.isfile(stored):
            fail(f'{name} was not served from the view cache ({stored})' +
                 (f'; ucp logs:\n{log_tail(log_dir)}' if log_dir else ''))
        if open(stored, 'rb').read() != open(os.path.join(resharded, name), 'rb').read():
            fail(f'{stored} differs from `ucp reshard`\'s {name}')
    print(f'served files equal `ucp reshard --to {to}`: {" ".join(names)}')


def log_tail(log_dir, lines=40):
    """The last lines of ucp's logs in log_dir, less each process's start and stop lines."""
    out = []
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        with open(os.path.join(log_dir, name), errors='replace') as f:
            out += [f'{name}: {line.rstrip()}' for line in f
                    if not any(word in line for word in (' starting (', ' started in ', ' stopping'))]
    return '\n'.join(out[-lines:])


def launch(args, env, nproc, log, extra, config=None):
    """Runs train.py at `nproc` ranks in `config` (args.config by default); returns (exit
    status, seconds, output)."""
    config = config or args.config
    command = [sys.executable, 'launch.py', str(nproc), PORT]
    if config in CONFIG_ENTRIES:
        command += [WITH_DS_CONFIG, json.dumps(CONFIG_ENTRIES[config])]
    command += ['train.py'] + CONFIGS[config] + extra
    return run_launcher(command, args.tools, env, log)


# Seen twice in about 30 universal oracle runs on DeepSpeed 0.19.8 (three runs of the suite here),
# which run without the preload, and not in 12 more run by hand: it trains every step and writes
# its losses, then aborts at exit in C++ teardown (a std::thread still joinable). Seen since in a
# resume under the preload on 0.14.5 (e2e_deepspeed_z2_fp32_preload) and in a save under the
# preload on 0.14.5 (e2e_deepspeed_3d_save, a clean-clone CI run), each after its last step; not
# in 12 runs of that save's trainer by hand (without the preload). The trainers never call
# destroy_process_group, and gloo's worker threads then meet the interpreter's finalization
# (pytorch/pytorch PR 179291 describes that abort). ucp's objects that own threads are never destroyed, so none of ucp's is
# left joinable at exit.
TEARDOWN_ABORT = 'terminate called without an active exception'


def save_dir_of(extra):
    """The --save_dir a trainer's arguments `extra` name, or None."""
    return extra[extra.index('--save_dir') + 1] if '--save_dir' in extra else None


# Seen three times, all at ZeRO-3 DP=2 under `ctest -j2` on a 2-core machine, and only at step 6
# (the second update after a resume at step 3): once in DeepSpeed 0.14.5's own universal resume,
# which runs without the preload, in a clean-clone CI run, and twice under the preload; steps 4 and 5
# were bit-identical to the oracle's each time and the same run passed when run again. Between
# steps 5 and 6 no checkpoint is read, so nothing ucp serves is on that path. A run whose losses
# are wrong for a reason of ucp's gives the same losses again, so one more run hides nothing.
NAN_LOSS = re.compile(r'^STEP (\d+) loss nan$', re.MULTILINE)


def run_past_flakes(run, last_step, save_dir=None, finished=None):
    """Runs `run` (a DeepSpeed run through `last_step`, returning (status, seconds, output)) once
    more, saying so, after either of two flakes outside ucp: it trained through `last_step`, or
    wrote `finished` (the file its rank 0 writes after the last barrier: a run that resaves a
    loaded step trains none), and then aborted at exit with TEARDOWN_ABORT, after every loss and
    file the test compares; or it printed a NaN loss (NAN_LOSS). A saving run's `save_dir` is
    removed first, so that the second run saves afresh. Any other failure, an abort before the
    last step included, is the test's failure."""
    status, seconds, output = run()
    if status != 0 and TEARDOWN_ABORT in output and (f'STEP {last_step} loss' in output or
                                                     (finished and os.path.isfile(finished))):
        flake = f'ran to its end, then aborted at exit ("{TEARDOWN_ABORT}")'
    elif NAN_LOSS.search(output):
        flake = f'printed a NaN loss at step {NAN_LOSS.search(output).group(1)}'
    else:
        return status, seconds, output
    print(f'the run {flake}; running it again', flush=True)
    if save_dir:
        shutil.rmtree(save_dir, ignore_errors=True)
    return run()


def losses(path):
    return {int(step): value for step, value in json.load(open(path))['losses'].items()}


def float32_bits(value):
    bits = struct.pack('<f', value)
    if struct.unpack('<f', bits)[0] != value:
        fail(f'loss {value!r} is not a float32 value')
    return bits.hex()


def print_losses(title, values):
    print(f'{title}: ' + ' '.join(f'{step}:{values[step]:.9g}' for step in sorted(values)), flush=True)


def save_with_and_without_preload(args, env, work, label, run, expected_files=None):
    """Trains and saves twice in `work`, made afresh: without the preload into ckpt_plain and under
    it into ckpt, `run(name, env, save_dir)` launching the run called `name` ('plain', 'save'),
    which writes its losses to work/<name>.json, and returning (status, seconds, output). Fails
    the test unless both ran, their losses are bit-identical, the preload committed an index of
    ckpt/TAG, its .pt files are `expected_files` (where given) and each is byte-identical to the
    plain run's. Returns (the tag folder, the saving run's losses, the .pt files)."""
    logs = os.path.join(work, 'logs_save')

    def both_runs():
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        runs = {}
        for name, run_env, save_dir in (('plain', env, 'ckpt_plain'),
                                        ('save', preload_env(env, args.lib, logs), 'ckpt')):
            status, seconds, output = run(name, run_env, os.path.join(work, save_dir))
            if status != 0:
                fail(f'DeepSpeed {label} training ({name}) exited {status}:\n{output[-3000:]}')
            runs[name] = losses(os.path.join(work, f'{name}.json'))
            print(f'{label} run {"under" if name == "save" else "without"} the preload: '
                  f'{seconds:.1f} s')
        print_losses(f'losses {label}', runs['save'])
        if {s: float32_bits(v) for s, v in runs['save'].items()} == \
                {s: float32_bits(v) for s, v in runs['plain'].items()}:
            return runs
        print_losses(f'losses {label} without the preload', runs['plain'])
        return None

    # Seen once in a clean-clone CI run (0.14.5, ZeRO-3 fp32, DP=4, under ctest -j2): the run
    # WITHOUT the preload left the other runs' losses from step 2 on (4.3953619 against
    # 4.40102243, which the run under the preload and ZeRO-2's runs gave), so no ucp code was in
    # the run that moved. Both runs once more: a difference ucp causes comes back.
    runs = both_runs()
    if runs is None:
        print('the losses differ; running both again', flush=True)
        runs = both_runs()
    if runs is None:
        fail('the preload changed the losses of the saving run')
    tag_dir = os.path.join(work, 'ckpt', TAG)
    index = os.path.join(tag_dir, '.ucp', 'index.json')
    if not os.path.isfile(index):
        fail(f'no committed index {index} after the save; ucp logs:\n{log_tail(logs)}')
    # DeepSpeed's own file set, nothing added beside it (ucp's files live under .ucp/).
    files = sorted(n for n in os.listdir(tag_dir) if n.endswith('.pt'))
    if expected_files is not None and files != sorted(expected_files):
        fail(f'tag files {files}, expected {sorted(expected_files)}')
    for name in files:
        plain = os.path.join(work, 'ckpt_plain', TAG, name)
        if open(plain, 'rb').read() != open(os.path.join(tag_dir, name), 'rb').read():
            fail(f'{name} saved under the preload differs from {plain}')
    return tag_dir, runs['save'], files


def step_save(args, env, work):
    prefix = 'bf16_' if 'bf16' in args.config else ''
    expected = model_states_names(args.config, SAVE_DP) + \
        [f'{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt' for r in range(SAVE_DP)]

    def run(name, run_env, save_dir):
        return run_past_flakes(lambda: launch(
            args, run_env, SAVE_DP, os.path.join(work, f'{name}.log'),
            ['--steps', str(STEPS), '--save_dir', save_dir, '--save_at', str(SAVE_AT),
             '--out', os.path.join(work, f'{name}.json')]), STEPS, save_dir)
    tag_dir, _, _ = save_with_and_without_preload(
        args, env, work, f'DP={SAVE_DP} (steps 1..{STEPS}, save at {SAVE_AT})', run, expected)
    with open(os.path.join(work, 'ckpt', 'latest')) as f:
        if f.read().strip() != TAG:
            fail('latest does not name the saved tag')
    index = os.path.join(tag_dir, '.ucp', 'index.json')
    print(f'index committed: {index} ({os.path.getsize(index)} bytes)')


def step_universal(args, env, work):
    tag_dir = os.path.join(work, 'ckpt', TAG)
    universal = os.path.join(work, 'universal')
    shutil.rmtree(universal, ignore_errors=True)
    ds_to_universal(env, tag_dir, os.path.join(universal, TAG))
    oracle_config = ORACLE_CONFIG.get(args.config, args.config)
    status, seconds, output = run_past_flakes(lambda: launch(
        args, env, RESUME_DP, os.path.join(work, 'universal.log'),
        ['--steps', str(STEPS), '--load_dir', universal, '--load_tag', TAG, '--universal',
         '--out', os.path.join(work, 'universal.json')], config=oracle_config), STEPS)
    if status != 0:
        fail(f'DeepSpeed universal load at DP={RESUME_DP} exited {status}:\n{output[-3000:]}')
    print(f'DP={RESUME_DP} universal resume ({oracle_config}): {seconds:.1f} s')
    print_losses(f'losses DP={RESUME_DP} universal', losses(os.path.join(work, 'universal.json')))
    if oracle_config != args.config:
        out = os.path.join(work, 'universal_as_saved.json')
        status, _, output = run_past_flakes(lambda: launch(
            args, env, RESUME_DP, os.path.join(work, 'universal_as_saved.log'),
            ['--steps', str(STEPS), '--load_dir', universal, '--load_tag', TAG, '--universal',
             '--out', out]), STEPS)
        if status != 0:
            fail(f'DeepSpeed universal load in {args.config} exited {status}:\n{output[-3000:]}')
        print_losses(f'losses DP={RESUME_DP} universal in {args.config} (not the oracle)',
                     losses(out))


# torch.load(path, weights_only=True) of each argument, in a child: {path: "loads" or the error's
# reason (the global torch's restricted unpickler refused, else the error's first line)}.
WEIGHTS_ONLY_PROBE = r"""
import json, re, sys, torch
outcome = {}
for path in sys.argv[1:]:
    try:
        torch.load(path, map_location='cpu', weights_only=True)
        outcome[path] = 'loads'
    except Exception as error:
        text = str(error)
        refused = re.search(r'(?:GLOBAL|Unsupported class) ([\w.]+)', text)
        outcome[path] = (f'refuses global {refused.group(1)}' if refused
                         else f'{type(error).__name__}: {text.splitlines()[0] if text else ""}')
print(json.dumps(outcome))
"""


def file_kind(name):
    return 'optimizer' if name.endswith('optim_states.pt') else 'model'


def check_weights_only(env, originals, served):
    """Each served file must do under torch.load(weights_only=True), torch >= 2.6's default, what
    the saved files of its kind do: load, or be refused for the same global."""
    probe = subprocess.run([sys.executable, '-c', WEIGHTS_ONLY_PROBE] + originals + served,
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        fail(f'the weights_only probe exited {probe.returncode}:\n{probe.stderr[-2000:]}')
    outcome = json.loads(probe.stdout.strip().splitlines()[-1])
    expected = {}
    for path in originals:
        kind = file_kind(os.path.basename(path))
        if expected.setdefault(kind, outcome[path]) != outcome[path]:
            fail(f'saved {kind} files differ under weights_only=True: {outcome}')
    for path in served:
        kind = file_kind(os.path.basename(path))
        if outcome[path] != expected.get(kind):
            fail(f'served {os.path.basename(path)} under weights_only=True: {outcome[path]}; the '
                 f'saved {kind} files: {expected.get(kind)}')
    print('torch.load(weights_only=True): ' + '; '.join(
        f'{kind} files {result}, saved and served alike' for kind, result in sorted(expected.items())))


def step_preload(args, env, work):
    logs = os.path.join(work, 'logs_preload')
    shutil.rmtree(logs, ignore_errors=True)
    view = os.path.join(work, 'ckpt', TAG, '.ucp', 'views', VIEW)
    served_env = preload_env(env, args.lib, logs)
    if args.build_part_kb:
        # A view of its own: built now, every file in parts.
        shutil.rmtree(view, ignore_errors=True)
        served_env['UCP_BUILD_PART_KB'] = str(args.build_part_kb)
    status, seconds, output = run_past_flakes(lambda: launch(
        args, served_env, RESUME_DP, os.path.join(work, 'preload.log'),
        ['--steps', str(STEPS), '--load_dir', os.path.join(work, 'ckpt'),
         '--out', os.path.join(work, 'preload.json')]), STEPS)
    if status != 0:
        fail(f'plain load_checkpoint at DP={RESUME_DP} under the preload exited {status}:\n'
             f'{output[-3000:]}\nucp logs:\n{log_tail(logs)}')
    print(f'DP={RESUME_DP} plain resume under the preload: {seconds:.1f} s')
    got = losses(os.path.join(work, 'preload.json'))
    oracle = losses(os.path.join(work, 'universal.json'))
    full = losses(os.path.join(work, 'save.json'))
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    if sorted(got) != steps or sorted(oracle) != steps:
        fail(f'resumed steps {sorted(got)}, universal steps {sorted(oracle)}, expected {steps}')
    print_losses(f'losses DP={RESUME_DP} preload', got)
    print_losses(f'losses DP={RESUME_DP} universal', oracle)
    print_losses(f'losses DP={SAVE_DP} uninterrupted', {s: full[s] for s in steps})
    print(f'max |d| vs uninterrupted DP={SAVE_DP}: {max(abs(got[s] - full[s]) for s in steps):.3e}')
    mismatched = [s for s in steps if float32_bits(got[s]) != float32_bits(oracle[s])]
    if mismatched:
        fail('losses differ from DeepSpeed\'s universal load at steps '
             + ', '.join(f'{s} ({float32_bits(got[s])} vs {float32_bits(oracle[s])})' for s in mismatched))
    print(f'losses bit-identical to DeepSpeed\'s universal load at steps {steps[0]}..{steps[-1]}')
    if args.build_part_kb:
        # Each part leaves its mark (the CRC-32s of what it wrote) in the view; the ranks' own
        # log lines may be lost, as a rank that ends without ucp's shutdown does not flush them.
        marks = os.listdir(view)
        parts = {name: sum(1 for m in marks if m.startswith(f'.{name}#part') and m.endswith('.done'))
                 for name in model_states_names(args.config, RESUME_DP) +
                 [f'zero_pp_rank_{r}_mp_rank_00_optim_states.pt' for r in range(RESUME_DP)]}
        if any(count < 2 for count in parts.values()):
            fail(f'files not built in parts of {args.build_part_kb} KiB: {parts}')
        print(f'every served file built in parts of {args.build_part_kb} KiB: '
              + ', '.join(f'{name} in {count}' for name, count in parts.items()))
    # What the preload served is what `ucp reshard` writes for the same target.
    resharded = os.path.join(work, 'reshard')
    shutil.rmtree(resharded, ignore_errors=True)
    subprocess.run([args.ucp, 'reshard', os.path.join(work, 'ckpt', TAG), '--to', f'dp={RESUME_DP}',
                    '--out', resharded], check=True, stdout=subprocess.DEVNULL)
    resharded = os.path.join(resharded, TAG)
    served = sorted(n for n in os.listdir(resharded) if n.endswith('.pt'))
    if len(served) != len(model_states_names(args.config, RESUME_DP)) + RESUME_DP:
        fail(f'`ucp reshard --to dp={RESUME_DP}` wrote {served}')
    check_served(view, resharded, served, f'dp={RESUME_DP}')
    saved = os.path.join(work, 'ckpt', TAG)
    check_weights_only(env, [os.path.join(saved, n) for n in sorted(os.listdir(saved))
                             if n.endswith('.pt')],
                       [os.path.join(view, 'served.' + n) for n in served])


def step_atoms(args, env, work):
    ckpt = os.path.join(work, 'ckpt_atoms')
    shutil.rmtree(ckpt, ignore_errors=True)
    logs = os.path.join(work, 'logs_atoms')
    shutil.rmtree(logs, ignore_errors=True)
    status, seconds, output = run_past_flakes(lambda: launch(
        args, dict(preload_env(env, args.lib, logs), UCP_MODE='atoms'), SAVE_DP,
        os.path.join(work, 'atoms_save.log'),
        ['--steps', str(SAVE_AT), '--save_dir', ckpt, '--save_at', str(SAVE_AT)]), SAVE_AT, ckpt)
    if status != 0:
        fail(f'DeepSpeed DP={SAVE_DP} training with UCP_MODE=atoms exited {status}:\n{output[-3000:]}')
    tag_dir = os.path.join(ckpt, TAG)
    framework = sorted(n for n in os.listdir(tag_dir) if n.endswith('.pt'))
    for name in framework:
        plain = os.path.join(work, 'ckpt_plain', TAG, name)
        if open(plain, 'rb').read() != open(os.path.join(tag_dir, name), 'rb').read():
            fail(f'{name} saved with UCP_MODE=atoms differs from {plain}')
    with open(os.path.join(tag_dir, '.ucp', 'index.json')) as f:
        index = json.load(f)
    if 'store' not in index:
        fail(f'the index records no atoms store; ucp logs:\n{log_tail(logs)}')
    store = os.path.join(tag_dir, '.ucp', 'atoms')
    store_bytes = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(store)
                      for n in names)
    framework_bytes = sum(os.path.getsize(os.path.join(tag_dir, n)) for n in framework)
    print(f'DP={SAVE_DP} save with UCP_MODE=atoms: {seconds:.1f} s; atoms store {store_bytes} bytes '
          f'beside {framework_bytes} bytes of DeepSpeed files')
    for name in framework:
        os.remove(os.path.join(tag_dir, name))
    logs = os.path.join(work, 'logs_atoms_resume')
    shutil.rmtree(logs, ignore_errors=True)
    status, seconds, output = run_past_flakes(lambda: launch(
        args, preload_env(env, args.lib, logs), RESUME_DP, os.path.join(work, 'atoms_resume.log'),
        ['--steps', str(STEPS), '--load_dir', ckpt, '--out', os.path.join(work, 'atoms.json')]),
        STEPS)
    if status != 0:
        fail(f'DP={RESUME_DP} resume from the atoms store exited {status}:\n{output[-3000:]}\n'
             f'ucp logs:\n{log_tail(logs)}')
    got = losses(os.path.join(work, 'atoms.json'))
    oracle = losses(os.path.join(work, 'universal.json'))
    print_losses(f'losses DP={RESUME_DP} from the atoms store alone', got)
    if {s: float32_bits(v) for s, v in got.items()} != \
            {s: float32_bits(v) for s, v in oracle.items()}:
        print_losses(f'losses DP={RESUME_DP} universal', oracle)
        fail('losses from the atoms store differ from DeepSpeed\'s universal load')
    print(f'DeepSpeed\'s files deleted; DP={RESUME_DP} resume from the atoms store ({seconds:.1f} s): '
          f'losses bit-identical to DeepSpeed\'s universal load')


def step_refusal(args, env, work):
    status, seconds, output = launch(
        args, env, RESUME_DP, os.path.join(work, 'refusal.log'),
        ['--steps', str(STEPS), '--load_dir', os.path.join(work, 'ckpt')])
    if status == 0:
        fail(f'DeepSpeed resumed the DP={SAVE_DP} checkpoint at DP={RESUME_DP} without the preload')
    if DP_REFUSAL not in output:
        fail(f'DeepSpeed failed without its DP world size error:\n{output[-3000:]}')
    print(f'without the preload DeepSpeed refuses ({seconds:.1f} s): '
          + next(line.strip() for line in output.splitlines() if DP_REFUSAL in line))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('step', choices=['save', 'universal', 'preload', 'refusal', 'atoms'])
    parser.add_argument('--config', choices=sorted(CONFIGS), required=True)
    parser.add_argument('--build-part-kb', type=int,
                        help='preload: UCP_BUILD_PART_KB for the resume, in a view built anew')
    add_run_arguments(parser)
    args = parse_run_arguments(parser)
    env = trainer_environment(args)
    work = os.path.join(args.work, args.config)
    if args.step != 'save' and not os.path.isfile(os.path.join(work, 'save.json')):
        fail(f'no saved checkpoint in {work} (run the save step first)')
    {'save': step_save, 'universal': step_universal, 'preload': step_preload,
     'refusal': step_refusal, 'atoms': step_atoms}[args.step](args, env, work)


if __name__ == '__main__':
    main()

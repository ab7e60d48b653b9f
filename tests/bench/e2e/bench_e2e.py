#!/usr/bin/env python3
"""Overhead of LD_PRELOAD=libucp.so on a real training job: step time and save time.

The same trainer, seeds and arguments run REPS times without and REPS times with the preload,
alternating (and alternating which goes first) so that drift of this shared machine hits both.
Each run trains STEPS steps at NPROC ranks (gloo, 127.0.0.1) and saves every SAVE_EVERY steps to
a new tag (each save then commits a tag, and under the preload builds its index in the
background). timed_trainer.py times, on rank 0, every iteration (step return to step return) and
every save call; iterations that contain a save or come first (WARMUP) are left out of the step
time, so the background index builds show in the steps that follow a save.

Per run: the mean step and save times, wall and CPU (rank 0's process, all its threads, ucp's
background index build included), and the job's wall and CPU time (all ranks, launch to exit, which
under the preload includes waiting for the last index build). --mode atoms runs the preload with
UCP_MODE=atoms (every rank also writes its share of each tag's atoms store in the background). CPU time is the figure that holds
still on a loaded machine. Reported: the mean over runs ± the standard deviation of the run means,
the difference with/without, and "within noise" when the difference is under twice its standard
error (sqrt(sd1^2/n + sd2^2/n)). Printed as a markdown table, also written to WORK/results.md.

Trainers (--trainer): deepspeed (../shared/tools/deepspeed-cpu/train.py, run in place; needs
DeepSpeed importable, env from its env.sh) or standin (demo/zero_trainer.py, plain PyTorch).
"""
import argparse
import json
import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WARMUP = 2


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def trainer_command(args, timings, save_dir):
    """(argv, cwd, env) of one run of the chosen trainer at args.nproc ranks."""
    timed = os.path.join(HERE, 'timed_trainer.py')
    save_at = [str(s) for s in range(args.save_every, args.steps + 1, args.save_every)]
    if args.trainer == 'deepspeed':
        tools = args.tools
        dump = subprocess.run(['bash', '-c', f'. "{tools}/env.sh" && env -0'], capture_output=True,
                              check=True).stdout
        env = dict(item.split('=', 1) for item in dump.decode().split('\0') if '=' in item)
        argv = [args.python, 'launch.py', str(args.nproc), str(free_port()), timed, 'deepspeed', timings,
                os.path.join(tools, 'train.py'), '--stage', '2', '--dtype', 'fp32', '--steps',
                str(args.steps), '--save_dir', save_dir, '--save_at', *save_at, '--d', str(args.d),
                '--nlayer', str(args.nlayer), '--vocab', str(args.vocab)]
        return argv, tools, env
    demo = os.path.join(REPO, 'demo')
    env = dict(os.environ, MASTER_ADDR='127.0.0.1', OMP_NUM_THREADS='1', PYTHONDONTWRITEBYTECODE='1')
    argv = [args.python, os.path.join(demo, 'launch.py'), str(args.nproc), str(free_port()), timed,
            'standin', timings, os.path.join(demo, 'zero_trainer.py'), '--steps', str(args.steps),
            '--save_dir', save_dir, '--save_at', *save_at, '--d', str(args.d), '--nlayer',
            str(args.nlayer), '--vocab', str(args.vocab)]
    return argv, demo, env


def run_once(args, preload, index):
    """One training job; returns its rank-0 figures."""
    label = 'ucp' if preload else 'plain'
    run_dir = os.path.join(args.work, f'{label}{index}')
    shutil.rmtree(run_dir, ignore_errors=True)
    timings = os.path.join(run_dir, 'timings')
    argv, cwd, env = trainer_command(args, timings, os.path.join(run_dir, 'ckpt'))
    env = {k: v for k, v in env.items() if not k.startswith('UCP_') and k != 'LD_PRELOAD'}
    if preload:
        env['LD_PRELOAD'] = args.lib
        env['UCP_MODE'] = args.mode
    os.makedirs(run_dir)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(os.path.join(run_dir, 'train.log'), 'w') as log:
        status = subprocess.run(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    if status != 0:
        tail = open(os.path.join(run_dir, 'train.log'), errors='replace').read()[-3000:]
        raise SystemExit(f'bench_e2e: {label} run {index} exited {status}:\n{tail}')
    rank0 = json.load(open(os.path.join(timings, 'rank0.json')))
    steps = [it for it in rank0['iterations'][WARMUP:] if not it['saved']]
    saves = rank0['saves']
    tags = [d for d in os.listdir(os.path.join(run_dir, 'ckpt')) if d.startswith('global_step')]
    saved_bytes = sum(os.path.getsize(os.path.join(root, name))
                      for root, dirs, names in os.walk(os.path.join(run_dir, 'ckpt', tags[0]))
                      for name in names if '.ucp' not in root.split(os.sep))
    indexed = sum(os.path.isfile(os.path.join(run_dir, 'ckpt', t, '.ucp', 'index.json')) for t in tags)
    if preload and indexed != len(tags):
        raise SystemExit(f'bench_e2e: ucp run {index}: {indexed} of {len(tags)} tags indexed')
    if preload and args.mode == 'atoms':
        stored = sum('"store"' in open(os.path.join(run_dir, 'ckpt', t, '.ucp', 'index.json')).read()
                     for t in tags)
        if stored != len(tags):
            raise SystemExit(f'bench_e2e: ucp run {index}: {stored} of {len(tags)} atoms stores')
    if not args.keep:
        shutil.rmtree(os.path.join(run_dir, 'ckpt'))
    figures = {'step wall': statistics.mean(s['seconds'] for s in steps),
               'step CPU': statistics.mean(s['cpu'] for s in steps),
               'save wall': statistics.mean(s['seconds'] for s in saves),
               'save CPU': statistics.mean(s['cpu'] for s in saves),
               'job wall': wall, 'job CPU': cpu, 'bytes': saved_bytes}
    print(f'  {label:5} run {index}: step {figures["step wall"] * 1e3:.0f} ms wall, '
          f'{figures["step CPU"] * 1e3:.0f} ms CPU ({len(steps)} steps); save '
          f'{figures["save wall"] * 1e3:.0f} ms wall, {figures["save CPU"] * 1e3:.0f} ms CPU '
          f'({len(saves)} saves, {indexed} indexed); job {wall:.1f} s wall, {cpu:.1f} s CPU', flush=True)
    return figures


def summary(plain, ucp, key, scale, unit):
    a = [r[key] * scale for r in plain]
    b = [r[key] * scale for r in ucp]
    mean_a, mean_b = statistics.mean(a), statistics.mean(b)
    sd_a = statistics.stdev(a) if len(a) > 1 else 0.0
    sd_b = statistics.stdev(b) if len(b) > 1 else 0.0
    diff = mean_b - mean_a
    noise = 2 * math.sqrt(sd_a**2 / len(a) + sd_b**2 / len(b))
    verdict = 'yes' if abs(diff) <= noise else 'no'
    return (f'| {key} ({unit}) | {mean_a:.2f} ± {sd_a:.2f} | {mean_b:.2f} ± {sd_b:.2f} | '
            f'{diff:+.2f} ({100 * diff / mean_a:+.1f}%) | {noise:.2f} | {verdict} |')


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--trainer', choices=['deepspeed', 'standin'], required=True)
    parser.add_argument('--lib', required=True, help='libucp.so')
    parser.add_argument('--tools', help='../shared/tools/deepspeed-cpu (deepspeed trainer)')
    parser.add_argument('--work', required=True)
    parser.add_argument('--python', default=sys.executable)
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--nproc', type=int, default=2)
    parser.add_argument('--steps', type=int, default=24)
    parser.add_argument('--save_every', type=int, default=4)
    parser.add_argument('--d', type=int, default=256)
    parser.add_argument('--nlayer', type=int, default=4)
    parser.add_argument('--vocab', type=int, default=512)
    parser.add_argument('--keep', action='store_true', help='keep the checkpoints')
    parser.add_argument('--mode', choices=['index', 'atoms'], default='index',
                        help='UCP_MODE of the runs under the preload')
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    print(f'trainer {args.trainer}, {args.nproc} ranks, {args.steps} steps, a save every '
          f'{args.save_every}, model d={args.d} nlayer={args.nlayer} vocab={args.vocab}, '
          f'{args.reps} runs each, UCP_MODE={args.mode}', flush=True)
    plain, ucp = [], []
    for rep in range(args.reps):
        for preload in ((False, True) if rep % 2 == 0 else (True, False)):
            (ucp if preload else plain).append(run_once(args, preload, rep))
    saved_mib = plain[0]['bytes'] / 2**20
    lines = [
        f'Trainer: {args.trainer}, {args.nproc} ranks (gloo, CPU), {args.steps} steps, a save every '
        f'{args.save_every} steps ({saved_mib:.1f} MiB per save), {args.reps} runs each, alternating; '
        f'UCP_MODE={args.mode}; rank 0 figures, mean over runs ± sd of the run means.', '',
        '| figure | without ucp | with LD_PRELOAD=libucp.so | difference | 2 × std. error | within noise |',
        '| --- | --- | --- | --- | --- | --- |',
        *(summary(plain, ucp, key, 1e3, 'ms') for key in ('step wall', 'step CPU', 'save wall', 'save CPU')),
        *(summary(plain, ucp, key, 1, 's') for key in ('job wall', 'job CPU')),
    ]
    text = '\n'.join(lines)
    print(text)
    with open(os.path.join(args.work, 'results.md'), 'w') as f:
        f.write(text + '\n')


if __name__ == '__main__':
    main()

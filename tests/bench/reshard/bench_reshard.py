#!/usr/bin/python3
"""Reshard/export benchmark: ucp against `cp -r` (and DeepSpeed's ds_to_universal.py) on one tag.

Generates a DeepSpeed ZeRO-2 tag at DP=4 once (gen_ds_zero.py, >= 2 GiB by default) and times,
in one run and on the same bytes: `cp -r TAG` (the baseline), `ucp index TAG`, `ucp reshard TAG
--to dp=2` and `--to dp=8`, `ucp export TAG --format safetensors --state fp32` and `--format
deepspeed-universal`, and, when DeepSpeed is importable (DS_SRC), `ds_to_universal.py` on the same
tag. Every timed command is a child process: wall time (perf_counter around fork..wait4), the
time of the sync(2) that follows (so a command that leaves dirty pages behind is not favoured
over one that fsyncs), and the peak RSS (GNU time's %M, i.e. wait4's ru_maxrss seen from a small
parent; for ds_to_universal, whose workers are its children, that is the largest single process).
Repetitions are interleaved across the commands; the table shows the best wall time and the
highest peak RSS. The page cache is warm by default
(the tag is read once before timing); --cold drops the tag's pages with posix_fadvise(DONTNEED)
before every command, which needs no privileges but is best effort. Nothing asserts: the aims
of issue 4 are reported as met or missed.
"""
import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, '..', '..', '..'))
PYTHON = '/usr/bin/python3'
# ru_maxrss of a child forked from this Python process starts at the parent's RSS (the fork's
# pages count until exec), so the commands run under GNU time, a small parent, when it is there.
GNU_TIME = '/usr/bin/time'
TAG = 'global_step5'


def tree_bytes(path):
    """(bytes, files) of the regular files under path; (0, 0) when it does not exist."""
    if os.path.isfile(path):
        return os.path.getsize(path), 1
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(root, name))
            files += 1
    return total, files


def tag_files(tag_dir):
    return sorted(os.path.join(tag_dir, n) for n in os.listdir(tag_dir)
                  if os.path.isfile(os.path.join(tag_dir, n)))


def read_through(paths):
    buf = bytearray(1 << 24)
    for path in paths:
        with open(path, 'rb', buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_cache(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Op:
    """One timed command writing `out`, which is removed before each run and, unless keep, after."""

    def __init__(self, name, argv, out, env=None, reps=None, keep=False):
        self.name, self.argv, self.out, self.env, self.reps, self.keep = name, argv, out, env, reps, keep
        self.walls, self.syncs, self.rss_kib = [], [], 0
        self.error = None
        self.written = (0, 0)

    def run(self, cold_paths, log_dir):
        """Runs the command once; its stderr goes to log_dir. cold_paths: pages to drop first."""
        if os.path.lexists(self.out):
            shutil.rmtree(self.out) if os.path.isdir(self.out) else os.remove(self.out)
        if not self.keep:
            os.makedirs(os.path.dirname(self.out), exist_ok=True)
        if cold_paths:
            drop_cache(cold_paths)
        os.sync()
        stem = os.path.join(log_dir, self.name.replace(' ', '_').replace('/', '_'))
        err_path = stem + '.stderr'
        argv = self.argv
        if os.access(GNU_TIME, os.X_OK):
            argv = [GNU_TIME, '-f', '%M', '-o', stem + '.rss'] + argv
        with open(err_path, 'wb') as err:
            start = time.perf_counter()
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=self.env)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - start
            proc.returncode = os.waitstatus_to_exitcode(status)
        start = time.perf_counter()
        os.sync()
        sync = time.perf_counter() - start
        if proc.returncode != 0:
            with open(err_path, 'rb') as f:
                lines = f.read().decode(errors='replace').strip().splitlines()
            self.error = f'exit {proc.returncode}: ' + (lines[-1][:160] if lines else '(no stderr)')
            return
        self.walls.append(wall)
        self.syncs.append(sync)
        if argv is self.argv:
            rss_kib = usage.ru_maxrss
        else:
            with open(stem + '.rss') as f:
                rss_kib = int(f.read().split()[-1])
        self.rss_kib = max(self.rss_kib, rss_kib)
        self.written = tree_bytes(self.out)
        if not self.keep:
            shutil.rmtree(self.out)

    def best(self):
        return min(self.walls) if self.walls else None

    def best_durable(self):
        """Best wall + sync time: the command's output on disk (ucp fsyncs what it writes, cp does not)."""
        return min(w + s for w, s in zip(self.walls, self.syncs)) if self.walls else None


def ds_env(ds_src):
    env = dict(os.environ)
    tools = os.path.join(REPO, '..', 'shared', 'tools', 'deepspeed-cpu')
    env['PYTHONPATH'] = os.pathsep.join(p for p in (ds_src, os.path.abspath(tools), env.get('PYTHONPATH')) if p)
    env.update(DS_ACCELERATOR='cpu', DS_BUILD_OPS='0', OMP_NUM_THREADS='1', PYTHONDONTWRITEBYTECODE='1')
    return env


def deepspeed_importable(env):
    probe = 'import deepspeed.checkpoint.ds_to_universal'
    return subprocess.run([PYTHON, '-c', probe], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ucp', required=True, help='the ucp binary')
    parser.add_argument('--work', default=os.environ.get('UCP_BENCH_DIR', '/tmp/ucp-bench-reshard'),
                        help='scratch folder (generated tag kept in WORK/src between runs)')
    parser.add_argument('--out', default=os.environ.get('UCP_BENCH_OUT'),
                        help='where the commands write (default WORK/out, the tag\'s file system); '
                        'e.g. /dev/shm to take the disk out of the comparison')
    parser.add_argument('--preset', default='gpt2', help='gen_ds_zero.py --preset')
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--ds-reps', type=int, default=1, help='repetitions of ds_to_universal (slow)')
    parser.add_argument('--ds-src', default=os.environ.get('DS_SRC'), help='DeepSpeed v0.14.5 source folder')
    parser.add_argument('--extract-workers', type=int, default=4, help='ds_to_universal default: 4')
    parser.add_argument('--merge-workers', type=int, default=2, help='ds_to_universal default: 2')
    parser.add_argument('--cold', action='store_true', help='posix_fadvise(DONTNEED) the tag before each run')
    parser.add_argument('--results', default=None, help='markdown results file (default WORK/results.md)')
    args = parser.parse_args()

    work = os.path.abspath(args.work)
    src = os.path.join(work, 'src')
    tag = os.path.join(src, TAG)
    out = os.path.abspath(os.path.join(args.out or work, 'ucp-bench-reshard-out' if args.out else 'out'))
    if not os.path.isdir(tag):
        subprocess.run([PYTHON, os.path.join(HERE, 'gen_ds_zero.py'), src, '--preset', args.preset], check=True)
    files = tag_files(tag)
    tag_bytes = sum(os.path.getsize(f) for f in files)
    shutil.rmtree(out, ignore_errors=True)

    index_json = os.path.join(tag, '.ucp', 'index.json')
    ucp = os.path.abspath(args.ucp)
    ops = [
        Op('cp -r TAG', ['cp', '-r', tag, os.path.join(out, 'cp', TAG)], os.path.join(out, 'cp', TAG)),
        # Each run indexes from scratch; the index it leaves serves the commands after it.
        Op('ucp index TAG', [ucp, 'index', tag], index_json, keep=True),
        Op('ucp reshard --to dp=2', [ucp, 'reshard', tag, '--to', 'dp=2', '--out', os.path.join(out, 'dp2')],
           os.path.join(out, 'dp2')),
        Op('ucp reshard --to dp=8', [ucp, 'reshard', tag, '--to', 'dp=8', '--out', os.path.join(out, 'dp8')],
           os.path.join(out, 'dp8')),
        Op('ucp export safetensors fp32',
           [ucp, 'export', tag, '--format', 'safetensors', '--state', 'fp32', '--out', os.path.join(out, 'st')],
           os.path.join(out, 'st')),
        Op('ucp export deepspeed-universal',
           [ucp, 'export', tag, '--format', 'deepspeed-universal', '--out',
            os.path.join(out, 'ucp_universal', TAG + '_universal')],
           os.path.join(out, 'ucp_universal', TAG + '_universal')),
    ]
    ds_note = 'DeepSpeed not importable (set DS_SRC to a v0.14.5 source folder): ds_to_universal not timed'
    if args.ds_src:
        env = ds_env(os.path.abspath(args.ds_src))
        if deepspeed_importable(env):
            script = os.path.join(os.path.abspath(args.ds_src), 'deepspeed', 'checkpoint', 'ds_to_universal.py')
            ds_out = os.path.join(out, 'ds_universal', TAG + '_universal')
            ops.append(Op('ds_to_universal.py', [
                PYTHON, script, '--input_folder', tag, '--output_folder', ds_out, '--inject_missing_state',
                '--num_extract_workers', str(args.extract_workers), '--num_merge_workers',
                str(args.merge_workers)
            ], ds_out, env=env, reps=args.ds_reps))
            ds_note = (f'ds_to_universal.py from {args.ds_src} with --inject_missing_state '
                       f'--num_extract_workers {args.extract_workers} --num_merge_workers {args.merge_workers}')

    os.makedirs(out)
    if not args.cold:
        read_through(files)
    for rep in range(max(args.reps, args.ds_reps)):
        for op in ops:
            if op.error is None and rep < (op.reps or args.reps):
                print(f'[{rep + 1}] {op.name} ...', end=' ', flush=True)
                op.run(files if args.cold else None, out)
                print(op.error or f'{op.walls[-1]:.3f} s (+{op.syncs[-1]:.3f} s sync)', flush=True)

    cp, cp_durable = ops[0].best(), ops[0].best_durable()
    by_name = {op.name: op for op in ops}
    lines = [
        f'## ucp reshard/export benchmark ({datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC)',
        '',
        f'- tag: `{tag}`: DeepSpeed ZeRO-2 fp32 DP=4, preset `{args.preset}` (gen_ds_zero.py), '
        f'{len(files)} files, {tag_bytes / 2**30:.2f} GiB',
        f'- outputs written under `{out}`',
        f'- machine: {platform.node()}, {os.cpu_count()} CPUs, Linux {platform.release()}; '
        f'ucp: `{ucp}`',
        '- page cache: ' + ('cold: tag pages dropped with posix_fadvise(DONTNEED) before each command '
                            '(best effort)' if args.cold else 'warm (tag read once before timing; outputs '
                            'written to the same file system, sync(2) before each command)'),
        f'- best of {args.reps} (interleaved); peak RSS = max ru_maxrss over the runs ('
        + ('GNU time %M' if os.access(GNU_TIME, os.X_OK) else
           'wait4 of a child forked from the driver: includes the driver\'s own RSS, no GNU time')
        + '); GB/s = tag bytes / wall; "+sync" = the sync(2) right after the command (its dirty pages '
        'reaching the disk)',
        f'- {ds_note}',
        '',
        '| command | wall s | +sync s | × cp -r | × cp -r (both +sync) | GB/s | peak RSS MiB | written GiB (files) |',
        '|---|---:|---:|---:|---:|---:|---:|---:|',
    ]
    for op in ops:
        if op.error is not None and not op.walls:
            lines.append(f'| {op.name} | failed: {op.error.replace("|", "/")} | | | | | | |')
            continue
        best = op.best()
        sync = op.syncs[op.walls.index(best)]
        lines.append(f'| {op.name} | {best:.3f} | {sync:.3f} | {best / cp:.2f} | {op.best_durable() / cp_durable:.2f} | '
                     f'{tag_bytes / best / 1e9:.2f} | '
                     f'{op.rss_kib / 1024:.0f} | {op.written[0] / 2**30:.2f} ({op.written[1]}) |')

    aims = []

    def aim(text, ok):
        aims.append(f'- {text}: ' + ('n/a' if ok is None else 'met' if ok else 'MISSED'))

    def timed(name):
        op = by_name.get(name)
        return op.best() if op is not None and op.walls else None

    for name in ('ucp reshard --to dp=2', 'ucp reshard --to dp=8', 'ucp export safetensors fp32',
                 'ucp export deepspeed-universal'):
        wall = timed(name)
        aim(f'{name} ≤ 1.2× cp -r (wall)', None if wall is None else wall <= 1.2 * cp)
        if wall is not None:
            aim(f'{name} ≤ 1.2× cp -r (both +sync)', by_name[name].best_durable() <= 1.2 * cp_durable)
    wall = timed('ucp index TAG')
    aim('ucp index well under 1 s', None if wall is None else wall < 1.0)
    rss = [op.rss_kib for op in ops if op.name.startswith('ucp') and op.walls]
    aim('ucp peak RSS ≤ 256 MiB', None if not rss else max(rss) <= 256 * 1024)
    ds, uni = timed('ds_to_universal.py'), timed('ucp export deepspeed-universal')
    if ds is not None and uni is not None:
        lines += ['', f'ds_to_universal.py / ucp export deepspeed-universal: **{ds / uni:.1f}×**']
    aim('≥ 20× faster than ds_to_universal', None if ds is None or uni is None else ds / uni >= 20)
    lines += ['', 'Aims (issue 4):'] + aims
    lines += ['', 'Command: `' + ' '.join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]) + '`']
    text = '\n'.join(lines) + '\n'
    print()
    print(text, end='')
    results = args.results or os.path.join(work, 'results.md')
    with open(results, 'w') as f:
        f.write(text)
    print(f'(written to {results})')


if __name__ == '__main__':
    main()

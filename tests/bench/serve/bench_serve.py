#!/usr/bin/python3
"""Serve benchmark (issue 21): N processes under the preload load a ZeRO-2 tag saved at DP=4, as
DeepSpeed's load does (loader.py: a stat of every rank's optimizer file in rank order, then each
rank reads the model states and its own file), against `ucp reshard --to dp=N` of the same tag in
the same run.

The tag (gen_ds_zero.py, preset gpt2 by default: 2.6 GB at DP=4) is generated once under --work
and indexed by --ucp on every run. Each run starts from no view (the tag's .ucp/views removed), with the page cache
warm. Per N it prints the wall time of the job (first rank's start to last rank's end), the
slowest rank's stat phase, the per-rank read phase (min / max), the bytes each rank read and wrote
(rchar and wchar from /proc/self/io, ucp's own reads and writes included: min / max), the bytes
the view occupies on disk, the wall time of `ucp reshard`, and the wall time of the same N ranks
loading `ucp reshard`'s output without the preload (the load alone, which any resume pays after an
offline reshard), best of --reps for each. Nothing asserts; the aims of issue 21 that this measures
are printed as ratios: the job's wall to the offline reshard's, and to the offline path's whole
(the reshard, then the load). With --part-kb K1,K2,... the job runs once per value with
UCP_BUILD_PART_KB set to it ("default": unset, files of less than 2 GiB of tensor data built
whole), a row each: the view's big files built in parts by several processes against one owner.
With --model-states-only each rank reads the model states alone, under UCP_CACHE_DIR (each
process builds only what it reads): the one file every rank waits for, built by one process or in
parts by all of them; the offline columns are left out.

With --metadata each rank runs under strace instead (its timings are then strace's, not ucp's), and
per N it prints the metadata operations on the view's directory (stat, access, open, listing, link,
rename, unlink, mkdir: what a parallel file system's metadata server answers) per rank, min / max,
and for the job: the cost that grows with ranks × files.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATOR = os.path.join(HERE, '..', 'reshard', 'gen_ds_zero.py')
# The interpreter of the generator (it needs torch) and the loaders; UCP_BENCH_PYTHON names another
# (a machine whose torch is not Debian's, such as a lent GPU machine's).
PYTHON = os.environ.get('UCP_BENCH_PYTHON', '/usr/bin/python3')
TAG = 'global_step5'
GB = 1e9
# The system calls that ask a file system's metadata server (strace -e trace=...).
METADATA_CALLS = ('newfstatat,statx,stat,lstat,access,faccessat,faccessat2,open,openat,getdents64,'
                  'link,linkat,rename,renameat,renameat2,unlink,unlinkat,mkdir,mkdirat')


def allocated_bytes(path):
    """Bytes the files under `path` occupy on disk (a sparse placeholder occupies none)."""
    return sum(os.stat(os.path.join(d, n)).st_blocks * 512
               for d, _, names in os.walk(path) for n in names)


def load_job(args, tag_dir, procs, logs, preload=True, part_kb='default'):
    """One job of `procs` loader.py ranks, under the preload unless `preload` is false, with
    UCP_BUILD_PART_KB=`part_kb` unless it is 'default'; returns the ranks' JSON records."""
    shutil.rmtree(os.path.join(tag_dir, '.ucp', 'views'), ignore_errors=True)
    shutil.rmtree(os.path.join(os.path.dirname(logs), 'node-cache'), ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    os.makedirs(logs)
    start = time.time() + 1.0 + 0.05 * procs  # every rank has started by then
    ranks = []
    for rank in range(procs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(procs))
        env.pop('UCP_BUILD_PART_KB', None)
        if preload:
            # info: the builds' lines, which model_part_builders counts (a few per process)
            env.update(LD_PRELOAD=args.lib, UCP_LOG_DIR=logs, UCP_LOG_LEVEL='info')
            if part_kb != 'default':
                env.update(UCP_BUILD_PART_KB=part_kb)
        if preload and args.model_states_only:
            env.update(UCP_CACHE_DIR=os.path.join(os.path.dirname(logs), 'node-cache'))
        command = [PYTHON, os.path.join(HERE, 'loader.py'), tag_dir, repr(start)]
        if args.model_states_only:
            command.append('model')
        if args.metadata:
            # -y names each descriptor's path, so that listings (getdents64 on a descriptor)
            # count by the directory they list.
            command = ['strace', '-f', '-qq', '-y', '-e', 'trace=' + METADATA_CALLS, '-o',
                       os.path.join(logs, f'strace.{rank}')] + command
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    records = []
    for rank, process in enumerate(ranks):
        out, _ = process.communicate()
        if process.returncode != 0:
            sys.exit(f'bench_serve: rank {rank} of {procs} exited {process.returncode}')
        records.append(json.loads(out.strip().splitlines()[-1]))
    if any(r['missing'] for r in records):
        sys.exit(f'bench_serve: at {procs} ranks some files were not found (not served?): '
                 f'see {logs}')
    return records


def view_metadata_operations(logs, procs, view_root):
    """Per rank, the metadata system calls its strace log shows on paths under `view_root`."""
    counts = []
    for rank in range(procs):
        with open(os.path.join(logs, f'strace.{rank}')) as log:
            counts.append(sum(1 for line in log if view_root in line))
    return counts


def model_part_builders(logs):
    """How many processes' logs say they built a part of the model states (0: built whole)."""
    marker = 'served.mp_rank_00_model_states.pt'
    count = 0
    for name in os.listdir(logs):
        with open(os.path.join(logs, name), errors='replace') as log:
            count += any('view: built part' in line and marker in line for line in log)
    return count


def job_wall(records):
    """First rank's start to last rank's end."""
    return max(r['end'] for r in records) - min(r['begin'] for r in records)


def reshard(args, tag_dir, procs, out):
    shutil.rmtree(out, ignore_errors=True)
    begin = time.perf_counter()
    subprocess.run([args.ucp, 'reshard', tag_dir, '--to', f'dp={procs}', '--out', out],
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - begin


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ucp', required=True, help='the ucp CLI')
    parser.add_argument('--lib', required=True, help='libucp.so')
    parser.add_argument('--work', default=os.environ.get('UCP_BENCH_DIR', '/tmp/ucp-bench-serve'))
    parser.add_argument('--preset', default='gpt2', help='gen_ds_zero.py --preset')
    parser.add_argument('--procs', default='8,16', help='comma-separated process counts')
    parser.add_argument('--reps', type=int, default=2)
    parser.add_argument('--part-kb', default='default',
                        help='comma-separated UCP_BUILD_PART_KB values, "default" for unset')
    parser.add_argument('--model-states-only', action='store_true',
                        help='each rank reads the model states alone, under UCP_CACHE_DIR')
    parser.add_argument('--metadata', action='store_true',
                        help='count each rank\'s metadata operations on the view under strace')
    args = parser.parse_args()
    if args.metadata and shutil.which('strace') is None:
        sys.exit('bench_serve: --metadata needs strace (apt-get install strace)')
    work = os.path.abspath(args.work)
    src = os.path.join(work, 'src-' + args.preset)
    tag_dir = os.path.join(src, TAG)
    if not os.path.isfile(os.path.join(tag_dir, 'mp_rank_00_model_states.pt')):
        shutil.rmtree(src, ignore_errors=True)
        subprocess.run([PYTHON, GENERATOR, src, '--preset', args.preset], check=True)
    # Indexed by this --ucp every run: the index is then what the library under test expects
    # (with chunk hashes, or without them from a ucp before them).
    subprocess.run([args.ucp, 'index', tag_dir], check=True, stdout=subprocess.DEVNULL)
    source_bytes = sum(os.path.getsize(os.path.join(tag_dir, n)) for n in os.listdir(tag_dir)
                       if os.path.isfile(os.path.join(tag_dir, n)))
    print(f'tag: {tag_dir}, ZeRO-2 fp32 DP=4, preset {args.preset}, {source_bytes / GB:.2f} GB; '
          f'{os.cpu_count()} CPUs; best of {args.reps}; lib {args.lib}')
    if args.metadata:
        print('| N | files in the view | view metadata operations per rank (min / max) '
              '| for the job | per rank per file (max) |')
        print('|---|---|---|---|---|')
        for procs in [int(p) for p in args.procs.split(',')]:
            logs = os.path.join(work, f'logs-{procs}')
            load_job(args, tag_dir, procs, logs)
            counts = view_metadata_operations(logs, procs, os.path.join(tag_dir, '.ucp', 'views'))
            files = sum(1 for directory, _, names in os.walk(os.path.join(tag_dir, '.ucp', 'views'))
                        if '.planned' not in directory for name in names
                        if name.startswith('served.'))
            print(f'| {procs} | {files} | {min(counts)} / {max(counts)} | {sum(counts)} '
                  f'| {max(counts) / files:.1f} |', flush=True)
        return
    if args.model_states_only:
        print('| N | `UCP_BUILD_PART_KB` | job wall s | read phase s (min / max) '
              '| wchar GB per rank (min / max) | processes that built model-states parts |')
        print('|---|---|---|---|---|---|')
        for procs in [int(p) for p in args.procs.split(',')]:
            for part_kb in args.part_kb.split(','):
                logs = os.path.join(work, f'logs-{procs}')
                best = None
                for _ in range(args.reps):
                    records = load_job(args, tag_dir, procs, logs, part_kb=part_kb)
                    if best is None or job_wall(records) < job_wall(best[0]):
                        best = (records, model_part_builders(logs))
                records, builders = best
                reads = [r['read_s'] for r in records]
                wchar = [r['wchar'] / GB for r in records]
                print(f'| {procs} | {part_kb} | {job_wall(records):.2f} '
                      f'| {min(reads):.2f} / {max(reads):.2f} '
                      f'| {min(wchar):.2f} / {max(wchar):.2f} | {builders} |', flush=True)
        return
    print('| N | `UCP_BUILD_PART_KB` | job wall s | slowest stat phase s | read phase s (min / max) '
          '| rchar GB per rank (min / max) | wchar GB per rank (min / max) | view GB on disk '
          '| processes that built model-states parts '
          '| `ucp reshard` s | load of its output s | wall / reshard | wall / (reshard + load) |')
    print('|---|---|---|---|---|---|---|---|---|---|---|---|---|')
    for procs in [int(p) for p in args.procs.split(',')]:
        resharded = os.path.join(work, 'reshard-out')
        offline = min(reshard(args, tag_dir, procs, resharded) for _ in range(args.reps))
        plain_load = min(job_wall(load_job(args, os.path.join(resharded, TAG), procs,
                                           os.path.join(work, f'logs-plain-{procs}'),
                                           preload=False))
                         for _ in range(args.reps))
        shutil.rmtree(resharded, ignore_errors=True)
        for part_kb in args.part_kb.split(','):
            best = None
            logs = os.path.join(work, f'logs-{procs}')
            for _ in range(args.reps):
                records = load_job(args, tag_dir, procs, logs, part_kb=part_kb)
                wall = job_wall(records)
                if best is None or wall < best[0]:
                    best = (wall, records, allocated_bytes(os.path.join(tag_dir, '.ucp', 'views')),
                            model_part_builders(logs))
            wall, records, view_bytes, builders = best
            reads = [r['read_s'] for r in records]
            rchar = [r['rchar'] / GB for r in records]
            wchar = [r['wchar'] / GB for r in records]
            print(f'| {procs} | {part_kb} | {wall:.2f} | {max(r["stat_s"] for r in records):.3f} '
                  f'| {min(reads):.2f} / {max(reads):.2f} | {min(rchar):.2f} / {max(rchar):.2f} '
                  f'| {min(wchar):.2f} / {max(wchar):.2f} | {view_bytes / GB:.2f} | {builders} '
                  f'| {offline:.2f} | {plain_load:.2f} | {wall / offline:.2f} '
                  f'| {wall / (offline + plain_load):.2f} |', flush=True)


if __name__ == '__main__':
    main()

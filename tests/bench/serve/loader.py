#!/usr/bin/python3
"""One rank of the serve benchmark: what DeepSpeed's ZeRO-1/2 load does to a tag's files, timed.

DeepSpeed v0.14.5's engine._get_all_zero_checkpoint_names checks os.path.exists on every rank's
optimizer file in rank order, then each rank reads the model states and its own optimizer file.
This does the same with plain reads (no torch, so that the figures are ucp's), then prints one
JSON line: rank, seconds of the stat phase and of the read phase, and the process's rchar and
wchar from /proc/self/io (every byte it read and wrote through system calls, ucp's own included).

Usage (RANK and WORLD_SIZE set, under LD_PRELOAD=libucp.so): loader.py TAG_DIR START_TIME [model]
  START_TIME: a time.time() at which every rank begins, so that start-up does not count.
  model: the model states alone (a stat, then read whole), no optimizer file.
"""
import json
import os
import sys
import time


def io_counters():
    with open('/proc/self/io') as f:
        fields = dict(line.split(': ') for line in f.read().splitlines())
    return int(fields['rchar']), int(fields['wchar'])


def read_whole(path):
    buf = bytearray(1 << 24)
    with open(path, 'rb', buffering=0) as f:
        while f.readinto(buf):
            pass


def main():
    tag_dir, start = sys.argv[1], float(sys.argv[2])
    model_only = sys.argv[3:] == ['model']
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    optim = [os.path.join(tag_dir, f'zero_pp_rank_{r}_mp_rank_00_optim_states.pt')
             for r in range(0 if model_only else world)]
    model = os.path.join(tag_dir, 'mp_rank_00_model_states.pt')
    time.sleep(max(0.0, start - time.time()))
    begin = time.time()
    rchar0, wchar0 = io_counters()
    missing = [path for path in [model] + optim if not os.path.exists(path)]
    stated = time.time()
    read_whole(model)
    if not model_only:
        read_whole(optim[rank])
    end = time.time()
    rchar, wchar = io_counters()
    print(json.dumps({'rank': rank, 'begin': begin, 'stat_s': stated - begin, 'read_s': end - stated,
                      'end': end, 'rchar': rchar - rchar0, 'wchar': wchar - wchar0,
                      'missing': len(missing)}), flush=True)


if __name__ == '__main__':
    main()

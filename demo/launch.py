#!/usr/bin/env python3
"""Starts NPROC copies of a training script on this machine, one per rank (torchrun's role).

Usage: launch.py NPROC PORT SCRIPT [ARGS...]
Each copy gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR
(default 127.0.0.1) and MASTER_PORT; the rest of the environment (LD_PRELOAD included) is
inherited. When a rank fails, the others are killed; the exit status is the first non-zero one.
"""
import os
import subprocess
import sys
import time


def main():
    nproc, port, script, rest = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), LOCAL_SIZE=str(nproc),
                   MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, script] + rest, env=env))
    status = 0
    while procs:
        for proc in list(procs):
            code = proc.poll()
            if code is None:
                continue
            procs.remove(proc)
            if code != 0 and status == 0:
                status = code
                for other in procs:
                    other.kill()
        time.sleep(0.05)
    sys.exit(status)


if __name__ == "__main__":
    main()

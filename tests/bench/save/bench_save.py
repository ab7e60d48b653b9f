"""Times torch.save of a 1 GiB state dict (64 fp32 tensors of 16 MiB) to a DeepSpeed file name.

Usage: bench_save.py DIR REPS [--paired]
Prints one line per repetition: "seconds <wall time> cpu <process CPU time>" of torch.save, the
CPU time summed over all threads (ucp's hashing thread included). Each repetition saves to a
fresh file (the previous one is deleted first), so the page cache holds the source tensors and
nothing of the destination; the first, warm-up save is not printed.

--paired (run under the preload): each repetition saves twice, once to the tracked DeepSpeed name
and once to a name no checkpoint layout recognises (which ucp passes through), in alternating
order, and prints "seconds <tracked> cpu <cpu> untracked <seconds> cpu <cpu>". Pairs a second
apart in one process see the same machine, so their ratio measures tracking alone, without the
spread between processes (on this VM single saves vary by ±10%).
"""
import os
import sys
import time

import torch


def timed_save(state, path):
    """Saves `state` to a fresh `path`; returns (wall seconds, process CPU seconds)."""
    if os.path.exists(path):
        os.unlink(path)
    os.sync()
    start = time.perf_counter()
    cpu_start = time.process_time()
    torch.save(state, path)
    return time.perf_counter() - start, time.process_time() - cpu_start


def main():
    directory, reps = sys.argv[1], int(sys.argv[2])
    paired = sys.argv[3:] == ["--paired"]
    tag_dir = os.path.join(directory, "global_step1")
    os.makedirs(tag_dir, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    state = {f"layer_{i}": torch.rand(4 << 20, generator=generator) for i in range(64)}
    tracked = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    untracked = os.path.join(tag_dir, "bench_untracked.pt")
    for rep in range(reps + 1):
        if not paired:
            seconds, cpu = timed_save(state, tracked)
            if rep > 0:
                print(f"seconds {seconds:.6f} cpu {cpu:.6f}", flush=True)
            continue
        order = (tracked, untracked) if rep % 2 else (untracked, tracked)
        times = {path: timed_save(state, path) for path in order}
        if rep > 0:
            (seconds, cpu), (plain_seconds, plain_cpu) = times[tracked], times[untracked]
            print(f"seconds {seconds:.6f} cpu {cpu:.6f} untracked {plain_seconds:.6f} "
                  f"cpu {plain_cpu:.6f}", flush=True)
    for path in (tracked, untracked):
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()

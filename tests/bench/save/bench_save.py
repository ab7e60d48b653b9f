"""Times torch.save of a 1 GiB state dict (64 fp32 tensors of 16 MiB) to a DeepSpeed file name.

Usage: bench_save.py DIR REPS
Prints one line per repetition: "seconds <wall time> cpu <process CPU time>" of torch.save, the
CPU time summed over all threads (ucp's hashing thread included). Each repetition saves to a
fresh file (the previous one is deleted first), so the page cache holds the source tensors and
nothing of the destination; the first, warm-up save is not printed.
"""
import os
import sys
import time

import torch


def main():
    directory, reps = sys.argv[1], int(sys.argv[2])
    tag_dir = os.path.join(directory, "global_step1")
    os.makedirs(tag_dir, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    state = {f"layer_{i}": torch.rand(4 << 20, generator=generator) for i in range(64)}
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    for rep in range(reps + 1):
        if os.path.exists(path):
            os.unlink(path)
        os.sync()
        start = time.perf_counter()
        cpu_start = time.process_time()
        torch.save(state, path)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        if rep > 0:
            print(f"seconds {elapsed:.6f} cpu {cpu:.6f}", flush=True)
    os.unlink(path)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""One rank of the crash test's job: resumes from SAVE_DIR/latest, then saves tag after tag, forever.

Usage: crash_rank.py SAVE_DIR PAYLOAD_DIR SYNC_DIR   (env RANK, WORLD_SIZE, CRASH_SLOW_RANK_MS)

No torch: the files are the bytes of a real DeepSpeed ZeRO-2 tag (PAYLOAD_DIR, 4 ranks), written
as DeepSpeed v0.14.5's engine.save_checkpoint writes them, through libc under the preload:
  barrier; rank 0: mp_rank_00_model_states.pt; every rank: its zero_pp_rank_<r> file;
  rank 0: `latest` (open "w", write, close) right after its own files, before the final barrier;
  barrier.
With CRASH_SLOW_RANK_MS=M the ranks other than 0 sleep M ms between 64 KiB writes of their file,
as a straggler or slow storage would: rank 0 then writes `latest` while they are still writing,
DeepSpeed's window for a crash. Barriers are files in SYNC_DIR. The driver kills the whole
process group with SIGKILL at a random moment.
"""
import os
import sys
import time

CHUNK = 64 << 10


def barrier(sync_dir, name, rank, world):
    open(os.path.join(sync_dir, f"{name}.{rank}"), "w").close()
    names = [os.path.join(sync_dir, f"{name}.{r}") for r in range(world)]
    while not all(os.path.exists(n) for n in names):
        time.sleep(0.0005)


def write(path, data, pause):
    with open(path, "wb") as f:
        for start in range(0, len(data), CHUNK):
            f.write(data[start:start + CHUNK])
            f.flush()
            if pause:
                time.sleep(pause)


def main():
    save_dir, payload_dir, sync_dir = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pause = float(os.environ.get("CRASH_SLOW_RANK_MS", "0")) / 1000 if rank != 0 else 0
    mine = ["mp_rank_00_model_states.pt"] if rank == 0 else []
    mine.append(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    payload = {name: open(os.path.join(payload_dir, name), "rb").read() for name in mine}

    # The resume: what the stand-in trainer's load_checkpoint reads first.
    step = 0
    latest = os.path.join(save_dir, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            step = int(f.read().strip()[len("global_step"):])
    if rank == 0:
        print(f"RESUMED {step}", flush=True)
    while True:
        step += 1
        tag = f"global_step{step}"
        barrier(sync_dir, f"{step}.begin", rank, world)
        tag_dir = os.path.join(save_dir, tag)
        os.makedirs(tag_dir, exist_ok=True)
        for name in mine:
            write(os.path.join(tag_dir, name), payload[name], pause)
        if rank == 0:
            with open(latest, "w") as f:
                f.write(tag)
        barrier(sync_dir, f"{step}.end", rank, world)


if __name__ == "__main__":
    main()

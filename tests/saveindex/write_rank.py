"""One rank of a DeepSpeed save, written the way DeepSpeed writes it, for the preload tests.

Usage: write_rank.py SAVE_DIR FIXTURE_TAG RANK [--delay SECONDS] [--then exit|wait-index|hang]
                     [--pid-file PATH]
  Writes, into SAVE_DIR/<the fixture tag's name>/, this rank's files of the fixture tag (a real
  DeepSpeed save): rank 0 the model states and zero_pp_rank_0, rank r zero_pp_rank_r. Each file
  is copied with plain buffered writes in 64 KiB pieces (torch.save's own bytes, written as a
  stream). Rank 0 then writes SAVE_DIR/latest, as engine.save_checkpoint does before its final
  barrier. --delay: sleep first (a slower rank). Before closing its last file a rank prints
  "index before last close: yes|no". Afterwards:
    exit        return at once (default)
    wait-index  wait up to 60 s for SAVE_DIR/<tag>/.ucp/index.json, then return
    hang        (with rank > 0) write only half of the last file, print "hanging", never close it
--pid-file: write this process's pid there first (for a test that kills it).
"""
import argparse
import os
import re
import sys
import time

CHUNK = 64 << 10


def rank_of(name):
    if "model_states" in name:
        return 0
    return int(re.search(r"zero_pp_rank_(\d+)_", name).group(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("save_dir")
    parser.add_argument("fixture_tag")
    parser.add_argument("rank", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--then", choices=["exit", "wait-index", "hang"], default="exit")
    parser.add_argument("--pid-file")
    args = parser.parse_args()
    if args.pid_file:
        with open(args.pid_file, "w") as pid_file:
            pid_file.write(str(os.getpid()))

    tag = os.path.basename(os.path.normpath(args.fixture_tag))
    tag_dir = os.path.join(args.save_dir, tag)
    index = os.path.join(tag_dir, ".ucp", "index.json")
    os.makedirs(tag_dir, exist_ok=True)
    time.sleep(args.delay)
    names = sorted(n for n in os.listdir(args.fixture_tag)
                   if n.endswith(".pt") and rank_of(n) == args.rank)
    names.sort(key=lambda n: "model_states" not in n)
    for i, name in enumerate(names):
        with open(os.path.join(args.fixture_tag, name), "rb") as source:
            data = source.read()
        last = i + 1 == len(names)
        target = open(os.path.join(tag_dir, name), "wb")
        end = len(data) // 2 if last and args.then == "hang" else len(data)
        for offset in range(0, end, CHUNK):
            target.write(data[offset:min(offset + CHUNK, end)])
        if last and args.then == "hang":
            target.flush()
            print("hanging", flush=True)
            while True:
                time.sleep(60)
        target.flush()
        if last:
            print("index before last close: " + ("yes" if os.path.exists(index) else "no"),
                  flush=True)
        target.close()
    if args.rank == 0:
        with open(os.path.join(args.save_dir, "latest"), "w") as latest:
            latest.write(tag)
    if args.then == "wait-index":
        deadline = time.monotonic() + 60
        while not os.path.exists(index) and time.monotonic() < deadline:
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())

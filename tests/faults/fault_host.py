"""The host of the fault-injection tests: a trainer's save or load, printing what it observed.

Usage:
  fault_host.py save SAVE_DIR FIXTURE_TAG RANKS [--wait-index SECONDS] [--hard-exit]
      Writes, into SAVE_DIR/<the fixture tag's name>/, the files of the fixture tag (a real
      DeepSpeed save) of RANKS ("all", or a comma-separated list: rank 0 has the model states
      and zero_pp_rank_0, rank r zero_pp_rank_r) the way torch.save streams them (plain buffered
      writes of 64 KiB), then, when rank 0 is among them, SAVE_DIR/latest. Prints one line per
      call result it saw ("write NAME: BYTES bytes in N calls", "close NAME: ok"), so that two
      runs compare line for line. --wait-index: then wait up to SECONDS for the tag's
      .ucp/index.json. --hard-exit: leave with os._exit (no teardown: ucp's exit drain skipped).
  fault_host.py load TAG_DIR NAME...
      Opens and reads each file NAME of the tag; prints "NAME sha256=<hex> size=<n>" or
      "NAME errno=<name>".
"""
import argparse
import errno
import hashlib
import os
import re
import sys
import time

CHUNK = 64 << 10


def rank_of(name):
    if "model_states" in name:
        return 0
    return int(re.search(r"zero_pp_rank_(\d+)_", name).group(1))


def save(args):
    tag = os.path.basename(os.path.normpath(args.fixture_tag))
    tag_dir = os.path.join(args.save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    ranks = None if args.ranks == "all" else {int(r) for r in args.ranks.split(",")}
    names = sorted(n for n in os.listdir(args.fixture_tag)
                   if n.endswith(".pt") and (ranks is None or rank_of(n) in ranks))
    for name in names:
        with open(os.path.join(args.fixture_tag, name), "rb") as source:
            data = source.read()
        target = open(os.path.join(tag_dir, name), "wb", buffering=0)
        written = calls = 0
        for offset in range(0, len(data), CHUNK):
            piece = data[offset:offset + CHUNK]
            done = 0
            while done < len(piece):
                done += target.write(piece[done:])
                calls += 1
            written += done
        print(f"write {name}: {written} bytes in {calls} calls")
        target.close()
        print(f"close {name}: ok")
    if ranks is None or 0 in ranks:
        with open(os.path.join(args.save_dir, "latest"), "w") as latest:
            print(f"write latest: {latest.write(tag)} bytes")
        print("close latest: ok")
    if args.wait_index:
        index = os.path.join(tag_dir, ".ucp", "index.json")
        deadline = time.monotonic() + args.wait_index
        while not os.path.exists(index) and time.monotonic() < deadline:
            time.sleep(0.02)
    sys.stdout.flush()
    if args.hard_exit:
        os._exit(0)
    return 0


def load(args):
    for name in args.names:
        try:
            with open(os.path.join(args.tag_dir, name), "rb") as f:
                data = f.read()
            print(f"{name} sha256={hashlib.sha256(data).hexdigest()} size={len(data)}")
        except OSError as error:
            print(f"{name} errno={errno.errorcode.get(error.errno, error.errno)}")
    return 0


def main():
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    save_parser = commands.add_parser("save")
    save_parser.add_argument("save_dir")
    save_parser.add_argument("fixture_tag")
    save_parser.add_argument("ranks")
    save_parser.add_argument("--wait-index", type=float, default=0.0)
    save_parser.add_argument("--hard-exit", action="store_true")
    load_parser = commands.add_parser("load")
    load_parser.add_argument("tag_dir")
    load_parser.add_argument("names", nargs="+")
    args = parser.parse_args()
    return save(args) if args.command == "save" else load(args)


if __name__ == "__main__":
    sys.exit(main())

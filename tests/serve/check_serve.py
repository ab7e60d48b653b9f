"""Checks run by serve_test.sh, most of them under LD_PRELOAD=libucp.so.

check_serve.py served TAG REF DP      the tag reads as REF (`ucp reshard --to dp=DP`): every file's
    bytes and torch.load, dp_world_size == DP, ranks >= DP do not exist, the others do.
check_serve.py listing TAG REF         os.listdir, os.scandir and glob of TAG show REF's files
    (and .ucp), with REF's sizes through DirEntry.stat and os.stat.
check_serve.py passthrough TAG         the real files: dp_world_size 4, every rank exists.
check_serve.py corrupt TAG first|lenient|strict  first and lenient: the real files (the view's
    build met the damage, in this process or an earlier one); strict: opening a file of the tag
    fails with EIO.
check_serve.py concurrent TAG GO       waits for GO to exist, then opens every dp8 file of TAG at
    once (threads) and prints "name xxh" lines (sha256) in name order.
check_serve.py digests DIR             the same lines for the files of DIR (no preload needed).
"""
import errno
import glob
import hashlib
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deepspeed"))
import ds_objects  # noqa: E402 (DeepSpeed's pickled classes as stand-ins)


def fail(message):
    print("FAIL:", message)
    sys.exit(1)


def optim(rank):
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


MODEL = "mp_rank_00_model_states.pt"


def read(path):
    with open(path, "rb") as file:
        return file.read()


def load(path):
    return ds_objects.load(path)


def check_served(tag, ref, dp):
    model = load(os.path.join(tag, MODEL))
    if model["dp_world_size"] != dp:
        fail(f"dp_world_size {model['dp_world_size']}, expected {dp}")
    for rank in range(8):
        exists = os.path.exists(os.path.join(tag, optim(rank)))
        if exists != (rank < dp):
            fail(f"os.path.exists({optim(rank)}) is {exists} at dp={dp}")
    try:
        os.stat(os.path.join(tag, optim(dp)))
        fail(f"os.stat of {optim(dp)} succeeded")
    except FileNotFoundError:
        pass
    for name in [MODEL] + [optim(rank) for rank in range(dp)]:
        if read(os.path.join(tag, name)) != read(os.path.join(ref, name)):
            fail(f"{name}: the served bytes differ from ucp reshard's")
        if os.stat(os.path.join(tag, name)).st_size != os.stat(os.path.join(ref, name)).st_size:
            fail(f"{name}: os.stat's size differs from ucp reshard's")
        differences = ds_objects.compare(load(os.path.join(tag, name)),
                                         load(os.path.join(ref, name)))
        if differences:
            fail(f"{name}: torch.load differs from loading ucp reshard's file: {differences[:5]}")


def check_listing(tag, ref):
    expected = sorted(os.listdir(ref) + [".ucp"])
    listed = sorted(os.listdir(tag))
    if listed != expected:
        fail(f"os.listdir: {listed}, expected {expected}")
    with os.scandir(tag) as entries:
        scanned = {entry.name: entry for entry in entries}
    if sorted(scanned) != expected:
        fail(f"os.scandir: {sorted(scanned)}, expected {expected}")
    for name in os.listdir(ref):
        entry = scanned[name]
        if not entry.is_file() or entry.is_dir():
            fail(f"os.scandir: {name} is not listed as a file")
        size = os.stat(os.path.join(ref, name)).st_size
        if entry.stat().st_size != size or os.stat(os.path.join(tag, name)).st_size != size:
            fail(f"{name}: stat size differs from ucp reshard's {size}")
    globbed = sorted(os.path.basename(p) for p in glob.glob(os.path.join(tag, "*.pt")))
    if globbed != sorted(os.listdir(ref)):
        fail(f"glob: {globbed}, expected {sorted(os.listdir(ref))}")
    fd = os.open(tag, os.O_RDONLY | os.O_DIRECTORY)
    try:
        by_fd = sorted(os.listdir(fd))
    finally:
        os.close(fd)
    if by_fd != expected:
        fail(f"os.listdir(fd): {by_fd}, expected {expected}")


def check_passthrough(tag):
    real = sorted([MODEL] + [optim(rank) for rank in range(4)] + [".ucp"])
    if sorted(os.listdir(tag)) != real:
        fail(f"os.listdir: {sorted(os.listdir(tag))}")
    if load(os.path.join(tag, MODEL))["dp_world_size"] != 4:
        fail("dp_world_size is not the saved 4")
    for rank in range(4):
        if not os.path.exists(os.path.join(tag, optim(rank))):
            fail(f"{optim(rank)} does not exist")


def expect_eio(path, why):
    try:
        read(path)
        fail(f"reading {os.path.basename(path)} succeeded {why}")
    except OSError as error:
        if error.errno != errno.EIO:
            fail(f"errno {error.errno}, expected EIO")


def check_corrupt(tag, mode):
    if mode == "strict":
        expect_eio(os.path.join(tag, MODEL), "under UCP_STRICT=1")
    else:  # first, lenient: the view is read whole or not at all, so not here
        if mode == "first" and load(os.path.join(tag, MODEL))["dp_world_size"] != 4:
            fail("the first reader was not given the real model states")
        # Listings and stats before the verdict come from the view's plan; after it, the real files.
        check_passthrough(tag)


def digests(directory, names):
    return "".join(f"{name} {hashlib.sha256(read(os.path.join(directory, name))).hexdigest()}\n"
                   for name in names)


def check_concurrent(tag, go):
    names = [MODEL] + [optim(rank) for rank in range(8)]
    while not os.path.exists(go):
        time.sleep(0.001)
    results = {}

    def reader(name):
        results[name] = read(os.path.join(tag, name))

    threads = [threading.Thread(target=reader, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.stdout.write("".join(f"{name} {hashlib.sha256(results[name]).hexdigest()}\n"
                             for name in sorted(names)))


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "served":
        check_served(args[0], args[1], int(args[2]))
    elif command == "listing":
        check_listing(args[0], args[1])
    elif command == "passthrough":
        check_passthrough(args[0])
    elif command == "corrupt":
        check_corrupt(args[0], args[1])
    elif command == "concurrent":
        check_concurrent(args[0], args[1])
    elif command == "digests":
        sys.stdout.write(digests(args[0], sorted(os.listdir(args[0]))))
    else:
        fail(f"unknown command {command}")


if __name__ == "__main__":
    main()

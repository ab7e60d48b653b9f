"""Checks for the save-tracking preload tests.

check.py journal TAG_DIR RANK NAME...  the tag's journals hold exactly one "data" record per NAME
    (and no other data record) whose size and xxh3 are the file's (xxh3 from `xxhsum -H3`), with
    rank RANK, plus one "commit" record for ../latest.
check.py untracked TAG_DIR             no journal directory in TAG_DIR.
check.py same DIR_A DIR_B NAME...      torch.load of DIR_A/NAME and DIR_B/NAME give equal objects.
"""
import glob
import json
import os
import subprocess
import sys

import torch


def fail(message):
    print("FAIL:", message)
    sys.exit(1)


def xxhsum_h3(path):
    output = subprocess.run(["xxhsum", "-H3", path], check=True, capture_output=True, text=True)
    return output.stdout.split()[-1]


def records(tag_dir):
    found = []
    for journal in sorted(glob.glob(os.path.join(tag_dir, ".ucp", "journal.*.jsonl"))):
        with open(journal, encoding="utf-8") as file:
            found.extend(json.loads(line) for line in file)
    return found


def check_journal(tag_dir, rank, names):
    all_records = records(tag_dir)
    data = [r for r in all_records if r["role"] == "data" and not r.get("durable")]
    # Under UCP_DURABLE=1 each close also has its durable copy (the same record, "durable": true).
    copies = [r for r in all_records if r.get("durable")]
    if os.environ.get("UCP_DURABLE") == "1":
        if sorted(copies, key=json.dumps) != sorted(
                (dict(r, durable=True) for r in data), key=json.dumps):
            fail(f"durable copies {copies} do not match the close records {data}")
    elif copies:
        fail(f"durable records without UCP_DURABLE: {copies}")
    if sorted(r["path"] for r in data) != sorted(names):
        fail(f"journaled data files {sorted(r['path'] for r in data)} != expected {sorted(names)}")
    for record in data:
        path = os.path.join(tag_dir, record["path"])
        if record["size"] != os.path.getsize(path):
            fail(f"{path}: journal size {record['size']} != {os.path.getsize(path)}")
        if record["xxh3"] != xxhsum_h3(path):
            fail(f"{path}: journal xxh3 {record['xxh3']} != xxhsum {xxhsum_h3(path)}")
        if record["rank"] != rank or record["framework"] != "deepspeed":
            fail(f"{path}: record {record}")
    commits = [r for r in all_records if r["role"] == "commit"]
    if len(commits) != 1 or commits[0]["path"] != "../latest":
        fail(f"commit records {commits}")
    if commits[0]["xxh3"] != xxhsum_h3(os.path.join(tag_dir, "..", "latest")):
        fail("commit record's xxh3 is not latest's")


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a.keys()) == list(b.keys())
                and all(equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return type(a) is type(b) and a == b


def main():
    command = sys.argv[1]
    if command == "journal":
        check_journal(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    elif command == "untracked":
        if os.path.exists(os.path.join(sys.argv[2], ".ucp")):
            fail(f"{sys.argv[2]} has a journal: {records(sys.argv[2])}")
    elif command == "same":
        for name in sys.argv[4:]:
            a = torch.load(os.path.join(sys.argv[2], name))
            b = torch.load(os.path.join(sys.argv[3], name))
            if not equal(a, b):
                fail(f"{name}: torch.load gives different objects")
    else:
        fail(f"unknown command {command}")
    print("ok", command)


if __name__ == "__main__":
    main()

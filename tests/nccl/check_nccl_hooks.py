#!/usr/bin/env python3
"""NCCL hook tests: a host program run with and without libucp.so preloaded.

  check_nccl_hooks.py stand-in LIBUCP HOST      the stand-in NCCL walk-through (nccl_host.c)
  check_nccl_hooks.py errors LIBUCP HOST        the same with errors injected into each call
  check_nccl_hooks.py local-scope LIBUCP HOST LIB  NCCL reached through a dlopen(RTLD_LOCAL)'d LIB
  check_nccl_hooks.py real LIBUCP HOST|-        the real NCCL (real_nccl_host.c); "-" = skip

The host's stdout, stderr and exit status must be identical with and without the preload. With
the preload, UCP_DUMP_TOPOLOGY names a file that must list the communicators the host created,
as nccl_host.c and the stand-in's documented rules make them, with unique-id hashes equal to
what `xxhsum -H3` computes from the id bytes the host wrote. Exit status 77 means skipped.
"""
import json
import os
import subprocess
import sys
import tempfile

SKIP = 77


def run(host, env_extra, args=()):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update(env_extra)
    proc = subprocess.run([host, *args], env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def run_both(libucp, host, dump, env_extra, args=(), compare_stderr=True):
    """Runs `host` plain and preloaded; fails unless both behave the same. Returns the output."""
    plain = run(host, env_extra, args)
    preloaded = run(host, {**env_extra, "LD_PRELOAD": libucp, "UCP_DUMP_TOPOLOGY": dump}, args)
    if not compare_stderr:
        plain, preloaded = plain[:2], preloaded[:2]
    if plain != preloaded:
        raise AssertionError(f"host differs under the preload ({env_extra}):\n"
                             f"plain:     {plain}\npreloaded: {preloaded}")
    return plain


def xxh3(path):
    out = subprocess.run(["xxhsum", "-H3", path], capture_output=True, text=True, check=True)
    return out.stdout.strip().rsplit("= ", 1)[1]


def load_dump(path):
    with open(path) as f:
        doc = json.load(f)
    assert doc["version"] == 1, doc
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp." in n], "temp file left"
    return doc


def expect(record, **fields):
    for key, value in fields.items():
        if record[key] != value:
            raise AssertionError(f"{key}: expected {value!r}, got {record[key]!r} in {record}")


def check_stand_in(libucp, host):
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "topology.json")
        rc, out, _ = run_both(libucp, host, dump, {}, [tmp])
        assert rc == 0 and "failures=0" in out, out
        world_hash = xxh3(os.path.join(tmp, "world.id"))
        scalable_hash = xxh3(os.path.join(tmp, "scalable.id"))
        doc = load_dump(dump)

    comms = doc["communicators"]
    # nccl_host.c: world 4 ranks (rank 1, device 2); second comm from the same id (rank 2,
    # device 3), aborted; split(color 0, key 1): (4+1)//2 = 2 ranks, rank 1 % 2 = 1, finalized
    # then destroyed; NOCOLOR split: nothing; split in a group (color 1, key 3): 2 ranks, rank
    # 3 % 2 = 1, finalized; scalable: 8 ranks, rank 5; InitAll on devices [1, 0], first destroyed.
    assert [c["order"] for c in comms] == list(range(7)), comms
    expect(comms[0], origin="init_rank", nranks=4, rank=1, unique_id_hash=world_hash,
           cuda_device=2, split=None, state="live")
    expect(comms[1], origin="init_rank_config", nranks=4, rank=2, unique_id_hash=world_hash,
           cuda_device=3, state="aborted")
    expect(comms[2], origin="split", nranks=2, rank=1, unique_id_hash=None,
           split={"parent": 0, "color": 0, "key": 1}, state="destroyed")
    expect(comms[3], origin="split", nranks=2, rank=1,
           split={"parent": 0, "color": 1, "key": 3}, state="finalized")
    expect(comms[4], origin="init_rank_scalable", nranks=8, rank=5,
           unique_id_hash=scalable_hash, state="live")
    expect(comms[5], origin="init_all", nranks=2, rank=0, cuda_device=1, init_all_group=5,
           unique_id_hash=None, state="destroyed")
    expect(comms[6], origin="init_all", nranks=2, rank=1, cuda_device=0, init_all_group=5,
           state="live")
    assert doc["pid"] > 0
    assert len(doc["generated_unique_ids"]) == 3 and doc["generated_unique_ids"][0] == world_hash

    # The live communicators: 0 (4 ranks), 4 (8 ranks), 6 (2 ranks): the world is the largest.
    summary = doc["summary"]
    expect(summary, world=4, world_size=8, global_rank=5)
    groups = {g["unique_id_hash"]: g["communicators"] for g in summary["unique_id_groups"]}
    assert groups == {world_hash: [0], scalable_hash: [4]}, groups


# Entry point → (injected result, orders the dump must then hold). The host skips what depends
# on a failed call; ncclInProgress (7) creates the communicator, as a non-blocking NCCL does.
INJECTIONS = {
    "ncclGetUniqueId:2": None,  # no id: the host still runs on a zeroed id
    "ncclCommInitRank:3": ["init_rank_config", "init_rank_scalable", "init_all", "init_all"],
    "ncclCommInitRankConfig:7": None,
    "ncclCommSplit:5": None,
    "ncclCommSplit:7": None,
    "ncclCommInitAll:4": None,
    "ncclCommInitRankScalable:6": None,
    "ncclCommDestroy:4": None,
    "ncclCommAbort:1": None,
    "ncclCommFinalize:3": None,
}


def check_errors(libucp, host):
    for spec, origins in INJECTIONS.items():
        name, code = spec.split(":")
        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "topology.json")
            rc, out, _ = run_both(libucp, host, dump, {"STAND_IN_NCCL_FAIL": spec})
            assert rc > 0 and f"rc={code}" in out, (spec, out)
            doc = load_dump(dump)
        comms = doc["communicators"]
        if origins is not None:
            assert [c["origin"] for c in comms] == origins, (spec, comms)
        if name == "ncclGetUniqueId":
            assert doc["generated_unique_ids"] == [], doc
        if name == "ncclCommInitRankConfig":  # ncclInProgress: created, recorded
            expect(comms[1], origin="init_rank_config", nranks=4, rank=2, state="aborted")
        if spec == "ncclCommSplit:5":  # failed splits are not recorded
            assert [c["origin"] for c in comms].count("split") == 0, comms
        if spec == "ncclCommSplit:7":  # non-blocking splits: recorded, size never asked
            splits = [c for c in comms if c["origin"] == "split"]
            assert len(splits) == 2 and all(c["nranks"] is None for c in splits), splits
        if name == "ncclCommInitAll":
            assert [c["origin"] for c in comms].count("init_all") == 0, comms
        if name == "ncclCommInitRankScalable":
            assert [c["origin"] for c in comms].count("init_rank_scalable") == 0, comms
        if name == "ncclCommDestroy":  # a failed destroy leaves the communicator alive
            assert comms[5]["state"] == "live" and comms[2]["state"] == "finalized", comms
        if name == "ncclCommAbort":
            assert comms[1]["state"] == "live", comms
        if name == "ncclCommFinalize":
            assert comms[3]["state"] == "live" and comms[2]["state"] == "destroyed", comms


def check_local_scope(libucp, host, library):
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "topology.json")
        rc, out, _ = run_both(libucp, host, dump, {}, [library])
        assert rc == 0, out
        doc = load_dump(dump)
    # nccl_local_user.c: one 2-rank communicator as rank 0 on device 5, destroyed.
    assert len(doc["communicators"]) == 1, doc
    expect(doc["communicators"][0], origin="init_rank", nranks=2, rank=0, cuda_device=5,
           state="destroyed")
    assert len(doc["generated_unique_ids"]) == 1, doc


def check_real(libucp, host):
    if host == "-":
        print("skipped: the real NCCL (libnccl.so.2 under /usr/local/cuda/lib64) is not installed")
        return SKIP
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "topology.json")
        # NCCL's own warnings carry host names and times: compare stdout and the status only.
        rc, out = run_both(libucp, host, dump, {}, compare_stderr=False)
        print(out, end="")
        doc = load_dump(dump)
    assert rc == 0, out
    results = dict(line.split(" ", 1) for line in out.splitlines())
    if results["ncclGetUniqueId"] == "rc=0":
        assert len(doc["generated_unique_ids"]) == 1, doc
    init = results.get("ncclCommInitRank", "")
    comms = doc["communicators"]
    if init.startswith("rc=0 "):  # a GPU: the communicator exists and comes from that id
        expect(comms[0], origin="init_rank", nranks=1, rank=0, state="destroyed",
               unique_id_hash=doc["generated_unique_ids"][0])
    else:
        assert comms == [], comms
    return 0


def main():
    mode, libucp, host, *rest = sys.argv[1:]
    checks = {"stand-in": check_stand_in, "errors": check_errors,
              "local-scope": check_local_scope, "real": check_real}
    return checks[mode](libucp, host, *rest) or 0


if __name__ == "__main__":
    sys.exit(main())

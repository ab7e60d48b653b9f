#!/usr/bin/env python3
"""torch's NCCL process group under libucp.so, on a machine with a GPU (CI has none).

  check_torch_nccl.py LIBUCP

Runs one rank of `init_process_group("nccl")` with an eager communicator, an all_reduce, a
`new_group([0])` (torch makes it with ncclCommSplit) and an all_reduce on it, plain and with
libucp.so preloaded. stdout and the exit status must be identical. With the preload, the
UCP_DUMP_TOPOLOGY file must hold the process group's communicator (ncclCommInitRankConfig) and
its split, both on CUDA device 0 and destroyed by destroy_process_group; while they lived, its
summary named the process group's communicator as a one-rank world holding rank 0. Exit status 77 means skipped (no GPU, or no torch with NCCL).
"""
import json
import os
import subprocess
import sys
import tempfile

SKIP = 77

RANK_PROGRAM = r"""
import torch
import torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
world = torch.arange(4.0, device="cuda")
dist.all_reduce(world)
group = dist.new_group([0])
sub = torch.full((3,), 2.0, device="cuda")
dist.all_reduce(sub, group=group)
torch.cuda.synchronize()
print("world", world.tolist(), "sub", sub.tolist())
import os, shutil
if os.environ.get("UCP_DUMP_TOPOLOGY"):  # the dump as it stands while both communicators live
    shutil.copy(os.environ["UCP_DUMP_TOPOLOGY"], os.environ["UCP_DUMP_TOPOLOGY"] + ".live")
dist.destroy_process_group()
print("destroyed")
"""


def run(env_extra):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "0",
                "WORLD_SIZE": "1", **env_extra})
    proc = subprocess.run([sys.executable, "-c", RANK_PROGRAM], env=env, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def expect(record, **fields):
    for key, value in fields.items():
        if record[key] != value:
            raise AssertionError(f"{key}: expected {value!r}, got {record[key]!r} in {record}")


def why_skipped():
    """Why these checks cannot run here (no torch, no GPU, no NCCL in torch), or None."""
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        return "no GPU or no NCCL in torch"
    return None


def main():
    libucp = sys.argv[1]
    if reason := why_skipped():
        print(f"skipped: {reason}")
        return SKIP
    plain = run({})
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "topology.json")
        preloaded = run({"LD_PRELOAD": libucp, "UCP_DUMP_TOPOLOGY": dump})
        if plain[:2] != preloaded[:2]:
            raise AssertionError(f"torch differs under the preload:\nplain:     {plain}\n"
                                 f"preloaded: {preloaded}")
        assert plain[0] == 0, plain
        print(plain[1], end="")
        with open(dump) as f:
            doc = json.load(f)
        with open(dump + ".live") as f:
            live = json.load(f)
    print(json.dumps(doc, indent=1))
    comms = doc["communicators"]
    assert len(comms) == 2, comms
    expect(comms[0], origin="init_rank_config", nranks=1, rank=0, cuda_device=0,
           state="destroyed", split=None)
    expect(comms[1], origin="split", nranks=1, rank=0, cuda_device=0, state="destroyed")
    expect(comms[1]["split"], parent=comms[0]["order"])
    assert [c["state"] for c in live["communicators"]] == ["live", "live"], live
    expect(live["summary"], world=comms[0]["order"], world_size=1, global_rank=0)
    assert doc["summary"]["world"] is None, doc  # nothing lives after destroy_process_group
    return 0


if __name__ == "__main__":
    sys.exit(main())

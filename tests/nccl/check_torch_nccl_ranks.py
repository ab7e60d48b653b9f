#!/usr/bin/env python3
"""torch's NCCL process group of several ranks under libucp.so, on one GPU (CI has none).

  check_torch_nccl_ranks.py LIBUCP [RANKS]

Runs RANKS (default 4, even) processes of `init_process_group("nccl")` on CUDA device 0, each
with an eager communicator, an all_reduce, then two kinds of `new_group` (torch makes them with
ncclCommSplit): pairs of consecutive ranks ([0, 1], [2, 3], ...: a TP-like axis) and the ranks of
one parity ([0, 2, ...], [1, 3, ...]: a DP-like axis), and an all_reduce on each. NCCL refuses two
ranks of one communicator on one GPU of one host, so each rank names a host of its own
(NCCL_HOSTID) and they talk over sockets on the loopback device.

Plain and with libucp.so preloaded, every rank's stdout and exit status must be identical. With
the preload, each rank's UCP_DUMP_TOPOLOGY file, taken while its communicators lived, must hold
the world (RANKS ranks, this rank, one unique id shared by every rank) and its two splits (2 and
RANKS/2 ranks, this rank's place in each, the split's parent the world, its color shared by
exactly the members of its group); the summary must name the world, its size and the rank.
Each rank then torch.saves a DeepSpeed-named file of one tag (rank 0 also the model states, then
`latest`): with no launcher id in the environment, every journal record of the save must name
the run by its NCCL world, job "nccl=<the world's unique-id hash>".
Exit status 77 means skipped (no GPU, or no torch with NCCL).
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

from check_torch_nccl import SKIP, expect, why_skipped  # the one-rank check beside this one

RANK_PROGRAM = r"""
import os, shutil, sys
import torch
import torch.distributed as dist
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device("cuda", 0))
world = torch.full((2,), float(rank + 1), device="cuda")
dist.all_reduce(world)
pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(size // 2)]
parities = [dist.new_group(list(range(p, size, 2))) for p in range(2)]
pair = torch.full((2,), float(rank + 1), device="cuda")
dist.all_reduce(pair, group=pairs[rank // 2])
parity = torch.full((2,), float(rank + 1), device="cuda")
dist.all_reduce(parity, group=parities[rank % 2])
torch.cuda.synchronize()
print("rank", rank, "world", world.tolist(), "pair", pair.tolist(), "parity", parity.tolist())
if os.environ.get("UCP_DUMP_TOPOLOGY"):  # the dump as it stands while the communicators live
    shutil.copy(os.environ["UCP_DUMP_TOPOLOGY"], os.environ["UCP_DUMP_TOPOLOGY"] + ".live")
# A DeepSpeed-named save of this run, which the preload journals (each close's "job").
tag = os.path.join(os.environ["CHECK_SAVE_DIR"], "global_step1")
os.makedirs(tag, exist_ok=True)
state = {"rank": rank, "world": world.cpu()}
torch.save(state, os.path.join(tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
if rank == 0:
    torch.save(state, os.path.join(tag, "mp_rank_00_model_states.pt"))
dist.barrier()
if rank == 0:
    with open(os.path.join(os.environ["CHECK_SAVE_DIR"], "latest"), "w") as f:
        f.write("global_step1")
dist.barrier()
dist.destroy_process_group()
print("destroyed")
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ranks, env_extra):
    """Every rank's (exit status, stdout, stderr)."""
    port = str(free_port())
    procs = []
    for r in range(ranks):
        env = dict(os.environ)
        for name in ("LD_PRELOAD", "SLURM_JOB_ID", "PMIX_NAMESPACE", "TORCHELASTIC_RUN_ID"):
            env.pop(name, None)  # no launcher names the run: NCCL's world must
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r),
                    "WORLD_SIZE": str(ranks), "NCCL_HOSTID": f"ucp-check-host-{r}",
                    "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1",
                    "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
                    **{k: v.replace("%r", str(r)) for k, v in env_extra.items()}})
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_PROGRAM], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, out, err))
    return results


def check_rank(r, ranks, live):
    comms = live["communicators"]
    if len(comms) != 3 or any(c["state"] != "live" for c in comms):
        raise AssertionError(f"rank {r}: expected 3 live communicators, got {comms}")
    world, first, second = comms
    expect(world, origin="init_rank_config", nranks=ranks, rank=r, cuda_device=0, split=None)
    # torch splits a group's communicator off the world only on the group's members, in the
    # order the groups were made: this rank's pair, then its parity.
    expect(first, origin="split", nranks=2, rank=r % 2, cuda_device=0)
    expect(second, origin="split", nranks=ranks // 2, rank=r // 2, cuda_device=0)
    for split in (first, second):
        expect(split["split"], parent=world["order"])
    expect(live["summary"], world=world["order"], world_size=ranks, global_rank=r)
    return world["unique_id_hash"], first["split"]["color"], second["split"]["color"]


def main():
    libucp = sys.argv[1]
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    if ranks < 2 or ranks % 2:
        sys.exit("RANKS must be even and at least 2")
    if reason := why_skipped():
        print(f"skipped: {reason}")
        return SKIP
    with tempfile.TemporaryDirectory() as plain_dir:
        plain = run(ranks, {"CHECK_SAVE_DIR": plain_dir})
    for r, (status, out, err) in enumerate(plain):
        if status != 0:
            raise AssertionError(f"rank {r} exited {status} without the preload:\n{err[-3000:]}")
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "topology.%r.json")
        save_dir = os.path.join(tmp, "ckpt")
        preloaded = run(ranks, {"LD_PRELOAD": libucp, "UCP_DUMP_TOPOLOGY": dump,
                                "CHECK_SAVE_DIR": save_dir})
        lives = []
        for r in range(ranks):
            if plain[r][:2] != preloaded[r][:2]:
                raise AssertionError(f"rank {r} differs under the preload:\nplain:     "
                                     f"{plain[r]}\npreloaded: {preloaded[r]}")
            print(plain[r][1], end="")
            with open(dump.replace("%r", str(r)) + ".live") as f:
                lives.append(json.load(f))
        journal = os.path.join(save_dir, "global_step1", ".ucp")
        records = []
        for name in sorted(os.listdir(journal)):
            if name.startswith("journal"):
                with open(os.path.join(journal, name)) as f:
                    records += [json.loads(line) for line in f]
    print(json.dumps(lives[ranks - 1], indent=1))
    seen = [check_rank(r, ranks, live) for r, live in enumerate(lives)]
    if len({ids for ids, _, _ in seen}) != 1 or seen[0][0] is None:
        raise AssertionError(f"the world's unique id differs between ranks: {seen}")
    for axis, group_of in ((1, lambda r: r // 2), (2, lambda r: r % 2)):
        colors = {}
        for r, entry in enumerate(seen):
            colors.setdefault(group_of(r), set()).add(entry[axis])
        if any(len(c) != 1 for c in colors.values()) or \
                len(set.union(*colors.values())) != len(colors):
            raise AssertionError(f"split colors do not follow the groups: {colors}")
    # Launched by hand (no Slurm, PMIx or torchelastic id): the run's job is its NCCL world's id.
    data = [rec for rec in records if rec.get("role") == "data"]
    jobs = {rec.get("job") for rec in data}
    if len(data) != ranks + 1 or jobs != {"nccl=" + seen[0][0]}:
        raise AssertionError(f"journal records {data}: expected {ranks + 1} data records, each "
                             f"with job nccl={seen[0][0]}")
    print(f"{ranks} ranks: the world, its pairs and parities recorded on every rank; the save's "
          f"{len(data)} journal records name the run {jobs.pop()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

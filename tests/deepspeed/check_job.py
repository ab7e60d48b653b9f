"""`ucp reshard --job` and `ucp export --job`: one process of many under a launcher.

  check_job.py UCP FIXTURES WORKDIR

Processes are started as a launcher starts them (RANK and WORLD_SIZE in their environment, all
at once, in reverse rank order). What the job commits must be byte for byte what one process
writes: z1_fp32 dp4 -> dp2 in 3 parts and in 5 (more parts than files), in 3 with every file
divided as parts (--job-part-kb 32), DeepSpeed-universal and
sharded safetensors exports in 4 and 2 parts. Process 0 commits only once every other part has
finished: alone, with --job-wait 1, it fails naming the part it waited for, and leaves nothing; a
part run before process 0 (a rerun after a crash) is found and used, its parts of divided files
too. --job needs the launcher's
variables.
"""

import os
import subprocess
import sys

import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_job")
harness.fresh_dir(work)
TAG = f"{fixtures}/z1_fp32/dp4/global_step5"


def start(args, rank, parts, extra_env=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")}
    env.update({"RANK": str(rank), "WORLD_SIZE": str(parts)}, **(extra_env or {}))
    return subprocess.Popen([ucp, *args, "--job"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def job(args, parts, ranks=None):
    """Runs the given ranks (all by default) at once; returns {rank: (status, stdout, stderr)}."""
    procs = {r: start(args, r, parts) for r in reversed(ranks or range(parts))}
    return {r: (p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for r, p in procs.items()}


def same_tree(expected, actual, what):
    names = harness.files_under(expected)
    if not report.check(harness.files_under(actual) == names,
                        f"{what}: files {harness.files_under(actual)} vs {names}"):
        return
    for name in names:
        report.check(harness.read_bytes(f"{expected}/{name}") == harness.read_bytes(f"{actual}/{name}"),
                     f"{what}: {name} differs from the single process's")


def all_ok(results, what):
    for rank, (status, out, err) in sorted(results.items()):
        report.check(status == 0 and err == "", f"{what}: process {rank} exit {status}: {err}")
    status, out, _ = results[0]
    report.check("written by" in out, f"{what}: process 0 commits: {out!r}")


# Reshard in 3 and in 5 parts (parts 3 and 4 have no file to write).
single = harness.fresh_dir(f"{work}/single")
status, _, err = harness.run_ucp(ucp, "reshard", TAG, "--to", "dp=2", "--out", single)
report.check(status == 0, f"single-process reshard: exit {status}: {err}")
for parts in (3, 5):
    out = f"{work}/reshard_{parts}"
    results = job(["reshard", TAG, "--to", "dp=2", "--out", out], parts)
    all_ok(results, f"reshard in {parts} parts")
    same_tree(single, out, f"reshard in {parts} parts")
    report.check(not harness.temp_leftovers(out), f"reshard in {parts} parts: temporaries left")
    written = [int(results[r][1].split(": ", 2)[2].split(" of ")[0]) for r in range(1, parts)]
    report.check(sum(written) <= 3 and all(w <= 1 for w in written),
                 f"reshard in {parts} parts: the others wrote {written} of 3 files")

# Files divided as parts (--job-part-kb 32: the 0.26 MB model states, one storage, and each dp2
# optimizer file): the single process's bytes, every part written by the process given it.
out = f"{work}/reshard_divided"
results = job(["reshard", TAG, "--to", "dp=2", "--out", out, "--job-part-kb", "32"], 3)
all_ok(results, "reshard divided in parts")
same_tree(single, out, "reshard divided in parts")
report.check(not harness.temp_leftovers(out), "reshard divided in parts: temporaries left")
report.check(not any(name.endswith(".parts") for name in os.listdir(f"{out}/global_step5")),
             f"reshard divided in parts: a parts' file left: {os.listdir(f'{out}/global_step5')}")
report.check(all("parts of divided files" in results[r][1] for r in (1, 2)),
             f"reshard divided in parts: {[results[r][1] for r in (1, 2)]}")

# Exports: DeepSpeed-universal (every parameter's states, many small files) and safetensors
# shards (sizes known only once written).
for what, args, parts in (
        ("universal", ["--format", "deepspeed-universal"], 4),
        ("safetensors", ["--format", "safetensors", "--max-shard-size", "100000"], 2)):
    base = harness.fresh_dir(f"{work}/export_{what}")
    status, _, err = harness.run_ucp(ucp, "export", TAG, *args, "--out", f"{base}/single")
    report.check(status == 0, f"single-process {what} export: exit {status}: {err}")
    results = job(["export", TAG, *args, "--out", f"{base}/job"], parts)
    all_ok(results, f"{what} export in {parts} parts")
    same_tree(f"{base}/single", f"{base}/job", f"{what} export in {parts} parts")
    report.check(not harness.temp_leftovers(base), f"{what} export: temporaries left")
    if what == "universal":
        report.check(harness.read_bytes(f"{base}/latest_universal") == b"job",
                     "universal export: latest_universal names the job's folder")

# Process 0 alone: it waits for part 1's file, then fails naming it, and leaves nothing.
out = f"{work}/alone"
results = job(["reshard", TAG, "--to", "dp=2", "--out", out, "--job-wait", "1"], 2, ranks=[0])
status, _, err = results[0]
report.check(status == 1 and "part 1 did not finish its share within 1 s" in err,
             f"process 0 alone: exit {status}: {err}")
report.check(not os.path.exists(out) or not os.listdir(out),
             f"process 0 alone: left {os.listdir(out) if os.path.exists(out) else None}")

# Part 1 first (its process then gone, as after a crash), process 0 later: its file, or its
# parts of divided files (their CRC-32s from its marker), are used.
for divide in ([], ["--job-part-kb", "32"]):
    what = "process 0 after part 1" + (" (divided files)" if divide else "")
    out = f"{work}/rerun{len(divide)}"
    results = job(["reshard", TAG, "--to", "dp=2", "--out", out, *divide], 2, ranks=[1])
    report.check(results[1][0] == 0 and "process 0 commits" in results[1][1],
                 f"{what}: part 1 alone: {results[1]}")
    results = job(["reshard", TAG, "--to", "dp=2", "--out", out, "--job-wait", "5", *divide], 2,
                  ranks=[0])
    report.check(results[0][0] == 0, f"{what}: {results[0]}")
    same_tree(single, out, what)

# No launcher variables, or no rank: a usage error.
env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
for extra, words in (({}, "no launcher variables"), ({"WORLD_SIZE": "2"}, "gives no rank")):
    proc = subprocess.run([ucp, "reshard", TAG, "--to", "dp=2", "--out", f"{work}/usage", "--job"],
                          env={**env, **extra}, capture_output=True, text=True)
    report.check(proc.returncode == 2 and words in proc.stderr,
                 f"--job with {extra}: exit {proc.returncode}: {proc.stderr}")
report.exit()

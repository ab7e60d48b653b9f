#!/usr/bin/env python3
"""SIGKILL crash-consistency test: a 4-rank save under the preload, killed at random moments.

Usage: crash_test.py --lib LIBUCP --cli UCP [--trials N] [--seed S] [--durable 0|1]
                     [--kill-max SECONDS] [--slow-rank-ms MS] [--report-only] [--keep DIR]
  --trials, --seed default to $UCP_CRASH_TRIALS (50) and $UCP_CRASH_SEED (random, printed).

Each trial starts the four ranks of crash_rank.py under LD_PRELOAD (UCP_DURABLE as --durable) in
one process group: they resume from <save>/latest and save tag after tag (a real DeepSpeed
ZeRO-2 dp4 tag's bytes, DeepSpeed's order of writes). After a random delay in [0, --kill-max] s
the whole group gets SIGKILL. Then `latest`, when it exists, must name a tag that
  - holds every file of the save, byte for byte the payload's;
  - `ucp verify` passes (after `ucp index` when the kill left it unindexed);
  - resumes: torch.load of each of its files, and the next trial's ranks resume from it.
Every trial's outcome is printed in one summary line; exit 1 when any `latest` named a tag that
fails (unless --report-only, for the run without UCP_DURABLE that shows the failure exists).
"""
import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PAYLOAD = os.path.join(os.environ.get("UCP_SHARED_DIR", os.path.join(REPO, "..", "shared")),
                       "fixtures", "deepspeed", "z2_fp32", "dp4", "global_step5")
WORLD = 4
FILES = ["mp_rank_00_model_states.pt"] + [
    f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD)]


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lib", required=True)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--payload", default=PAYLOAD)
    parser.add_argument("--trials", type=int, default=int(os.environ.get("UCP_CRASH_TRIALS", 50)))
    parser.add_argument("--seed", type=int, default=int(os.environ.get(
        "UCP_CRASH_SEED", random.SystemRandom().randrange(1 << 31))))
    parser.add_argument("--durable", default="1", choices=["0", "1"])
    parser.add_argument("--kill-max", type=float, default=1.5)
    parser.add_argument("--slow-rank-ms", type=float, default=3.0)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--keep", help="save directory to use and keep (default: a temporary one)")
    return parser.parse_args()


def run_ranks(args, save_dir, sync_dir, delay, log_dir):
    """Starts the ranks, kills their process group after `delay` s; returns rank 0's output."""
    first = os.environ.get("PRELOAD_FIRST")  # a sanitizer runtime, in sanitizer builds
    env = dict(os.environ, LD_PRELOAD=f"{first} {args.lib}" if first else args.lib,
               UCP_DURABLE=args.durable, WORLD_SIZE=str(WORLD),
               CRASH_SLOW_RANK_MS=str(args.slow_rank_ms))
    if log_dir:
        env.update(UCP_LOG_DIR=log_dir, UCP_LOG_LEVEL="info")
    procs = []
    for rank in range(WORLD):
        group = procs[0].pid if procs else 0
        procs.append(subprocess.Popen(
            [args.python, os.path.join(HERE, "crash_rank.py"), save_dir, args.payload, sync_dir],
            env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE if rank == 0 else None,
            preexec_fn=lambda group=group: os.setpgid(0, group)))
    time.sleep(delay)
    os.killpg(procs[0].pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()
    out = procs[0].stdout.read().decode()
    procs[0].stdout.close()
    return out


def check_tag(args, save_dir, tag, payload, torch):
    """'' when the tag named by `latest` is complete, verified and loads; else what is wrong."""
    tag_dir = os.path.join(save_dir, tag)
    for name in FILES:
        path = os.path.join(tag_dir, name)
        if not os.path.exists(path):
            return f"{name} missing"
        with open(path, "rb") as f:
            if f.read() != payload[name]:
                return f"{name} differs from the save's bytes (size {os.path.getsize(path)})"
    if not os.path.exists(os.path.join(tag_dir, ".ucp", "index.json")):
        index = subprocess.run([args.cli, "index", tag_dir], capture_output=True, text=True)
        if index.returncode != 0:
            return f"ucp index: {index.stderr.strip()}"
    verify = subprocess.run([args.cli, "verify", tag_dir], capture_output=True, text=True)
    if verify.returncode != 0:
        return f"ucp verify: {verify.stdout.strip()} {verify.stderr.strip()}"
    for name in FILES:
        try:
            torch.load(os.path.join(tag_dir, name), map_location="cpu")
        except Exception as error:  # noqa: BLE001 (any failure to load is the finding)
            return f"torch.load {name}: {error}"
    return ""


def main():
    args = arguments()
    sys.path.insert(0, os.path.join(REPO, "demo"))
    import torch
    import zero_trainer  # noqa: F401 (registers DeepSpeed's pickled classes for torch.load)

    payload = {}
    for name in FILES:
        with open(os.path.join(args.payload, name), "rb") as f:
            payload[name] = f.read()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="ucp_crash.")
    save_dir = args.keep or os.path.join(work, "save")
    os.makedirs(save_dir, exist_ok=True)
    log_dir = os.environ.get("UCP_CRASH_LOG_DIR")
    print(f"crash test: {args.trials} trials, seed {args.seed}, UCP_DURABLE={args.durable}, "
          f"kill within {args.kill_max} s, slow ranks {args.slow_rank_ms} ms/64 KiB, {save_dir}",
          flush=True)
    outcomes = {"complete": 0, "no latest yet": 0, "INCOMPLETE": 0}
    resumed_wrong = 0
    expected_resume = 0
    saves = 0
    started = time.monotonic()
    for trial in range(args.trials):
        sync_dir = os.path.join(work, f"sync{trial}")
        os.makedirs(sync_dir)
        out = run_ranks(args, save_dir, sync_dir, rng.uniform(0, args.kill_max), log_dir)
        shutil.rmtree(sync_dir)
        if out.startswith("RESUMED ") and int(out.split()[1]) != expected_resume:
            resumed_wrong += 1
            print(f"trial {trial}: resumed from step {out.split()[1]}, latest named "
                  f"{expected_resume}", flush=True)
        latest = os.path.join(save_dir, "latest")
        if not os.path.exists(latest):
            outcomes["no latest yet"] += 1
            continue
        with open(latest) as f:
            tag = f.read().strip()
        named = re.fullmatch(r"global_step([0-9]+)", tag)
        problem = check_tag(args, save_dir, tag, payload, torch) if named else "not a tag name"
        if problem:
            outcomes["INCOMPLETE"] += 1
            print(f"trial {trial}: latest names {tag!r}: {problem}", flush=True)
            # Without UCP_DURABLE (--report-only) the job could not resume: start afresh.
            shutil.rmtree(save_dir)
            os.makedirs(save_dir)
            expected_resume = 0
            continue
        outcomes["complete"] += 1
        expected_resume = int(named.group(1))
        # Keep the save directory small: only the tag `latest` names and the tags after it.
        for entry in os.listdir(save_dir):
            if entry.startswith("global_step") and int(entry[len("global_step"):]) < \
                    expected_resume:
                shutil.rmtree(os.path.join(save_dir, entry))
                saves += 1
    pending = [e for e in os.listdir(save_dir) if ".ucp-pending-" in e]
    elapsed = time.monotonic() - started
    print(f"crash test: UCP_DURABLE={args.durable} seed {args.seed}: {args.trials} trials in "
          f"{elapsed:.1f} s: " + ", ".join(f"{k} {v}" for k, v in outcomes.items()) +
          f"; resumed from another tag than latest: {resumed_wrong}; reached step "
          f"{expected_resume}; pending files left by kills: {len(pending)}", flush=True)
    if not args.keep:
        shutil.rmtree(work)
    if args.report_only:
        return 0
    return 1 if outcomes["INCOMPLETE"] or resumed_wrong else 0


if __name__ == "__main__":
    sys.exit(main())

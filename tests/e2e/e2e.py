#!/usr/bin/env python3
"""End-to-end tests of the preload with demo/zero_trainer.py (plain PyTorch ZeRO-2 in DeepSpeed
v0.14.5's checkpoint layout), multi-process on CPU with gloo on 127.0.0.1.

Usage: e2e.py UCP_CLI LIBUCP WORK CASE [ARGS]
  save                 4 ranks under the preload train steps 1..10 and save at step 5:
                       WORK/ckpt (the checkpoint, indexed at save by the preload) and
                       WORK/full_dp4.json (the losses every resume is held to). The other cases
                       need it (CTest fixture).
  resume N             resume WORK/ckpt at N ranks under the preload: training continues to
                       step 10 with the uninterrupted losses (float32 reduction-order noise), and
                       each rank's optimizer state right after loading equals, bit for bit, what
                       a plain load of `ucp reshard --to dp=N` gives.
  reshard N            offline: `ucp reshard --to dp=N`, a plain load at N ranks, losses as above.
  refusal N            the same resume without the preload fails with DeepSpeed's refusal.
  kill POINT           4 ranks under the preload save at steps 3 and 6, SIGKILLed when POINT is
                       reached in the second save (`model_states`: its first file exists;
                       `latest`: `latest` names it, the index build has just started; `index`:
                       its index is committed, training goes on). The
                       previous tag resumes at 2 ranks under the preload with the uninterrupted
                       losses; the interrupted tag is either served (and then resumes exactly
                       like the reshard of it) or listed exactly as written (not served).
  atoms                UCP_MODE=atoms: 4 ranks under the preload save at step 5 (WORK/atoms, its
                       own checkpoint); the index records a complete atoms store. Then the
                       framework's .pt files are deleted, and resumes at 2 and at 4 ranks under
                       the preload, served from the store alone, continue with the
                       uninterrupted losses and load, bit for bit, the state a plain load of
                       `ucp reshard` of the tag as saved gives; `ucp verify` passes on the store,
                       and fails naming the file once a byte of it is flipped.
  layout FIXTURES      the trainer's checkpoints against real DeepSpeed's (FIXTURES = the
                       fixtures/deepspeed folder: z2_fp32 at 4 and 2 ranks, z2_fp32_odd at 4, all
                       saved at step 5 by DeepSpeed v0.14.5 with this model and configuration): the
                       same files, keys, types, pickled classes, dtypes, shapes, strides and storage
                       sharing (tests/deepspeed/ds_objects.compare); values may differ by
                       DeepSpeed's reduction order, their differences are printed.
Each case prints its measured figures. Exit status 0: passed.
PRELOAD_FIRST (environment): what must precede LIBUCP in LD_PRELOAD (libtsan in TSan builds).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "..", "..", "demo")
PY = sys.executable
PRELOAD_FIRST = os.environ.get("PRELOAD_FIRST", "")
STEPS = 10
SAVE_STEP = 5
# Losses of a resume at another data-parallel size differ from the uninterrupted run only by the
# order of float32 reductions (DeepSpeed's own dp4 and dp2 runs differ by 4.8e-7 on this model).
LOSS_TOLERANCE = 1e-5
KILL_POINTS = ["model_states", "latest", "index"]
PORTS = {"layout": 29870, "save": 29800, "resume": 29810, "reshard": 29830, "refusal": 29850,
         "kill": 29900, "atoms": 29960}


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


# What the C++ runtime prints when a std::thread is destroyed while joinable. Seen once in a
# clean-clone CI run (e2e_save: the 4-rank save under the preload trained all 10 steps, wrote its
# losses, then aborted at exit), as in tests/e2e_deepspeed/ds_e2e.py's TEARDOWN_ABORT: the
# trainers never call destroy_process_group, and gloo's worker threads meet the interpreter's
# finalization. ucp's thread-owning objects are never destroyed.
TEARDOWN_ABORT = "terminate called without an active exception"


def launch(nproc, port, args, log, preload=None, extra_env=None, wait=True):
    """Runs zero_trainer.py at `nproc` ranks with `args`, its output in `log`; returns its exit
    status, or with wait=False the launcher's process. A run that trained through its last step
    and then aborted at exit (TEARDOWN_ABORT) runs once more, saying so, its --save_dir removed
    first so that it saves afresh; any other failure is the caller's to judge."""
    if not wait:
        return start_launcher(nproc, port, args, log, preload, extra_env)
    rc = start_launcher(nproc, port, args, log, preload, extra_env).wait()
    last_step = str(args[args.index("--steps") + 1]) if "--steps" in args else None
    if rc != 0 and last_step is not None:
        output = open(log, errors="replace").read()
        if TEARDOWN_ABORT in output and f"STEP {last_step} loss" in output:
            print(f"{os.path.basename(log)}: the run trained through step {last_step}, then "
                  f"aborted at exit (\"{TEARDOWN_ABORT}\"); running it again", flush=True)
            if "--save_dir" in args:
                shutil.rmtree(str(args[args.index("--save_dir") + 1]), ignore_errors=True)
            rc = start_launcher(nproc, port, args, log, preload, extra_env).wait()
    return rc


def start_launcher(nproc, port, args, log, preload, extra_env):
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [PRELOAD_FIRST, preload]))
        env.setdefault("UCP_LOG_DIR", os.path.join(os.path.dirname(log), "ucp-logs"))
        os.makedirs(env["UCP_LOG_DIR"], exist_ok=True)
    env.update(extra_env or {})
    command = [PY, os.path.join(DEMO, "launch.py"), str(nproc), str(port),
               os.path.join(DEMO, "zero_trainer.py")] + [str(a) for a in args]
    with open(log, "w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def tail(path, lines=40):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def ucp_log_tail(work, lines=40):
    """The last lines of the ucp logs that launch() under the preload wrote in work/ucp-logs."""
    directory = os.path.join(work, "ucp-logs")
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        with open(os.path.join(directory, name), errors="replace") as f:
            out += [f"{name}: {line}" for line in f]
    return "".join(out[-lines:])


def losses(path):
    with open(path) as f:
        return {int(k): v for k, v in json.load(f)["losses"].items()}


def compare_losses(got, reference, what):
    check(got, f"{what}: no losses")
    delta = max(abs(got[s] - reference[s]) for s in got)
    print(f"{what}: steps {min(got)}..{max(got)}, max |loss - uninterrupted| = {delta:.3e}")
    check(delta <= LOSS_TOLERANCE,
          f"{what}: losses differ from the uninterrupted run by {delta:.3e}")


def bits(t):
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(view) if t.is_floating_point() else t


def compare_dumps(pattern_a, pattern_b, nproc, what):
    for rank in range(nproc):
        a, b = torch.load(pattern_a.format(rank=rank)), torch.load(pattern_b.format(rank=rank))
        check(a.keys() == b.keys(), f"{what}: rank {rank}: dumps hold {sorted(a)} vs {sorted(b)}")
        for key in a:
            x, y = a[key], b[key]
            if isinstance(x, torch.Tensor):
                same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
            else:
                same = x == y
            check(same, f"{what}: rank {rank}: {key} differs")
    print(f"{what}: optimizer state of all {nproc} ranks bit-identical (fp32 partition, exp_avg, "
          f"exp_avg_sq, step, flat parameters)")


def ucp(cli, *args):
    result = subprocess.run([cli] + list(args), capture_output=True, text=True)
    check(result.returncode == 0, f"ucp {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def reshard_and_load(cli, work, tag_dir, nproc, name, port, steps):
    """`ucp reshard` of tag_dir at nproc ranks, then a plain load (no preload) that dumps the
    state and trains to `steps`. Returns (dump pattern, losses)."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    ucp(cli, "reshard", tag_dir, "--to", f"dp={nproc}", "--out", out)
    dump = os.path.join(work, name + "_state{rank}.pt")
    tag = os.path.basename(tag_dir.rstrip("/"))
    rc = launch(nproc, port, ["--steps", steps, "--load_dir", out, "--load_tag", tag,
                              "--dump_state", dump, "--out", out + ".json"], out + ".log")
    check(rc == 0, f"plain load of the reshard at {nproc} ranks failed (rc {rc}, see {out}.log)")
    return dump, losses(out + ".json")


def case_save(cli, lib, work):
    # Only this case's outputs: the cases that do not need its checkpoint (atoms, layout) may be
    # writing beside them under `ctest -j`.
    os.makedirs(work, exist_ok=True)
    shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)
    for name in ("full_dp4.json", "save.log"):
        if os.path.exists(os.path.join(work, name)):
            os.remove(os.path.join(work, name))
    rc = launch(4, PORTS["save"],
                ["--steps", STEPS, "--save_dir", os.path.join(work, "ckpt"), "--save_at", SAVE_STEP,
                 "--out", os.path.join(work, "full_dp4.json")],
                os.path.join(work, "save.log"), preload=lib)
    check(rc == 0, f"the 4-rank run under the preload failed (rc {rc})")
    tag = os.path.join(work, "ckpt", f"global_step{SAVE_STEP}")
    names = sorted(n for n in os.listdir(tag) if not n.startswith("."))
    expected = ["mp_rank_00_model_states.pt"]
    expected += [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]
    check(names == expected, f"{tag} holds {names}")
    with open(os.path.join(work, "ckpt", "latest")) as f:
        check(f.read() == f"global_step{SAVE_STEP}", "latest does not name the tag")
    # The preload indexes the tag behind the scenes once `latest` names it (before the job exits).
    check(os.path.isfile(os.path.join(tag, ".ucp", "index.json")),
          f"the preload built no index of {tag}")
    print(f"saved {tag} at 4 ranks under the preload: {names}, indexed at save")


def case_resume(cli, lib, work, nproc):
    reference = losses(os.path.join(work, "full_dp4.json"))
    tag_dir = os.path.join(work, "ckpt", f"global_step{SAVE_STEP}")
    name = f"resume_dp{nproc}"
    dump = os.path.join(work, name + "_state{rank}.pt")
    rc = launch(nproc, PORTS["resume"] + nproc,
                ["--steps", STEPS, "--load_dir", os.path.join(work, "ckpt"), "--dump_state", dump,
                 "--out", os.path.join(work, name + ".json")],
                os.path.join(work, name + ".log"), preload=lib)
    check(rc == 0,
          f"resume at {nproc} ranks under the preload failed (rc {rc}, see {work}/{name}.log)")
    compare_losses(losses(os.path.join(work, name + ".json")), reference,
                   f"resume at {nproc} ranks under ucp")
    offline_dump, _ = reshard_and_load(cli, work, tag_dir, nproc, f"reshard_for_resume_dp{nproc}",
                                       PORTS["resume"] + 10 + nproc, SAVE_STEP)
    compare_dumps(dump, offline_dump, nproc,
                  f"resume at {nproc} ranks under ucp vs ucp reshard + plain load")


def case_reshard(cli, lib, work, nproc):
    reference = losses(os.path.join(work, "full_dp4.json"))
    tag_dir = os.path.join(work, "ckpt", f"global_step{SAVE_STEP}")
    _, got = reshard_and_load(cli, work, tag_dir, nproc, f"reshard_dp{nproc}",
                              PORTS["reshard"] + nproc, STEPS)
    compare_losses(got, reference, f"ucp reshard to {nproc} ranks + plain load")


def case_refusal(cli, lib, work, nproc):
    log = os.path.join(work, f"refusal_dp{nproc}.log")
    rc = launch(nproc, PORTS["refusal"] + nproc,
                ["--steps", STEPS, "--load_dir", os.path.join(work, "ckpt")], log)
    text = open(log).read()
    # Every rank prints the traceback into the one log, so the pieces Python writes apart (the
    # exception's module, its class, ": ", the message) can interleave: each is looked for whole.
    exception = "ZeRORuntimeException"
    message = ("The checkpoint being loaded used a DP world size of 4 but the current world size "
               f"is {nproc}.")
    check(rc != 0, f"the resume at {nproc} ranks without the preload did not fail")
    check(exception in text and message in text,
          f"the resume without the preload failed otherwise than with the refusal (see {log})")
    print(f"without the preload at {nproc} ranks: {exception}: {message}")


def listing(tag_dir, lib, nproc):
    env = dict(os.environ, WORLD_SIZE=str(nproc), RANK="0", LOCAL_RANK="0")
    env.pop("LD_PRELOAD", None)
    if lib:
        env["LD_PRELOAD"] = " ".join(filter(None, [PRELOAD_FIRST, lib]))
    result = subprocess.run([PY, "-c", f"import os; print(sorted(os.listdir({tag_dir!r})))"],
                            env=env, capture_output=True, text=True)
    check(result.returncode == 0, f"listing {tag_dir} failed: {result.stderr}")
    return [n for n in eval(result.stdout) if not n.startswith(".")]  # noqa: S307 (our own repr)


def case_kill(cli, lib, work, point):
    reference = losses(os.path.join(work, "full_dp4.json"))
    kwork = os.path.join(work, f"kill_{point}")
    shutil.rmtree(kwork, ignore_errors=True)
    os.makedirs(kwork)
    ckpt = os.path.join(kwork, "ckpt")
    tag_dir = os.path.join(ckpt, "global_step6")
    port = PORTS["kill"] + 10 * KILL_POINTS.index(point)
    # Steps beyond 6 only keep the job alive until the kill.
    proc = launch(4, port,
                  ["--steps", 60, "--save_dir", ckpt, "--save_at", 3, 6],
                  os.path.join(kwork, "save.log"), preload=lib, wait=False)
    # The premise is a previous tag saved and indexed whole: the kill waits for global_step3's
    # index too, which the job builds in the background and which, on a loaded machine, can land
    # after the second save has begun (a tag without an index is served as written).
    previous_index = os.path.join(ckpt, "global_step3", ".ucp", "index.json")
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:
        if not os.path.exists(previous_index):
            reached = False
        elif point == "model_states":
            reached = os.path.exists(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
        elif point == "index":
            reached = os.path.exists(os.path.join(tag_dir, ".ucp", "index.json"))
        else:
            try:
                with open(os.path.join(ckpt, "latest")) as f:
                    reached = f.read() == "global_step6"
            except FileNotFoundError:
                reached = False
        if reached:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.wait()
    check(proc.returncode == -signal.SIGKILL,
          f"the saving job was not killed at '{point}' (rc {proc.returncode})")
    written = []
    if os.path.isdir(tag_dir):
        written = sorted(n for n in os.listdir(tag_dir) if not n.startswith("."))
    print(f"killed at '{point}': global_step6 holds {written}")

    name = os.path.join(kwork, "resume_previous")
    rc = launch(2, port + 1, ["--steps", 8, "--load_dir", ckpt, "--load_tag", "global_step3",
                              "--out", name + ".json"], name + ".log", preload=lib)
    check(rc == 0, f"the previous tag did not resume at 2 ranks under the preload (rc {rc}):\n"
          f"{tail(name + '.log')}\nucp logs:\n{ucp_log_tail(kwork)}")
    compare_losses(losses(name + ".json"), reference,
                   "previous tag global_step3 resumed at 2 ranks under ucp")

    if not written:
        print("the interrupted tag has no files: nothing to serve")
        return
    served = listing(tag_dir, lib, 2)
    if served == written:
        print(f"the interrupted tag is not served: listed at 2 ranks as written ({served})")
        return
    print(f"the interrupted tag is served at 2 ranks: {served}")
    dump = os.path.join(kwork, "served_state{rank}.pt")
    rc = launch(2, port + 2, ["--steps", 6, "--load_dir", ckpt, "--load_tag", "global_step6",
                              "--dump_state", dump], os.path.join(kwork, "served.log"), preload=lib)
    check(rc == 0, f"the served interrupted tag did not load (see {kwork}/served.log)")
    offline, _ = reshard_and_load(cli, kwork, tag_dir, 2, "reshard", port + 3, 6)
    compare_dumps(dump, offline, 2, "served interrupted tag vs ucp reshard + plain load")


def case_atoms(cli, lib, work):
    awork = os.path.join(work, "atoms")
    shutil.rmtree(awork, ignore_errors=True)
    os.makedirs(awork)
    ckpt = os.path.join(awork, "ckpt")
    full = os.path.join(awork, "full_dp4.json")
    rc = launch(4, PORTS["atoms"],
                ["--steps", STEPS, "--save_dir", ckpt, "--save_at", SAVE_STEP, "--out", full],
                os.path.join(awork, "save.log"), preload=lib, extra_env={"UCP_MODE": "atoms"})
    check(rc == 0, f"the 4-rank run with UCP_MODE=atoms failed (rc {rc})")
    tag_dir = os.path.join(ckpt, f"global_step{SAVE_STEP}")
    with open(os.path.join(tag_dir, ".ucp", "index.json")) as f:
        index = json.load(f)
    check(index["version"] == 3 and "store" in index,
          "the index records no atoms store (see the ucp logs)")
    check(all("chunks" in f for f in index["files"]),
          "a file of the index has no chunk hashes (the journal's, and the store's markers')")
    stored = sorted(os.path.relpath(os.path.join(d, n), os.path.join(tag_dir, ".ucp", "atoms"))
                    for d, _, names in os.walk(os.path.join(tag_dir, ".ucp", "atoms"))
                    for n in names)
    print(f"atoms store of {tag_dir}: {stored}")
    reference = losses(full)
    offline = {n: reshard_and_load(cli, awork, tag_dir, n, f"reshard_dp{n}", PORTS["atoms"] + n,
                                   SAVE_STEP)[0] for n in (2, 4)}

    framework = sorted(n for n in os.listdir(tag_dir) if n.endswith(".pt"))
    for name in framework:
        os.remove(os.path.join(tag_dir, name))
    print(f"deleted the framework's files: {framework}")
    for n in (2, 4):
        name = os.path.join(awork, f"resume_dp{n}")
        dump = name + "_state{rank}.pt"
        rc = launch(n, PORTS["atoms"] + 10 + n,
                    ["--steps", STEPS, "--load_dir", ckpt, "--dump_state", dump,
                     "--out", name + ".json"], name + ".log", preload=lib)
        check(rc == 0, f"resume at {n} ranks from the atoms store failed (see {name}.log)")
        compare_losses(losses(name + ".json"), reference,
                       f"resume at {n} ranks from the atoms store alone")
        compare_dumps(dump, offline[n], n,
                      f"resume at {n} ranks from the atoms store vs ucp reshard of the tag as saved")
    out = ucp(cli, "verify", tag_dir)
    check(f"{len(framework)} removed, served from the atoms store" in out, f"ucp verify: {out}")
    print(f"ucp verify: {out.splitlines()[-1]}")
    out = ucp(cli, "inspect", tag_dir)
    check("read from its atoms store" in out.splitlines()[1], f"ucp inspect: {out}")
    damaged = os.path.join(tag_dir, ".ucp", "atoms", "fp32", "model.safetensors")
    with open(damaged, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    result = subprocess.run([cli, "verify", tag_dir], capture_output=True, text=True)
    check(result.returncode == 3 and ".ucp/atoms/fp32/model.safetensors: xxh3" in result.stdout,
          f"ucp verify of a damaged store: rc {result.returncode}: {result.stdout}{result.stderr}")
    print("ucp verify of the store with one byte flipped: names .ucp/atoms/fp32/model.safetensors")


def case_layout(cli, lib, work, fixtures):
    sys.path.insert(0, os.path.join(HERE, "..", "deepspeed"))
    import ds_objects  # DeepSpeed's pickled classes as stand-ins; imports no DeepSpeed

    runs = [("z2_fp32", 4, []), ("z2_fp32", 2, []), ("z2_fp32_odd", 4, ["--d", 30, "--nhead", 3])]
    for index, (config, nproc, model_args) in enumerate(runs):
        ours = os.path.join(work, f"layout_{config}_dp{nproc}")
        shutil.rmtree(ours, ignore_errors=True)
        rc = launch(nproc, PORTS["layout"] + index,
                    ["--steps", SAVE_STEP, "--save_dir", ours, "--save_at", SAVE_STEP] + model_args,
                    ours + ".log")
        check(rc == 0, f"the {nproc}-rank run for {config} failed (see {ours}.log)")
        theirs = os.path.join(fixtures, config, f"dp{nproc}")
        for sub in ("latest", f"global_step{SAVE_STEP}"):
            if sub == "latest":
                with open(os.path.join(ours, sub)) as a, open(os.path.join(theirs, sub)) as b:
                    check(a.read() == b.read(), f"{config} dp{nproc}: latest differs")
                continue
            names = sorted(os.listdir(os.path.join(ours, sub)))
            check(names == sorted(os.listdir(os.path.join(theirs, sub))),
                  f"{config} dp{nproc}: files {names}")
            values = 0
            for name in names:
                diffs = ds_objects.compare(ds_objects.load(os.path.join(ours, sub, name)),
                                           ds_objects.load(os.path.join(theirs, sub, name)))
                structure = [d for d in diffs if not d.endswith("elements differ")]
                check(not structure, f"{config} dp{nproc} {name}: {structure}")
                values += len(diffs)
            print(f"{config} at {nproc} ranks: {len(names)} files, structure identical to "
                  f"DeepSpeed's; {values} tensors with other values")


def main():
    # Absolute: ucp refuses relative paths in its variables (UCP_LOG_DIR).
    cli, lib, work = (os.path.abspath(a) for a in sys.argv[1:4])
    case, rest = sys.argv[4], sys.argv[5:]
    cases = {"save": case_save, "resume": case_resume, "reshard": case_reshard,
             "refusal": case_refusal, "kill": case_kill, "layout": case_layout, "atoms": case_atoms}
    try:
        arg = [int(rest[0]) if rest[0].isdigit() else rest[0]] if rest else []
        cases[case](cli, lib, work, *arg)
    except Failure as failure:
        print(f"FAILED: {failure}")
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared pieces of the DeepSpeed fixture checks: running ucp, walking trees, reporting."""

import os
import re
import shutil
import subprocess
import sys

import torch

import ds_objects

# Fields of the files a DeepSpeed run saves that describe the run which saved rather than the
# training state (RESAVED.txt finding 3): DeepSpeed's own resaves hold the resaving run's values,
# ucp carries the source's. The only allowed differences against DeepSpeed's resaved files, at
# these paths of model-state files and of optimizer files alike.
RUN_CONFIG_FIELDS = (
    "ds_config.train_micro_batch_size_per_gpu",
    "ds_config.checkpoint.load_universal",
)
# DeepSpeed's universal load fills the per-parameter Adam state in no fixed key order (its own
# dp4_from_dp4 control differs from the original save there); ucp keeps the source's order.
# (ZeRO-1/2: base_optimizer_state; ZeRO-3: the inner optimizer_state_dict.)
UNORDERED_IN_RESAVES = re.compile(
    r"^optimizer_state_dict\.(base_optimizer_state|optimizer_state_dict)\.state\.\d+$")

TEMP_PREFIX = ".ucp-tmp"


class Report:
    """Collects failures; exit() prints a summary and sets the exit status."""

    def __init__(self, name):
        self.name = name
        self.failures = []
        self.checks = 0

    def check(self, ok, what):
        self.checks += 1
        if not ok:
            self.failures.append(what)
            print(f"FAIL {what}", flush=True)
        return ok

    def diffs(self, diffs, what):
        self.checks += 1
        for diff in diffs[:20]:
            self.failures.append(f"{what}: {diff}")
            print(f"FAIL {what}: {diff}", flush=True)
        if len(diffs) > 20:
            print(f"FAIL {what}: ... {len(diffs) - 20} more", flush=True)
        return not diffs

    def exit(self):
        if self.failures:
            print(f"{self.name}: {len(self.failures)} failures in {self.checks} checks")
            sys.exit(1)
        print(f"{self.name}: {self.checks} checks passed")
        sys.exit(0)


def run_ucp(ucp, *args):
    """Runs ucp; returns (exit status, stdout, stderr)."""
    proc = subprocess.run([ucp, *map(str, args)], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def run_ucp_output(ucp, *args):
    """run_ucp with stdout and stderr together: (exit status, output)."""
    status, out, err = run_ucp(ucp, *args)
    return status, out + err


def reshard(report, ucp, tag_dir, to, save_dir, what):
    """`ucp reshard tag_dir --to <to> --out save_dir` into a fresh save_dir: checks that it exited
    0, that `latest` names the tag and that no temporaries are left; returns whether it exited 0."""
    fresh_dir(save_dir)
    status, _, err = run_ucp(ucp, "reshard", tag_dir, "--to", to, "--out", save_dir)
    ok = report.check(status == 0, f"{what}: ucp reshard exit {status}: {err}")
    if ok:
        tag = os.path.basename(os.path.normpath(tag_dir))
        report.check(read_bytes(f"{save_dir}/latest") == tag.encode(), f"{what}: latest")
        report.check(not temp_leftovers(save_dir), f"{what}: temporaries left")
    return ok


def fresh_dir(path):
    """An empty directory at path (removed first if present)."""
    if os.path.lexists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def copy_tag(source, destination):
    """A writable copy of a (read-only) fixture tag directory."""
    if os.path.lexists(destination):
        shutil.rmtree(destination)
    shutil.copytree(source, destination, copy_function=shutil.copyfile)
    os.chmod(destination, 0o755)
    return destination


def files_under(root):
    """Relative paths of the regular files under root, sorted."""
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


def temp_leftovers(root):
    """Entries under root whose name marks a ucp temporary."""
    leftovers = []
    for directory, dirs, names in os.walk(root):
        for name in dirs + names:
            if name.startswith(TEMP_PREFIX) or ".tmp" in name:
                leftovers.append(os.path.join(directory, name))
    return leftovers


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def get_path(obj, dotted):
    """The object at a compare() path ('ds_config.checkpoint.load_universal'), or KeyError."""
    for key in dotted.split("."):
        if isinstance(obj, dict):
            obj = obj[key]
        elif isinstance(obj, (list, tuple)):
            obj = obj[int(key)]
        else:
            raise KeyError(dotted)
    return obj


def compare_files(expected, actual, allowed=(), unordered=None):
    """compare() of two torch.save files loaded with the DeepSpeed stand-ins; a missing file is
    one difference."""
    for path in (expected, actual):
        if not os.path.exists(path):
            return [f"{path}: missing"]
    return ds_objects.compare(ds_objects.load(expected), ds_objects.load(actual), allowed=allowed,
                              unordered=unordered)


def compare_export(report, what, expected, out):
    """out holds expected's files (DeepSpeed's own export), every object and tensor identical;
    returns expected's file names."""
    names = files_under(expected)
    report.check(files_under(out) == names,
                 f"{what}: files {sorted(set(files_under(out)) ^ set(names))} differ")
    for name in names:
        report.diffs(compare_files(f"{expected}/{name}", f"{out}/{name}"), f"{what}/{name}")
    return names


def compare_resaved(report, case, save_dir, expected, tag, allowed=RUN_CONFIG_FIELDS):
    """save_dir (a `ucp reshard --out`) holds the files of `expected` (DeepSpeed's resave of
    `tag`) under save_dir/tag and `latest` naming it, object- and tensor-identical but for the
    new run's `allowed` fields and the state order DeepSpeed's universal load leaves."""
    report.check(read_bytes(f"{save_dir}/latest") == tag.encode(), f"{case}: latest")
    names = files_under(expected)
    report.check(files_under(save_dir) == sorted(["latest"] + [f"{tag}/{n}" for n in names]),
                 f"{case}: files {files_under(save_dir)} vs DeepSpeed's {names}")
    for name in names:
        report.diffs(compare_files(f"{expected}/{name}", f"{save_dir}/{tag}/{name}", allowed,
                                   UNORDERED_IN_RESAVES),
                     f"{case}/{name}")


def model_states_name(tag):
    """The file holding a tag's model states: mp_rank_00_model_states.pt (ZeRO-1/2) or rank 0's
    zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3)."""
    name = "mp_rank_00_model_states.pt"
    return name if os.path.exists(f"{tag}/{name}") else "zero_pp_rank_0_mp_rank_00_model_states.pt"


def zero3_padding_zeroed(optim, param_shapes, dp, rank):
    """A loaded ZeRO-3 optimizer file of DP rank `rank` with the padding elements of its flat
    partitions (fp32_flat_groups and every partition-sized state) set to zero: a training save
    holds uninitialised memory there (RESAVED.txt finding 1), which no resharder reproduces.
    DeepSpeed's rule: each parameter padded to a multiple of dp, ceil(numel/dp) per rank."""
    osd = optim["optimizer_state_dict"]
    for g, shapes in enumerate(param_shapes):
        flat = [osd["fp32_flat_groups"][g]]
        flat += [t for t in osd["optimizer_state_dict"]["state"][g].values()
                 if isinstance(t, torch.Tensor) and t.dim() == 1]
        start = 0
        for shape in shapes.values():
            numel = shape.numel()
            piece = -(-numel // dp)
            real = max(0, min(piece, numel - rank * piece))
            for tensor in flat:
                tensor.data[start + real:start + piece] = 0
            start += piece
    return optim

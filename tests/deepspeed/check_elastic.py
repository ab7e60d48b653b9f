"""Elastic checkpoints (zero_optimization.elastic_checkpoint) against DeepSpeed's resaves.

  check_elastic.py UCP FIXTURES WORKDIR

DeepSpeed 0.14.5's fixtures are rigid. An elastic copy of a tag is made with DeepSpeed's own rule
(DeepSpeedZeroOptimizer._get_base_optimizer_state): each rank's base_optimizer_state becomes the
list of its groups' states, partition-shaped tensors cut to P - group_paddings[g] elements (views
of the P-element storage), with no param_groups. For z1_fp32_odd and z2_fp32_odd, whose last
ranks hold padding at every size: `ucp reshard` of the elastic DP=4 copy to DP=2 and DP=1 must
give DeepSpeed's resaves made elastic by the same rule, every object and tensor bit-identical but
the run-config fields; `ucp export --format deepspeed-universal` refuses the tag naming the
field. A rigid tag with one elastic rank file, and elastic rank files in a tensor-parallel and a
pipeline tag, are refused naming the file and the field.
"""

import os
import re
import sys

import ds_objects
import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_elastic")
harness.fresh_dir(work)
TAG = "global_step5"
# DeepSpeed's resaves order a group's states as its universal load made them
# (harness.UNORDERED_IN_RESAVES); in the elastic form a group's states sit at this path.
UNORDERED_ELASTIC = re.compile(r"^optimizer_state_dict\.base_optimizer_state\.\d+$")


def optim_files(tag):
    return sorted(n for n in os.listdir(tag) if n.endswith("optim_states.pt"))


def make_elastic(path):
    """Rewrites the optimizer file at `path` in the elastic form."""
    state = ds_objects.load(path)
    osd = state["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    groups = []
    for g, padding in enumerate(osd["group_paddings"]):
        lean = {}
        for key, value in base["state"][g].items():
            cut = hasattr(value, "dim") and value.dim() > 0
            lean[key] = value[:value.numel() - padding] if cut else value
        groups.append(lean)
    osd["base_optimizer_state"] = groups
    ds_objects.save(state, path)


def elastic_copy(source, destination, names=None):
    tag = harness.copy_tag(source, destination)
    for name in names if names is not None else optim_files(tag):
        make_elastic(f"{tag}/{name}")
    return tag


def refused(what, args, words):
    status, _, err = harness.run_ucp(ucp, *args)
    report.check(status != 0 and all(w in err for w in words),
                 f"{what}: exit {status}, expected a refusal naming {words}: {err.strip()}")


for cfg in ("z1_fp32_odd", "z2_fp32_odd"):
    source = elastic_copy(f"{fixtures}/{cfg}/dp4/{TAG}", f"{work}/{cfg}/dp4/{TAG}")
    status, _, err = harness.run_ucp(ucp, "index", source)
    report.check(status == 0, f"{cfg}: ucp index of the elastic copy: exit {status}: {err}")
    for target in (2, 1):
        case = f"dp{target}_from_dp4"
        what = f"{cfg}/{case} (elastic)"
        expected = elastic_copy(f"{fixtures}/{cfg}/resaved/{case}/{TAG}",
                                f"{work}/{cfg}/expected_{case}/{TAG}")
        save_dir = harness.fresh_dir(f"{work}/{cfg}/{case}")
        status, _, err = harness.run_ucp(ucp, "reshard", source, "--to", f"dp={target}", "--out",
                                         save_dir)
        if not report.check(status == 0, f"{what}: ucp reshard exit {status}: {err}"):
            continue
        names = sorted(n for n in os.listdir(expected) if n.endswith(".pt"))
        report.check(harness.files_under(f"{save_dir}/{TAG}") == names,
                     f"{what}: files {harness.files_under(f'{save_dir}/{TAG}')} vs {names}")
        for name in names:
            report.diffs(harness.compare_files(f"{expected}/{name}", f"{save_dir}/{TAG}/{name}",
                                               harness.RUN_CONFIG_FIELDS,
                                               UNORDERED_ELASTIC), f"{what}/{name}")
    refused(f"{cfg}: universal export",
            ["export", source, "--format", "deepspeed-universal", "--out", f"{work}/{cfg}/u"],
            ["zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "optimizer_state_dict/base_optimizer_state: an elastic checkpoint"])

# One elastic rank file among rigid ones: a file of another save.
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
mixed = elastic_copy(f"{fixtures}/z1_fp32/dp4/{TAG}", f"{work}/mixed/{TAG}", [RANK1])
refused("one elastic rank file", ["index", mixed],
        [RANK1, "optimizer_state_dict/base_optimizer_state", "elastic, but"])

# The grid adapter (pipeline and tensor-parallel tags) reads only the rigid form.
for what, cfg, layout, target in (("tensor-parallel", "tp2_z1_fp32", "tp2dp2", "tp=1,dp=2"),
                                  ("pipeline", "pipe_z1_fp32", "pp2dp2", "pp=1,dp=2")):
    tag = elastic_copy(f"{fixtures}/{cfg}/{layout}/{TAG}", f"{work}/{cfg}/{TAG}")
    refused(f"{what} tag", ["reshard", tag, "--to", target, "--out",
                            harness.fresh_dir(f"{work}/{cfg}_out")],
            ["optim_states.pt", "base_optimizer_state: an elastic checkpoint",
             "pipeline and tensor-parallel tags"])
report.exit()

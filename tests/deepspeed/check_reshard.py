"""`ucp reshard` against DeepSpeed's own resaved files, and lossless round trips.

  check_reshard.py UCP FIXTURES WORKDIR CFG...

Resaved cases (<CFG>/resaved/dpM_from_dpN, made by DeepSpeed: universal load at DP=M, then
save_checkpoint): `ucp reshard <CFG>/dpN/global_step5 --to dp=M --out SAVEDIR` must give the same
files as DeepSpeed, every object and tensor bit-identical (optimizer partitions, exp_avg padding,
param_slice_mappings, partition_count, group_paddings, dp_world_size, module tensors and their
storage sharing), except the run-config fields of harness.RUN_CONFIG_FIELDS, which must hold the
source's values; SAVEDIR/latest holds the tag.

Round trips dp4 -> dp2 -> dp4 and dp4 -> dp1 -> dp4 must reproduce every tensor and every
non-tensor object of the original, with no exception but one: the padding elements of a ZeRO-3
original's flat partitions (uninitialised memory in a training save) must come back as zeros.

DeepSpeed's BF16 optimizer ignores round_robin_gradients (its flat groups keep the parameters'
order): z1_bf16_bf16opt's dp4 tag with the flag set in its config reshards to dp2 as DeepSpeed's
resave there, every object but that config entry.
"""

import re
import sys

import ds_objects
import harness

ucp, fixtures, work, configs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
report = harness.Report("check_reshard")
TAG = "global_step5"
ZERO3_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def check_run_config(source_tag, ours, what):
    """The run-config fields of our file hold the source's values (every file of a DeepSpeed
    save, model states and optimizer states alike, holds the same top-level ds_config)."""
    source = ds_objects.load(f"{source_tag}/{harness.model_states_name(source_tag)}")
    mine = ds_objects.load(ours)
    for field in harness.RUN_CONFIG_FIELDS:
        report.check(harness.get_path(mine, field) == harness.get_path(source, field),
                     f"{what}: {field} is the source's")


for cfg in configs:
    for target, source_dp in ((2, 4), (1, 4), (4, 2), (4, 4)):
        case = f"dp{target}_from_dp{source_dp}"
        what = f"{cfg}/{case}"
        source_tag = f"{fixtures}/{cfg}/dp{source_dp}/{TAG}"
        expected = f"{fixtures}/{cfg}/resaved/{case}/{TAG}"
        save_dir = f"{work}/{cfg}/{case}"
        if not harness.reshard(report, ucp, source_tag, f"dp={target}", save_dir, what):
            continue
        ours = f"{save_dir}/{TAG}"
        names = harness.files_under(expected)
        report.check(harness.files_under(save_dir) == sorted(["latest"] +
                                                             [f"{TAG}/{n}" for n in names]),
                     f"{what}: files {harness.files_under(save_dir)} vs DeepSpeed's {names}")
        for name in names:
            diffs = harness.compare_files(f"{expected}/{name}", f"{ours}/{name}",
                                          harness.RUN_CONFIG_FIELDS, harness.UNORDERED_IN_RESAVES)
            if report.diffs(diffs, f"{what}/{name}"):
                check_run_config(source_tag, f"{ours}/{name}", f"{what}/{name}")

    for middle in (2, 1):
        what = f"{cfg}: dp4 -> dp{middle} -> dp4"
        original = f"{fixtures}/{cfg}/dp4/{TAG}"
        first, second = f"{work}/{cfg}/rt{middle}_a", f"{work}/{cfg}/rt{middle}_b"
        if not (harness.reshard(report, ucp, original, f"dp={middle}", first, what) and
                harness.reshard(report, ucp, f"{first}/{TAG}", "dp=4", second, what)):
            continue
        names = harness.files_under(original)
        report.check(harness.files_under(f"{second}/{TAG}") == names, f"{what}: files")
        zero3 = harness.model_states_name(original).startswith("zero_pp_rank_")
        for name in names:
            match = ZERO3_OPTIM.match(name)
            if zero3 and match:
                # ZeRO-3 padding of the original save is don't-care (uninitialised memory).
                param_shapes = ds_objects.load(
                    f"{original}/{harness.model_states_name(original)}")["param_shapes"]
                want = harness.zero3_padding_zeroed(ds_objects.load(f"{original}/{name}"),
                                                    param_shapes, 4, int(match.group(1)))
                report.diffs(ds_objects.compare(want, ds_objects.load(f"{second}/{TAG}/{name}")),
                             f"{what}: {name}")
                continue
            report.diffs(harness.compare_files(f"{original}/{name}", f"{second}/{TAG}/{name}"),
                         f"{what}: {name}")
if "z1_bf16_bf16opt" in configs:
    what = "z1_bf16_bf16opt with round_robin_gradients: dp4 -> dp2"
    flagged = harness.copy_tag(f"{fixtures}/z1_bf16_bf16opt/dp4/{TAG}",
                               f"{work}/round_robin_bf16opt/{TAG}")
    states = ds_objects.load(f"{flagged}/mp_rank_00_model_states.pt")
    states["ds_config"]["zero_optimization"]["round_robin_gradients"] = True
    ds_objects.save(states, f"{flagged}/mp_rank_00_model_states.pt")
    save_dir = f"{work}/round_robin_bf16opt_dp2"
    if harness.reshard(report, ucp, flagged, "dp=2", save_dir, what):
        expected = f"{fixtures}/z1_bf16_bf16opt/resaved/dp2_from_dp4/{TAG}"
        for name in harness.files_under(expected):
            want = ds_objects.load(f"{expected}/{name}")
            if name == "mp_rank_00_model_states.pt":  # the config the source's run was given
                want["ds_config"]["zero_optimization"]["round_robin_gradients"] = True
            report.diffs(ds_objects.compare(want, ds_objects.load(f"{save_dir}/{TAG}/{name}"),
                                            allowed=harness.RUN_CONFIG_FIELDS,
                                            unordered=harness.UNORDERED_IN_RESAVES),
                         f"{what}/{name}")
report.exit()

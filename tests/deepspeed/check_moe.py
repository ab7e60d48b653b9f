"""`ucp` on the DeepSpeed-MoE fixtures (DeepSpeed v0.14.5, 4 experts per MoE layer, expert-parallel
size 2, fp32): moe_z1_fp32 and moe_z2_fp32, each saved by an uninterrupted run at DP=4 (dp4/) and
one at DP=2 (dp2/) of the same global batch.

  check_moe.py UCP FIXTURES WORKDIR

DeepSpeed can neither convert these tags (ds_to_universal fails) nor load them at another DP, so
there is no resave to compare with. What must hold instead:
- dp4 -> dp2 writes the files DeepSpeed's DP=2 run wrote, alike in every object, key, shape,
  stride, storage size and param_slice_mapping; only tensor values (the two runs are different
  runs) and harness.RUN_CONFIG_FIELDS (the micro batch of each run's config) may differ. Those values are DeepSpeed's partitioning rule applied to the dp4 files: per
  group the ranks' partitions joined into the flat buffer and cut again, the dense groups over 2
  ranks, the expert group of each expert-parallel rank e (ranks e, e+2, ...) over the DP/EP = 1
  rank of its expert-data-parallel group; the expert files and module tensors unchanged.
- Round trips dp4 -> dp2 -> dp4 and dp2 -> dp4 -> dp2 give back DeepSpeed's own files, every
  object and tensor bit-identical.
- The universal export, a DP the expert-parallel size does not divide, another expert-parallel
  size (DeepSpeed 0.14.5 scales expert gradients by it, so its Adam moments would not fit),
  tensor parallelism, another pipeline degree, tags of two model-parallel ranks that are tensor
  parallelism or do not record which axis they are, and a tag missing an expert file are refused,
  naming the reason; two model-parallel ranks recorded as pipeline stages are read as a pipeline
  (here: its second stage's files are missing, and named). (A change of the expert-parallel size
  and MoE in a pipeline are checked live on the current release: ds_moe_e2e.py.)
"""

import os
import sys

import torch

import ds_objects
import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_moe")
TAG = "global_step5"
EP = 2
OSD = "optimizer_state_dict"
harness.fresh_dir(work)


def structure_diffs(expected, actual):
    """compare() differences other than tensor values and the run-config fields."""
    return [d for d in harness.compare_files(expected, actual, harness.RUN_CONFIG_FIELDS)
            if not d.endswith(" elements differ")]


def flat(tensors, total):
    return torch.cat([t.reshape(-1) for t in tensors])[:total]


def check_values(what, source_dir, out_dir, source_dp, target_dp):
    """Every partition-shaped tensor of out_dir's optimizer files is DeepSpeed's partitioning
    of source_dir's (see the module docstring); model and expert files keep their tensors."""
    source = [ds_objects.load(f"{source_dir}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt")[OSD]
              for r in range(source_dp)]
    target = [ds_objects.load(f"{out_dir}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt")[OSD]
              for r in range(target_dp)]
    groups = len(source[0]["partition_count"])
    for g in range(groups):
        experts = source[0]["base_optimizer_state"]["param_groups"][g].get("moe", False)
        for e in range(EP if experts else 1):
            src = [r for r in range(source_dp) if not experts or r % EP == e]
            dst = [r for r in range(target_dp) if not experts or r % EP == e]
            fp32 = [source[r]["single_partition_of_fp32_groups"][g] for r in src]
            total = sum(t.numel() for t in fp32)  # the fp32 partitions leave the padding out
            alignment = 2 * len(dst)
            per_rank = -(-total // alignment) * alignment // len(dst)
            for key in ["fp32"] + [k for k, v in source[0]["base_optimizer_state"]["state"][g].items()
                                   if v.dim() == 1]:
                if key == "fp32":
                    whole = flat(fp32, total)
                else:
                    whole = flat([source[r]["base_optimizer_state"]["state"][g][key] for r in src],
                                 total)
                for i, r in enumerate(dst):
                    part = whole[i * per_rank:(i + 1) * per_rank]
                    if key == "fp32":
                        got = target[r]["single_partition_of_fp32_groups"][g]
                    else:
                        got = target[r]["base_optimizer_state"]["state"][g][key][:part.numel()]
                    report.check(torch.equal(got.view(torch.int32), part.view(torch.int32)),
                                 f"{what}: rank {r} group {g} {key}: not DeepSpeed's partition")
    for name in sorted(os.listdir(source_dir)):
        if name.startswith("layer_"):
            report.check(harness.read_bytes(f"{source_dir}/{name}") ==
                         harness.read_bytes(f"{out_dir}/{name}"), f"{what}/{name}: bytes")
    model = "mp_rank_00_model_states.pt"
    report.diffs(harness.compare_files(f"{source_dir}/{model}", f"{out_dir}/{model}",
                                       ("dp_world_size",)), f"{what}/{model}")
    report.check(ds_objects.load(f"{out_dir}/{model}")["dp_world_size"] == target_dp,
                 f"{what}/{model}: dp_world_size")


for config in ("moe_z1_fp32", "moe_z2_fp32"):
    cfg = f"{fixtures}/{config}"
    dp4, dp2 = f"{cfg}/dp4/{TAG}", f"{cfg}/dp2/{TAG}"

    status, out, err = harness.run_ucp(ucp, "inspect", dp4)
    report.check(status == 0 and "adapter deepspeed-moe" in out,
                 f"{config}: ucp inspect exit {status}: {err}{out[:300]}")

    status, _, err = harness.run_ucp(ucp, "export", dp4, "--format", "deepspeed-universal",
                                     "--out", f"{work}/{config}_universal")
    report.check(status != 0 and "no layout for expert parallelism" in err,
                 f"{config}: the universal export not refused: exit {status}: {err}")

    for source, other, source_dp, target_dp in ((dp4, dp2, 4, 2), (dp2, dp4, 2, 4)):
        what = f"{config} dp{source_dp} -> dp{target_dp}"
        there = f"{work}/{config}_dp{source_dp}_to_dp{target_dp}"
        if not harness.reshard(report, ucp, source, f"dp={target_dp}", there, what):
            continue
        names = harness.files_under(other)
        report.check(harness.files_under(f"{there}/{TAG}") == names,
                     f"{what}: files {harness.files_under(f'{there}/{TAG}')} vs DeepSpeed's {names}")
        for name in names:
            report.diffs(structure_diffs(f"{other}/{name}", f"{there}/{TAG}/{name}"),
                         f"{what}/{name} against DeepSpeed's DP={target_dp} run")
        check_values(what, source, f"{there}/{TAG}", source_dp, target_dp)

        back = f"{work}/{config}_dp{source_dp}_to_dp{target_dp}_back"
        if harness.reshard(report, ucp, f"{there}/{TAG}", f"dp={source_dp}", back,
                           f"{what} -> dp{source_dp}"):
            harness.compare_resaved(report, f"{what} -> dp{source_dp}", back, source, TAG, ())

for to, words in (("dp=3", "not a multiple of the expert-parallel size 2 (the tag's)"),
                  ("dp=2,ep=1", "scales expert gradients (and Adam's moments) by that size"),
                  ("tp=2,dp=2", "tp=2: the MoE tag records no tensor-parallel rules"),
                  ("pp=2,dp=2", "pp=2: wte.weight names no numbered layer: the tag's model is "
                                "no PipelineModule")):
    save_dir = harness.fresh_dir(f"{work}/refused")
    status, _, err = harness.run_ucp(ucp, "reshard", f"{fixtures}/moe_z2_fp32/dp4/{TAG}", "--to",
                                     to, "--out", save_dir)
    report.check(status != 0 and words in err, f"--to {to}: not refused as expected: {err}")

# An expert-parallel size for a tag without experts.
save_dir = harness.fresh_dir(f"{work}/refused")
status, _, err = harness.run_ucp(ucp, "reshard", f"{fixtures}/z2_fp32/dp4/{TAG}", "--to",
                                 "dp=2,ep=2", "--out", save_dir)
report.check(status != 0 and "ep=2: the tag has no experts" in err,
             f"ep on a tag without experts: not refused as expected: {err}")

# A tag of two model-parallel ranks: a pipeline or tensor parallelism, told apart only where the
# model states record checkpoint_parallel_dimensions (DeepSpeed 0.19; a pipeline with MoE layers
# writes no layer files there, each stage's dense tensors in its own model states). The pipeline
# is read stage by stage, the TP ranks as lanes; neither copy has mp rank 1's optimizer files. Both
# at once need mp_world_size tp_degree x pp_degree.
for name, dimensions, words in (
        ("mp2_pipeline", {"pp_degree": 2, "tp_degree": 1},
         "zero_pp_rank_0_mp_rank_01_optim_states.pt: not found (dp_world_size 4 in "
         "mp_rank_01_model_states.pt)"),
        ("mp2_tensor", {"pp_degree": 1, "tp_degree": 2},
         "zero_pp_rank_0_mp_rank_01_optim_states.pt: not found (dp_world_size 4 in "
         "mp_rank_01_model_states.pt)"),
        ("mp2_tensor_pipeline", {"pp_degree": 2, "tp_degree": 2},
         "mp_world_size: 2, but checkpoint_parallel_dimensions records tp_degree 2 and pp_degree 2"),
        ("mp2_unrecorded", None,
         "mp_rank_00_model_states.pt: mp_world_size 2: MoE with tensor or pipeline parallelism, "
         "and the tag does not record which")):
    copy = harness.copy_tag(f"{fixtures}/moe_z2_fp32/dp4/{TAG}", f"{work}/{name}/{TAG}")
    state = ds_objects.load(f"{copy}/mp_rank_00_model_states.pt")
    state["mp_world_size"] = 2
    if dimensions is not None:
        state["checkpoint_parallel_dimensions"] = dimensions
    for rank in (0, 1):
        ds_objects.save(state, f"{copy}/mp_rank_{rank:02d}_model_states.pt")
    status, _, err = harness.run_ucp(ucp, "index", copy)
    report.check(status != 0 and words in err,
                 f"{name}: not refused as expected: exit {status}: {err}")

copy = harness.copy_tag(f"{fixtures}/moe_z2_fp32/dp4/{TAG}", f"{work}/missing/{TAG}")
os.remove(f"{copy}/layer_1_expert_3_mp_rank_00_model_states.pt")
status, _, err = harness.run_ucp(ucp, "index", copy)
report.check(status != 0 and "layer_1_expert_3_mp_rank_00_model_states.pt: not found" in err,
             f"a tag missing an expert file: not refused naming it: exit {status}: {err}")

report.exit()

"""ZeRO-3 with several parameter groups, sub groups and frozen parameters, fixture-free: tags
written by zero3_generator.py (DeepSpeed's layout, no DeepSpeed) are the oracles.

  check_zero3_generated.py UCP WORKDIR

For fp32 and bf16 runs: one training state written at dp=3 (uninitialised padding, as a training
save holds) and at dp 1, 2, 4, 5 (zero padding, as DeepSpeed writes after a universal load).
`ucp reshard` of the dp=3 tag to each of those sizes must equal the generator's tag at that size,
every object and tensor bit for bit (at dp 4 and 5 DeepSpeed splits the first parameter group
into other sub groups: other flat groups, states and param_groups); dp3 -> dp2 -> dp3 and
dp3 -> dp5 -> dp3 must give the dp=3 tag back (its padding as zeros); `ucp export --format
deepspeed-universal` must hold every trainable parameter's fp32, exp_avg and exp_avg_sq of every
group (ds_to_universal v0.14.5 exports group 0 only) as the state has them. A tag whose model
states record an AutoEP layer (DeepSpeed 0.19's ds_autoep_layers) whose experts module holds no
parameter of the tag is refused naming param_shapes, one with no MoE layer naming num_experts
(ds_autoep_e2e.py checks real AutoEP tags).
"""

import os
import sys

import torch

import ds_objects
import harness
import zero3_generator

ucp, work = sys.argv[1], sys.argv[2]
report = harness.Report("check_zero3_generated")
TAG = "global_step5"


def files(tag):
    return sorted(n for n in os.listdir(tag) if n.endswith(".pt"))


def same_tags(expected, actual, what):
    report.check(files(actual) == files(expected),
                 f"{what}: files {files(actual)} vs {files(expected)}")
    for name in files(expected):
        report.diffs(harness.compare_files(f"{expected}/{name}", f"{actual}/{name}"),
                     f"{what}: {name}")


def reshard(tag, dp, save_dir, what):
    harness.fresh_dir(save_dir)
    status, _, err = harness.run_ucp(ucp, "reshard", tag, "--to", f"dp={dp}", "--out", save_dir)
    report.check(status == 0, f"{what}: ucp reshard exit {status}: {err}")
    return status == 0, err


for bf16 in (False, True):
    kind = "bf16" if bf16 else "fp32"
    state = zero3_generator.make_state(bf16)
    base = harness.fresh_dir(f"{work}/{kind}")
    source = f"{base}/dp3/{TAG}"
    zero3_generator.write_tag(source, state, 3, garbage_padding=True)
    for dp in (1, 2, 4, 5):
        expected = f"{base}/expected_dp{dp}/{TAG}"
        zero3_generator.write_tag(expected, state, dp)
        what = f"{kind}: dp3 -> dp{dp}"
        ok, _ = reshard(source, dp, f"{base}/out_dp{dp}", what)
        if ok:
            same_tags(expected, f"{base}/out_dp{dp}/{TAG}", what)

    what = f"{kind}: dp3 -> dp2 -> dp3"
    clean = f"{base}/expected_dp3/{TAG}"
    zero3_generator.write_tag(clean, state, 3)
    ok, _ = reshard(f"{base}/out_dp2/{TAG}", 3, f"{base}/back_dp3", what)
    if ok:
        same_tags(clean, f"{base}/back_dp3/{TAG}", what)

    what = f"{kind}: dp3 -> dp5 -> dp3 (other sub groups at dp5)"
    ok, _ = reshard(f"{base}/out_dp5/{TAG}", 3, f"{base}/back5_dp3", what)
    if ok:
        same_tags(clean, f"{base}/back5_dp3/{TAG}", what)

    out = f"{base}/export/{TAG}_universal"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    status, _, err = harness.run_ucp(ucp, "export", source, "--format", "deepspeed-universal",
                                     "--out", out)
    if report.check(status == 0, f"{kind}: ucp export exit {status}: {err}"):
        trainable = [name for group in state["groups"] for name, _ in group["params"]]
        report.check(sorted(os.listdir(f"{out}/zero")) ==
                     sorted(trainable + ["optimizer_state.pt"]),
                     f"{kind}: export: zero/ holds {sorted(os.listdir(f'{out}/zero'))}")
        for group in state["groups"]:
            for name, _ in group["params"]:
                for key, full in group["tensors"][name].items():
                    path = f"{out}/zero/{name}/{key}.pt"
                    if not report.check(os.path.exists(path), f"{kind}: export: {path}"):
                        continue
                    mine = ds_objects.load(path)
                    report.check(torch.equal(mine.detach(), full.reshape(-1)),
                                 f"{kind}: export: {name}/{key} differs")
# An AutoEP layer whose experts module holds none of the tag's parameters: refused, naming the
# field.
autoep = harness.copy_tag(f"{work}/fp32/dp3/{TAG}", f"{work}/autoep/{TAG}")
head = f"{autoep}/zero_pp_rank_0_mp_rank_00_model_states.pt"
states = ds_objects.load(head)
states["num_experts"] = [4]
states["ds_autoep_layers"] = [{
    "moe_layer_id": 0, "checkpoint_format": "zero3_partitioned", "num_experts": 4, "ep_size": 1,
    "ep_rank": 0, "expert_data_parallel_rank": 0, "global_expert_start": 0,
    "expert_placement": {"ranks": [{"rank": 0, "experts": [0, 1, 2, 3]}]},
    "expert_key_prefix": "no_such_module.experts"}]
ds_objects.save(states, head)
status, _, err = harness.run_ucp(ucp, "index", autoep)
report.check(status != 0 and "param_shapes: no fused expert parameter of the experts modules "
             "ds_autoep_layers names" in err, f"AutoEP ZeRO-3 tag: ucp index exit {status}: {err}")
# AutoEP layers recorded with no MoE layer in num_experts: refused, naming the field.
states["num_experts"] = []
states["ds_autoep_layers"] = []
ds_objects.save(states, head)
status, _, err = harness.run_ucp(ucp, "index", autoep)
report.check(status != 0 and "num_experts: empty: no MoE layer" in err,
             f"AutoEP ZeRO-3 tag without MoE layers: ucp index exit {status}: {err}")
report.exit()

"""Bad inputs and bad arguments: a non-zero exit, one line `ucp <command>: <message>` on stderr
naming the file and the field, and nothing left behind (no output, no temporary, no latest).

  check_errors.py UCP FIXTURES WORKDIR

Inputs are damaged copies of z1_fp32/dp4/global_step5 (a missing rank file, a truncated file,
rank files of another fixture swapped in, param_shapes edited with the DeepSpeed stand-ins, the
model states as DeepSpeed 0.19 writes them under its BF16 optimizer at ZeRO stage 0, also in a copy
of pipe_z1_fp32);
arguments: malformed --to specifications, a world size the target does not divide, an existing
output; unsupported targets: a tensor-parallel one that does not split evenly, an ambiguous
pipeline one.
"""

import os
import sys

import torch

import ds_objects
import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_errors")
harness.fresh_dir(work)
SOURCE = f"{fixtures}/z1_fp32/dp4/global_step5"
USAGE, INPUT = 2, 1


def expect_failure(what, args, status, words, out_dir=None):
    """Runs ucp with args; requires exit `status`, one stderr line naming every word in `words`
    (alternatives as tuples), and nothing under out_dir."""
    code, _, err = harness.run_ucp(ucp, *args)
    lines = err.strip().splitlines()
    report.check(code == status, f"{what}: exit {code}, expected {status}: {err.strip()}")
    report.check(len(lines) == 1 and lines[0].startswith(f"ucp {args[0]}: "),
                 f"{what}: one line 'ucp {args[0]}: ...' on stderr, got {lines}")
    for word in words:
        options = word if isinstance(word, tuple) else (word,)
        report.check(any(o in err for o in options), f"{what}: message names {options}: {err}")
    if out_dir is not None and os.path.isdir(out_dir):
        report.check(not os.listdir(out_dir),
                     f"{what}: left behind in {out_dir}: {os.listdir(out_dir)}")


def damaged(name, change):
    """A copy of SOURCE under WORKDIR/name, changed by change(tag_dir)."""
    tag = harness.copy_tag(SOURCE, f"{work}/{name}/global_step5")
    change(tag)
    return tag


def every_command(what, tag, words):
    """index, reshard and export of a damaged tag all fail alike and write nothing."""
    save = harness.fresh_dir(f"{work}/{what}_out")
    expect_failure(f"{what} (reshard)", ["reshard", tag, "--to", "dp=2", "--out", save], INPUT,
                   words, save)
    expect_failure(f"{what} (export universal)",
                   ["export", tag, "--format", "deepspeed-universal", "--out", f"{save}/u"],
                   INPUT, words, save)
    expect_failure(f"{what} (export safetensors)",
                   ["export", tag, "--format", "safetensors", "--out", f"{save}/s"], INPUT, words,
                   save)
    expect_failure(f"{what} (index)", ["index", tag], INPUT, words)
    report.check(not os.path.exists(f"{tag}/.ucp/index.json"), f"{what}: no index written")
    report.check(not harness.temp_leftovers(tag), f"{what}: temporaries in the tag")


RANK2 = "zero_pp_rank_2_mp_rank_00_optim_states.pt"
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"

every_command("missing", damaged("missing", lambda t: os.remove(f"{t}/{RANK2}")), [RANK2])


def truncate(tag):
    size = os.path.getsize(f"{tag}/{RANK1}")
    os.truncate(f"{tag}/{RANK1}", size // 2)


every_command("truncated", damaged("truncated", truncate), [RANK1])


def swap_from(config, dp):
    def change(tag):
        os.remove(f"{tag}/{RANK1}")
        with open(f"{fixtures}/{config}/{dp}/global_step5/{RANK1}", "rb") as f, \
                open(f"{tag}/{RANK1}", "wb") as g:
            g.write(f.read())
    return change


# Rank 1 of the same model at DP=2 (partition_count [2]), of a ZeRO-2 run (zero_stage 2), of
# the odd-sized model (other partitions and slice mappings).
every_command("other_dp", damaged("other_dp", swap_from("z1_fp32", "dp2")),
              [RANK1, ("partition_count", "param_slice_mappings")])
every_command("other_stage", damaged("other_stage", swap_from("z2_fp32", "dp4")),
              [RANK1, "zero_stage"])
every_command("other_model", damaged("other_model", swap_from("z1_fp32_odd", "dp4")),
              [RANK1, ("param_slice_mappings", "partition", "single_partition_of_fp32_groups",
                       "exp_avg")])


def edit_param_shapes(tag):
    state = ds_objects.load(f"{tag}/{MODEL}")
    state["param_shapes"][0]["wte.weight"] = torch.Size([66, 48])
    ds_objects.save(state, f"{tag}/{MODEL}")


every_command("param_shapes", damaged("param_shapes", edit_param_shapes), [MODEL, "param_shapes"])


def as_bf16_optimizer_at_stage_0_of_0_19(tag):
    """The model states as DeepSpeed 0.19 writes them under its BF16 optimizer at ZeRO stage 0:
    param_shapes None, DP rank 0's optimizer state in `optimizer`."""
    state = ds_objects.load(f"{tag}/{MODEL}")
    state["param_shapes"] = None
    state["optimizer"] = {"ds_version": "0.19.8", "clip_grad": 1.0}
    ds_objects.save(state, f"{tag}/{MODEL}")


# Refused, naming why: 0.19.8 itself resumes such a tag neither by its plain load nor through
# ds_to_universal. The same for the ZeRO-1/2 adapter's tags and the grid adapter's pipelines.
every_command("bf16_optimizer_stage_0",
              damaged("bf16_optimizer_stage_0", as_bf16_optimizer_at_stage_0_of_0_19),
              [MODEL, "param_shapes None", "BF16_Optimizer._load_legacy_checkpoint"])
pipe = harness.copy_tag(f"{fixtures}/pipe_z1_fp32/pp2dp2/global_step5",
                        f"{work}/bf16_optimizer_stage_0_pipe/global_step5")
as_bf16_optimizer_at_stage_0_of_0_19(pipe)
expect_failure("bf16_optimizer_stage_0 pipeline (index)", ["index", pipe], INPUT,
               [MODEL, "param_shapes None", "BF16_Optimizer._load_legacy_checkpoint"])

# Arguments.
save = harness.fresh_dir(f"{work}/usage_out")
for spec, words in (("dp=3,world=4", ["world"]), ("dp=0", ["dp"]), ("dq=2", ["dq"]),
                    ("dp=x", ["dp"]), ("dp=2,dp=2", ["dp"]), ("", ["--to"]), ("dp=-1", ["dp"]),
                    ("dp=99999999999", ["dp"])):
    expect_failure(f"--to '{spec}'", ["reshard", SOURCE, "--to", spec, "--out", save], USAGE,
                   words, save)
# Well-formed specifications: every key spelled out works; a world the target divides passes the
# parser and reaches the adapter, which has no ranks outside dp × tp × pp for ZeRO-1/2.
full = harness.fresh_dir(f"{work}/full_spec_out")
code, _, err = harness.run_ucp(ucp, "reshard", SOURCE, "--to", "pp=1,world=2,tp=1,dp=2", "--out",
                               full)
report.check(code == 0 and os.path.isfile(f"{full}/global_step5/mp_rank_00_model_states.pt"),
             f"--to pp=1,world=2,tp=1,dp=2: exit {code}: {err}")
expect_failure("--to dp=2,world=4", ["reshard", SOURCE, "--to", "dp=2,world=4", "--out", save],
               INPUT, ["world=4"], save)
expect_failure("unknown format", ["export", SOURCE, "--format", "onnx", "--out", f"{save}/x"],
               USAGE, ["onnx"], save)
expect_failure("tp target", ["reshard", SOURCE, "--to", "dp=2,tp=2", "--out", save], INPUT,
               ["tp=2"], save)
code, _, err = harness.run_ucp(ucp, "reshard", SOURCE, "--to", "dp=2", "--out", save)
report.check(code == 0, f"reshard into {save}: exit {code}: {err}")
before = {n: harness.read_bytes(f"{save}/{n}") for n in harness.files_under(save)}
expect_failure("existing output", ["reshard", SOURCE, "--to", "dp=1", "--out", save], USAGE,
               ["global_step5", "--force"])
report.check({n: harness.read_bytes(f"{save}/{n}") for n in harness.files_under(save)} == before,
             "existing output: left unchanged")
code, _, err = harness.run_ucp(ucp, "reshard", SOURCE, "--to", "dp=1", "--out", save, "--force")
report.check(code == 0 and sorted(os.listdir(f"{save}/global_step5")) ==
             sorted(os.listdir(f"{fixtures}/z1_fp32/resaved/dp1_from_dp4/global_step5")) and
             not harness.temp_leftovers(save), f"--force replaces the tag: exit {code}: {err}")
universal = f"{work}/existing_universal"
os.makedirs(universal)
expect_failure("existing export", ["export", SOURCE, "--format", "deepspeed-universal", "--out",
                                   universal], USAGE, ["existing_universal", "--force"])

# A tensor-parallel target whose splits do not divide evenly (144 fused QKV rows over 5 ranks).
save = harness.fresh_dir(f"{work}/tensor_out")
expect_failure("tensor", ["reshard", f"{fixtures}/tp2_z1_fp32/tp2dp2/global_step5", "--to",
                          "tp=5,dp=1", "--out", save], INPUT, ["tp=5", "split evenly"], save)

# A pipeline target whose layer placement DeepSpeed's recorded stages leave ambiguous.
save = harness.fresh_dir(f"{work}/pipeline_pp3_out")
expect_failure("pipeline pp=3", ["reshard", f"{fixtures}/pipe_z1_fp32/pp2dp2/global_step5", "--to",
                                 "pp=3,dp=1", "--out", save], INPUT,
               ["pp=3", "ambiguous layer placement"], save)
report.exit()

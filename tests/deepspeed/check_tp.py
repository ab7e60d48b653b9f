"""`ucp` on the tensor-parallel fixture (tp2_z1_fp32: TP=2 x DP=2, ZeRO-1 fp32) against
DeepSpeed's own files.

  check_tp.py UCP FIXTURES WORKDIR

`ucp export --format deepspeed-universal` must write ds_to_universal's files (merged over TP,
cat_dim, vocab_tensor, the vocabulary cut to its 67 real rows), every object and tensor
bit-identical. `ucp reshard --to tp=T,dp=D` must write DeepSpeed's own resaved files at each
size (tp1dp2, tp2dp1, tp1dp1 and the tp2dp2 control): optimizer partitions, paddings,
param_slice_mappings, module slices, mp_world_size, dp_world_size and
universal_checkpoint_info.padded_vocab_size, except the run-config fields of
harness.RUN_CONFIG_FIELDS (the new run's).
"""

import sys

import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_tp")
TAG = "global_step5"
source = f"{fixtures}/tp2_z1_fp32/tp2dp2"

parent = harness.fresh_dir(f"{work}/universal")
out = f"{parent}/global_step5_universal"
status, _, err = harness.run_ucp(ucp, "export", f"{source}/{TAG}", "--format",
                                 "deepspeed-universal", "--out", out)
if report.check(status == 0, f"ucp export exit {status}: {err}"):
    expected = f"{source}/global_step5_universal"
    names = harness.files_under(expected)
    report.check(harness.files_under(out) == names,
                 f"export: files {sorted(set(harness.files_under(out)) ^ set(names))} differ")
    for name in names:
        report.diffs(harness.compare_files(f"{expected}/{name}", f"{out}/{name}"),
                     f"export/{name}")

for tp, dp in ((1, 2), (2, 1), (1, 1), (2, 2)):
    case = f"tp{tp}dp{dp}_from_tp2dp2"
    save_dir = harness.fresh_dir(f"{work}/{case}")
    status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to", f"tp={tp},dp={dp}",
                                     "--out", save_dir)
    if not report.check(status == 0, f"{case}: ucp reshard exit {status}: {err}"):
        continue
    report.check(harness.read_bytes(f"{save_dir}/latest") == TAG.encode(), f"{case}: latest")
    expected = f"{fixtures}/tp2_z1_fp32/resaved/{case}/{TAG}"
    names = harness.files_under(expected)
    report.check(harness.files_under(save_dir) == sorted(["latest"] + [f"{TAG}/{n}" for n in names]),
                 f"{case}: files {harness.files_under(save_dir)} vs DeepSpeed's {names}")
    for name in names:
        report.diffs(harness.compare_files(f"{expected}/{name}", f"{save_dir}/{TAG}/{name}",
                                           harness.RUN_CONFIG_FIELDS,
                                           harness.UNORDERED_IN_RESAVES),
                     f"{case}/{name}")
report.exit()

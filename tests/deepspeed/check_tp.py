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

The other way, from DeepSpeed's own TP=1 files (the resaved tp1dp2 and tp1dp1, which carry
universal_checkpoint_info with the vocabulary padded to 68): `ucp reshard --to tp=2,dp=D` must
write the original TP=2 save (dp 2: tp2dp2/global_step5) or DeepSpeed's resave at that size (dp 1),
the vocabulary re-padded to 72; and tp2dp2 -> tp1dp1 -> tp2dp2 through ucp alone gives the
original back.
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
    harness.compare_export(report, "export", f"{source}/global_step5_universal", out)


def compare_tags(case, save_dir, expected):
    harness.compare_resaved(report, case, save_dir, expected, TAG)


for tp, dp in ((1, 2), (2, 1), (1, 1), (2, 2)):
    case = f"tp{tp}dp{dp}_from_tp2dp2"
    save_dir = harness.fresh_dir(f"{work}/{case}")
    status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to", f"tp={tp},dp={dp}",
                                     "--out", save_dir)
    if not report.check(status == 0, f"{case}: ucp reshard exit {status}: {err}"):
        continue
    compare_tags(case, save_dir, f"{fixtures}/tp2_z1_fp32/resaved/{case}/{TAG}")


# TP=1 -> TP=2: DeepSpeed's TP=1 resaves split back to the original save.
for src_dp, dp, expected in ((2, 2, f"{source}/{TAG}"), (1, 2, f"{source}/{TAG}"),
                             (1, 1, f"{fixtures}/tp2_z1_fp32/resaved/tp2dp1_from_tp2dp2/{TAG}"),
                             (2, 1, f"{fixtures}/tp2_z1_fp32/resaved/tp2dp1_from_tp2dp2/{TAG}")):
    case = f"tp2dp{dp}_from_tp1dp{src_dp}"
    tp1 = f"{fixtures}/tp2_z1_fp32/resaved/tp1dp{src_dp}_from_tp2dp2/{TAG}"
    save_dir = harness.fresh_dir(f"{work}/{case}")
    status, _, err = harness.run_ucp(ucp, "reshard", tp1, "--to", f"tp=2,dp={dp}",
                                     "--out", save_dir)
    if report.check(status == 0, f"{case}: ucp reshard exit {status}: {err}"):
        compare_tags(case, save_dir, expected)

# The round trip through ucp alone: tp2dp2 -> tp1dp1 -> tp2dp2.
middle = harness.fresh_dir(f"{work}/round_trip_tp1dp1")
status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to", "tp=1,dp=1",
                                 "--out", middle)
if report.check(status == 0, f"round trip to tp1dp1: ucp reshard exit {status}: {err}"):
    back = harness.fresh_dir(f"{work}/round_trip_tp2dp2")
    status, _, err = harness.run_ucp(ucp, "reshard", f"{middle}/{TAG}", "--to", "tp=2,dp=2",
                                     "--out", back)
    if report.check(status == 0, f"round trip to tp2dp2: ucp reshard exit {status}: {err}"):
        compare_tags("round_trip", back, f"{source}/{TAG}")
report.exit()

"""The `ucp` commands on DeepSpeed's pipeline fixture pipe_z1_fp32 (PP=2 x DP=2, ZeRO-1, fp32).

  check_pipe.py UCP FIXTURES WORKDIR

Resaved cases (pipe_z1_fp32/resaved/ppPdpD_from_pp2dp2, made by DeepSpeed: universal load at
(P, D), then save_checkpoint): `ucp reshard pp2dp2/global_step5 --to pp=P,dp=D --out SAVEDIR`
must give DeepSpeed's files (layer files, mp_rank_XX model states, zero_pp_rank_R_mp_rank_XX
optimizer files), every object and tensor bit-identical except the run-config fields of
harness.RUN_CONFIG_FIELDS; SAVEDIR/latest holds the tag. Round trips pp2dp2 -> X -> pp2dp2
reproduce every object and tensor. `ucp export --format deepspeed-universal` equals DeepSpeed's
ds_to_universal output. (The pp=3 refusal: check_errors.py.)
"""

import sys

import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_pipe")
TAG = "global_step5"
CFG = f"{fixtures}/pipe_z1_fp32"
SOURCE = f"{CFG}/pp2dp2/{TAG}"
harness.fresh_dir(work)


for pp, dp in ((1, 2), (2, 1), (4, 1), (2, 2)):
    case = f"pp{pp}dp{dp}_from_pp2dp2"
    expected = f"{CFG}/resaved/{case}/{TAG}"
    save_dir = f"{work}/{case}"
    if not harness.reshard(report, ucp, SOURCE, f"pp={pp},dp={dp}", save_dir, case):
        continue
    names = harness.files_under(expected)
    report.check(harness.files_under(save_dir) == sorted(["latest"] + [f"{TAG}/{n}" for n in names]),
                 f"{case}: files {harness.files_under(save_dir)} vs DeepSpeed's {names}")
    for name in names:
        if name.startswith("layer_"):
            report.check(harness.read_bytes(f"{expected}/{name}") ==
                         harness.read_bytes(f"{save_dir}/{TAG}/{name}"), f"{case}/{name}: bytes")
        report.diffs(harness.compare_files(f"{expected}/{name}", f"{save_dir}/{TAG}/{name}",
                                           harness.RUN_CONFIG_FIELDS,
                                           harness.UNORDERED_IN_RESAVES), f"{case}/{name}")

for pp, dp in ((1, 2), (4, 1), (1, 1)):
    what = f"pp2dp2 -> pp{pp}dp{dp} -> pp2dp2"
    first, second = f"{work}/rt_pp{pp}dp{dp}_a", f"{work}/rt_pp{pp}dp{dp}_b"
    if not (harness.reshard(report, ucp, SOURCE, f"pp={pp},dp={dp}", first, what) and
            harness.reshard(report, ucp, f"{first}/{TAG}", "pp=2,dp=2", second, what)):
        continue
    names = harness.files_under(SOURCE)
    report.check(harness.files_under(f"{second}/{TAG}") == names, f"{what}: files")
    for name in names:
        report.diffs(harness.compare_files(f"{SOURCE}/{name}", f"{second}/{TAG}/{name}"),
                     f"{what}: {name}")

parent = harness.fresh_dir(f"{work}/export")
out = f"{parent}/{TAG}_universal"
status, _, err = harness.run_ucp(ucp, "export", SOURCE, "--format", "deepspeed-universal", "--out",
                                 out)
if report.check(status == 0, f"export: exit {status}: {err}"):
    expected = f"{SOURCE}_universal"
    names = harness.files_under(expected)
    report.check(harness.files_under(out) == names, "export: files differ from DeepSpeed's")
    for name in names:
        report.diffs(harness.compare_files(f"{expected}/{name}", f"{out}/{name}"), f"export/{name}")
    report.check(harness.read_bytes(f"{parent}/latest_universal") ==
                 harness.read_bytes(f"{CFG}/pp2dp2/latest_universal"), "export: latest_universal")
report.exit()

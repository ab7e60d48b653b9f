"""`ucp` on the 3D fixtures (TP=2 x PP=2 x DP=2, DeepSpeed v0.14.5): 3d_z1_fp32 (ZeRO-1 fp32) and
3d_bf16 (bf16 at ZeRO stage 0: DeepSpeed's BF16 optimizer, as BLOOM ran), both with the word
embedding tied to the output layer (TiedLayerSpec on the first and the last stage).

  check_3d.py UCP FIXTURES WORKDIR

`ucp export --format deepspeed-universal` must write ds_to_universal's files: every parameter
merged over TP by universal_checkpoint_info's rules, the pipeline-replicated tied parameters taken
from the first stage (the last stage's never-used position-embedding copy differs and is not
read), the vocabulary cut to its 67 real rows, zero/optimizer_state.pt and the four model-states
copies, every object and tensor bit-identical. Resharding a 3D tag is not implemented yet and must
be refused naming the reason; a tag missing one layer file must be refused naming that file.
"""

import os
import shutil
import sys

import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_3d")
TAG = "global_step5"

for config in ("3d_z1_fp32", "3d_bf16"):
    source = f"{fixtures}/{config}/tp2pp2dp2"
    parent = harness.fresh_dir(f"{work}/{config}_universal")
    out = f"{parent}/{TAG}_universal"
    status, _, err = harness.run_ucp(ucp, "export", f"{source}/{TAG}", "--format",
                                     "deepspeed-universal", "--out", out)
    if report.check(status == 0, f"{config}: ucp export exit {status}: {err}"):
        expected = f"{source}/{TAG}_universal"
        names = harness.files_under(expected)
        report.check(len(names) > 200, f"{config}: {len(names)} files in DeepSpeed's export")
        report.check(harness.files_under(out) == names,
                     f"{config}: files {sorted(set(harness.files_under(out)) ^ set(names))} differ")
        for name in names:
            report.diffs(harness.compare_files(f"{expected}/{name}", f"{out}/{name}"),
                         f"{config}/{name}")

    save_dir = harness.fresh_dir(f"{work}/{config}_reshard")
    status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to", "tp=2,pp=2,dp=1",
                                     "--out", save_dir)
    report.check(status != 0 and "pipeline tag with tensor parallelism" in err,
                 f"{config}: reshard not refused as not supported yet: exit {status}: {err}")

# A layer file missing: refused, naming it.
copy = harness.fresh_dir(f"{work}/missing_layer") + f"/{TAG}"
shutil.copytree(f"{fixtures}/3d_z1_fp32/tp2pp2dp2/{TAG}", copy)
os.remove(f"{copy}/layer_03-model_01-model_states.pt")
status, _, err = harness.run_ucp(ucp, "export", copy, "--format", "deepspeed-universal", "--out",
                                 f"{work}/missing_layer/out")
report.check(status != 0 and "layer_03-model_01-model_states.pt" in err,
             f"missing layer file not named: exit {status}: {err}")

report.exit()

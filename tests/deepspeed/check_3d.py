"""`ucp` on the 3D fixtures (TP=2 x PP=2 x DP=2, DeepSpeed v0.14.5): 3d_z1_fp32 (ZeRO-1 fp32) and
3d_bf16 (bf16 at ZeRO stage 0: DeepSpeed's BF16 optimizer, as BLOOM ran), both with the word
embedding tied to the output layer (TiedLayerSpec on the first and the last stage).

  check_3d.py UCP FIXTURES WORKDIR

`ucp export --format deepspeed-universal` must write ds_to_universal's files: every parameter
merged over TP by universal_checkpoint_info's rules, the pipeline-replicated tied parameters taken
from the first stage (the last stage's never-used position-embedding copy differs and is not
read), the vocabulary cut to its 67 real rows, zero/optimizer_state.pt and the four model-states
copies, every object and tensor bit-identical. `ucp reshard` to tp2pp2dp1, tp1pp2dp2, tp2pp1dp2,
tp1pp1dp2 and tp2pp2dp2 must write DeepSpeed's own resaves there (where DeepSpeed has none, the
export of ucp's files must hold the source's atoms), through tp1pp2dp1 and back the same-size
resave, and from DeepSpeed's pp=4 resave back to pp=2; pp=4 from pp=2 is refused as ambiguous,
pp=2 from ucp's pp=1 files naming the tied module (its copy on the last stage is not shown). A
tag missing one layer file must be refused naming that file, and one whose layer files hold a
frozen parameter split over the TP ranks naming it.
"""

import os
import shutil
import sys

import torch

import ds_objects
import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_3d")
TAG = "global_step5"
# train_3d.py keeps the global batch: its micro batch is the new run's, like DeepSpeed's.
RUN_CONFIG_FIELDS = harness.RUN_CONFIG_FIELDS + ("args.micro_batch_size",)



def compare_tags(case, save_dir, expected):
    harness.compare_resaved(report, case, save_dir, expected, TAG, RUN_CONFIG_FIELDS)


checked_without_resave = []
for config in ("3d_z1_fp32", "3d_bf16"):
    source = f"{fixtures}/{config}/tp2pp2dp2"
    parent = harness.fresh_dir(f"{work}/{config}_universal")
    out = f"{parent}/{TAG}_universal"
    status, _, err = harness.run_ucp(ucp, "export", f"{source}/{TAG}", "--format",
                                     "deepspeed-universal", "--out", out)
    if report.check(status == 0, f"{config}: ucp export exit {status}: {err}"):
        names = harness.compare_export(report, config, f"{source}/{TAG}_universal", out)
        report.check(len(names) > 200, f"{config}: {len(names)} files in DeepSpeed's export")

    for tp, pp, dp in ((2, 2, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 1, 2)):
        case = f"tp{tp}pp{pp}dp{dp}_from_tp2pp2dp2"
        expected = f"{fixtures}/{config}/resaved/{case}/{TAG}"
        save_dir = harness.fresh_dir(f"{work}/{config}_{case}")
        status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to",
                                         f"tp={tp},pp={pp},dp={dp}", "--out", save_dir)
        if not report.check(status == 0, f"{config} {case}: ucp reshard exit {status}: {err}"):
            continue
        if os.path.isdir(expected):
            compare_tags(f"{config} {case}", save_dir, expected)
            continue
        # No resave of DeepSpeed's at this size: the atoms must survive, the export of ucp's
        # files holding DeepSpeed's universal zero/<param>/ files of the source bit for bit.
        checked_without_resave.append(f"{config} {case}")
        out = f"{save_dir}/universal"
        status, _, err = harness.run_ucp(ucp, "export", f"{save_dir}/{TAG}", "--format",
                                         "deepspeed-universal", "--out", out)
        if report.check(status == 0, f"{config} {case}: ucp export exit {status}: {err}"):
            universal = f"{source}/{TAG}_universal"
            params = [n for n in harness.files_under(universal)
                      if n.startswith("zero/") and n != "zero/optimizer_state.pt"]
            report.check(len(params) == 52 * 4, f"{config}: {len(params)} zero/<param> files")
            for name in params:
                expected_atom = ds_objects.load(f"{universal}/{name}")
                atom = ds_objects.load(f"{out}/{name}")
                if isinstance(expected_atom, dict) and expected_atom.get("vocab_tensor"):
                    # The vocabulary's storage keeps the padding rows of the tag's TP degree.
                    expected_atom["param"] = expected_atom["param"].clone()
                    atom["param"] = atom["param"].clone()
                report.diffs(ds_objects.compare(expected_atom, atom),
                             f"{config} {case} export/{name}")

    # Through ucp alone and back: tp2pp2dp2 -> tp1pp2dp1 -> tp2pp2dp2 gives DeepSpeed's own
    # same-size resave (the last stage's tied position embeddings now stage 0's, as DeepSpeed's
    # universal load leaves them); and from DeepSpeed's TP=1 resave (vocabulary padded to 68)
    # back to TP=2 (72) the same.
    control = f"{fixtures}/{config}/resaved/tp2pp2dp2_from_tp2pp2dp2/{TAG}"
    middle = harness.fresh_dir(f"{work}/{config}_round_trip_tp1pp2dp1")
    status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to",
                                     "tp=1,pp=2,dp=1", "--out", middle)
    for case, start in (("round trip through tp1pp2dp1", f"{middle}/{TAG}"),
                        ("from DeepSpeed's tp1pp2dp2 resave",
                         f"{fixtures}/{config}/resaved/tp1pp2dp2_from_tp2pp2dp2/{TAG}")):
        back = harness.fresh_dir(f"{work}/{config}_{case.replace(' ', '_')}")
        status, _, err = harness.run_ucp(ucp, "reshard", start, "--to", "tp=2,pp=2,dp=2",
                                         "--out", back)
        if report.check(status == 0, f"{config} {case}: ucp reshard exit {status}: {err}"):
            compare_tags(f"{config} {case}", back, control)

    # pp=4 from pp=2: 'uniform' [0, 4, 8] and 'parameters' both give the saved stages (8 layers:
    # the LM head tied to the embedding is a ninth, past the last visible one) but differ at pp 4,
    # and the trainer's 'type:transformer' is in no file: refused as ambiguous.
    save_dir = harness.fresh_dir(f"{work}/{config}_pp4")
    status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to", "tp=1,pp=4,dp=2",
                                     "--out", save_dir)
    report.check(status != 0 and "ambiguous layer placement" in err and
                 "partition=uniform, parameters or type" in err,
                 f"{config}: pp=4 not refused as ambiguous: exit {status}: {err}")
    # Told the trainer's method (its 'type:transformer', or 'parameters', which agree there): the
    # files of DeepSpeed's own pp=4 resave ([0, 3, 4, 5, 8]), where the fixture has one.
    pp4_resave = f"{fixtures}/{config}/resaved/tp1pp4dp2_from_tp2pp2dp2/{TAG}"
    for partition in ("type", "parameters") if os.path.isdir(pp4_resave) else ():
        save_dir = harness.fresh_dir(f"{work}/{config}_pp4_{partition}")
        status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to",
                                         f"tp=1,pp=4,dp=2,partition={partition}", "--out",
                                         save_dir)
        if report.check(status == 0, f"{config} pp=4 partition={partition}: exit {status}: {err}"):
            compare_tags(f"{config} tp1pp4dp2 partition={partition}", save_dir,
                         pp4_resave)
    status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to",
                                     "tp=1,pp=4,dp=2,partition=bogus", "--out",
                                     harness.fresh_dir(f"{work}/{config}_pp4_bogus"))
    report.check(status != 0 and "partition=bogus: expected uniform, parameters or type" in err,
                 f"{config}: partition=bogus not refused as expected: exit {status}: {err}")
    # pp=2 from a pp=1 tag (ucp's tp1pp1dp2 files): the tied embedding's use by the LM head has
    # no layer file and no copy there, so nothing shows that the last stage holds one at pp 2:
    # refused, naming the tied module, rather than written without the last stage's copy.
    pp1 = harness.fresh_dir(f"{work}/{config}_pp1")
    status, _, err = harness.run_ucp(ucp, "reshard", f"{source}/{TAG}", "--to", "tp=1,pp=1,dp=2",
                                     "--out", pp1)
    if report.check(status == 0, f"{config}: reshard to tp1pp1dp2 exit {status}: {err}"):
        status, _, err = harness.run_ucp(ucp, "index", f"{pp1}/{TAG}")
        report.check(status == 0, f"{config}: ucp index of tp1pp1dp2 exit {status}: {err}")
        status, _, err = harness.run_ucp(ucp, "reshard", f"{pp1}/{TAG}", "--to", "tp=1,pp=2,dp=2",
                                         "--out", harness.fresh_dir(f"{work}/{config}_pp1_pp2"))
        report.check(status != 0 and 'tied module "' in err and "saved at pp=1" in err,
                     f"{config}: pp=2 from pp=1 not refused naming the tied module: exit "
                     f"{status}: {err}")
    # From DeepSpeed's own pp=4 resave ([0, 3, 4, 5, 8]: only 'parameters' and the transformer
    # layers' kind give it, and they agree at pp 2) back to pp 2: DeepSpeed's resaves there.
    pp4 = f"{fixtures}/{config}/resaved/tp1pp4dp2_from_tp2pp2dp2/{TAG}"
    if os.path.isdir(pp4):
        for tp in (1, 2):
            case = f"tp{tp}pp2dp2_from_DeepSpeed's_tp1pp4dp2"
            save_dir = harness.fresh_dir(f"{work}/{config}_tp{tp}pp2dp2_from_tp1pp4dp2")
            status, _, err = harness.run_ucp(ucp, "reshard", pp4, "--to", f"tp={tp},pp=2,dp=2",
                                             "--out", save_dir)
            if report.check(status == 0, f"{config} {case}: ucp reshard exit {status}: {err}"):
                compare_tags(f"{config} {case}", save_dir,
                             f"{fixtures}/{config}/resaved/tp{tp}pp2dp2_from_tp2pp2dp2/{TAG}")

# A layer file missing: refused, naming it.
copy = harness.fresh_dir(f"{work}/missing_layer") + f"/{TAG}"
shutil.copytree(f"{fixtures}/3d_z1_fp32/tp2pp2dp2/{TAG}", copy)
os.remove(f"{copy}/layer_03-model_01-model_states.pt")
status, _, err = harness.run_ucp(ucp, "export", copy, "--format", "deepspeed-universal", "--out",
                                 f"{work}/missing_layer/out")
report.check(status != 0 and "layer_03-model_01-model_states.pt" in err,
             f"missing layer file not named: exit {status}: {err}")
# A frozen parameter (in the layer files, not in param_shapes) whose TP slices differ: a reshard
# would carry TP rank 0's to every TP rank, so it is refused, naming it.
copy = harness.fresh_dir(f"{work}/frozen_split") + f"/{TAG}"
shutil.copytree(f"{fixtures}/3d_z1_fp32/tp2pp2dp2/{TAG}", copy)
for t in (0, 1):
    layer = f"{copy}/layer_02-model_{t:02d}-model_states.pt"
    states = ds_objects.load(layer)
    states["frozen.weight"] = torch.full((3, 2), float(t))
    ds_objects.save(states, layer)
status, _, err = harness.run_ucp(ucp, "index", copy)
report.check(status != 0 and "layer_02-model_01-model_states.pt: frozen.weight: not a trained "
             "parameter" in err, f"a frozen split layer entry not refused: exit {status}: {err}")
print(f"without a DeepSpeed resave (checked by their atoms): {checked_without_resave}")

report.exit()

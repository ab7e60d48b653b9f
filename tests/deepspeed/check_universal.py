"""`ucp export --format deepspeed-universal` against DeepSpeed's own ds_to_universal output.

  check_universal.py UCP FIXTURES WORKDIR CFG...

For each CFG and DP size (dp4, dp2): exports <CFG>/<dp>/global_step5 to
WORKDIR/<CFG>_<dp>/global_step5_universal and requires, against the fixture's
global_step5_universal: the same files; every .pt equal object by object and tensor by tensor,
bit for bit (dict structure and key order, cat_dim, optimizer_state.pt, step); the model-state
files byte-identical copies; latest_universal beside the output holding the folder's name; no
temporary left.
"""

import os
import sys

import harness

ucp, fixtures, work, configs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
report = harness.Report("check_universal")

for cfg in configs:
    for dp in ("dp4", "dp2"):
        source = f"{fixtures}/{cfg}/{dp}"
        parent = harness.fresh_dir(f"{work}/{cfg}_{dp}")
        out = f"{parent}/global_step5_universal"
        status, _, err = harness.run_ucp(ucp, "export", f"{source}/global_step5", "--format",
                                         "deepspeed-universal", "--out", out)
        if not report.check(status == 0, f"{cfg}/{dp}: ucp export exit {status}: {err}"):
            continue
        expected = f"{source}/global_step5_universal"
        names = harness.files_under(expected)
        report.check(harness.files_under(out) == names,
                     f"{cfg}/{dp}: files {sorted(set(harness.files_under(out)) ^ set(names))} "
                     "differ from DeepSpeed's")
        report.check(harness.files_under(parent) ==
                     sorted(["latest_universal"] + [f"global_step5_universal/{n}" for n in names]),
                     f"{cfg}/{dp}: nothing else beside the output: {harness.files_under(parent)}")
        for name in names:
            if name.endswith("model_states.pt") and os.path.exists(f"{out}/{name}"):
                report.check(harness.read_bytes(f"{expected}/{name}") ==
                             harness.read_bytes(f"{out}/{name}"), f"{cfg}/{dp}/{name}: a copy")
            report.diffs(harness.compare_files(f"{expected}/{name}", f"{out}/{name}"),
                         f"{cfg}/{dp}/{name}")
        report.check(harness.read_bytes(f"{parent}/latest_universal") ==
                     harness.read_bytes(f"{source}/latest_universal"),
                     f"{cfg}/{dp}: latest_universal")
        report.check(not harness.temp_leftovers(parent), f"{cfg}/{dp}: temporaries left")
report.exit()

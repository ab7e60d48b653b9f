"""`ucp index`, `ucp inspect TAGDIR`, `ucp verify`, and reshard with the tag's own index, on a
writable copy of z2_fp32_odd/dp4/global_step5.

  check_cli.py UCP FIXTURES WORKDIR

The index is checked against facts read independently: the files and their sizes from the
directory, XXH3-64 from xxhsum (when installed), atom shapes and group order from param_shapes
(loaded with the DeepSpeed stand-ins), the topology from the fixture's names. verify must pass on
the untouched copy, then exit 3 naming a file with one flipped byte, and a deleted file too. A
stale index (another tag's) must not be trusted: reshard still gives DeepSpeed's own files.
With a terminal on stderr, reshard draws its progress line.
"""

import json
import os
import pty
import shutil
import subprocess
import sys

import ds_objects
import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_cli")
harness.fresh_dir(work)
CFG = "z2_fp32_odd"
tag = harness.copy_tag(f"{fixtures}/{CFG}/dp4/global_step5", f"{work}/tag/global_step5")
names = harness.files_under(tag)
index_path = f"{tag}/.ucp/index.json"

status, out, err = harness.run_ucp(ucp, "verify", tag)
report.check(status == 1 and "index" in err, f"verify without an index: exit {status}: {err}")

status, out, err = harness.run_ucp(ucp, "index", tag, "--threads", "2")
report.check(status == 0 and len(out.strip().splitlines()) == 1,
             f"index: exit {status}, one summary line: {out!r} {err}")
with open(index_path, "rb") as f:
    first_bytes = f.read()
index = json.loads(first_bytes)
report.check(index["format"] == "ucp-atom-index" and index["version"] == 3, "index format")
for entry in index["files"]:
    chunk_bytes = entry.get("chunk_bytes", 0)
    count = -(-entry["size"] // chunk_bytes) if chunk_bytes else -1
    # Every fixture file is under one chunk: its one chunk hash is its whole hash.
    report.check(chunk_bytes == 1 << 20 and entry["chunks"] == entry["xxh3"] and count == 1,
                 f"{entry['path']}: chunk hashes {chunk_bytes} {entry.get('chunks')!r}")
report.check(index["tag"] == "global_step5", f"index tag {index['tag']}")
report.check(index["framework"] == {"name": "deepspeed", "version": "0.14.5"},
             f"framework {index['framework']}")
topology = index["topology"]
report.check((topology["dp"], topology["tp"], topology["pp"], topology["world"],
              topology["zero_stage"]) == (4, 1, 1, 4, 2), f"topology {topology}")
report.check(sorted(f["path"] for f in index["files"]) == names,
             f"indexed files {[f['path'] for f in index['files']]}")
xxhsum = shutil.which("xxhsum")
for entry in index["files"]:
    path = f"{tag}/{entry['path']}"
    if not os.path.exists(path):
        continue
    report.check(entry["size"] == os.path.getsize(path), f"{entry['path']}: size")
    if xxhsum:
        digest = subprocess.run([xxhsum, "-H3", path], capture_output=True, text=True,
                                check=True).stdout.split("=")[-1].strip()
        report.check(entry["xxh3"] == digest, f"{entry['path']}: xxh3 {entry['xxh3']} vs {digest}")

model = ds_objects.load(f"{tag}/mp_rank_00_model_states.pt")
shapes = model["param_shapes"][0]
atoms = {(a["param"], a["state"]): a for a in index["atoms"]}
for param, shape in shapes.items():
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        atom = atoms.get((param, state))
        report.check(atom is not None and atom["shape"] == list(shape) and
                     atom["dtype"] == "float32", f"atom ({param}, {state}): {atom and atom['shape']}")
report.check(len(index["groups"]) == 1 and index["groups"][0]["params"] == list(shapes),
             "group params in param_shapes order")
report.check(index["groups"][0]["hyperparameters"].get("lr") == 0.003, "group lr")

status, out, err = harness.run_ucp(ucp, "index", tag)
with open(index_path, "rb") as f:
    report.check(status == 0 and f.read() == first_bytes, "index again: the same bytes")
report.check(os.listdir(f"{tag}/.ucp") == ["index.json"], f".ucp holds {os.listdir(f'{tag}/.ucp')}")

status, out, err = harness.run_ucp(ucp, "inspect", tag, "--json")
if report.check(status == 0, f"inspect --json: exit {status}: {err}"):
    shown = json.loads(out)
    report.check(shown["framework"] == index["framework"] and shown["adapter"] == index["adapter"]
                 and shown["topology"] == index["topology"], "inspect: framework and topology")
    report.check(sorted((a["param"], a["state"]) for a in shown["atoms"]) == sorted(atoms),
                 "inspect: atoms")
    for atom in shown["atoms"]:
        own = atoms.get((atom["param"], atom["state"]))
        report.check(own is not None and atom["shape"] == own["shape"] and atom["dtype"] ==
                     own["dtype"] and atom["fragments"] == len(own["fragments"]),
                     f"inspect: atom {atom}")
    report.check(shown["files"]["count"] == len(names) and shown["files"]["bytes"] ==
                 sum(os.path.getsize(f"{tag}/{n}") for n in names), f"inspect: {shown['files']}")
    report.check([g["params"] for g in shown["groups"]] == [g["params"] for g in index["groups"]],
                 "inspect: groups")
status, out, err = harness.run_ucp(ucp, "inspect", tag)
report.check(status == 0 and "blocks.1.fc2.weight" in out and "exp_avg_sq" in out and
             "dp=4" in out, f"inspect (table): exit {status}: {err}")


for what, config in (("with_index", CFG), ("stale_index", "z1_fp32")):
    source = tag
    if what == "stale_index":
        source = harness.copy_tag(f"{fixtures}/{config}/dp4/global_step5",
                                  f"{work}/stale/global_step5")
        os.makedirs(f"{source}/.ucp")
        shutil.copyfile(index_path, f"{source}/.ucp/index.json")
    save = harness.fresh_dir(f"{work}/{what}")
    status, _, err = harness.run_ucp(ucp, "reshard", source, "--to", "dp=2", "--out", save)
    if not report.check(status == 0, f"{what}: reshard exit {status}: {err}"):
        continue
    expected = f"{fixtures}/{config}/resaved/dp2_from_dp4/global_step5"
    for name in harness.files_under(expected):
        report.diffs(harness.compare_files(f"{expected}/{name}", f"{save}/global_step5/{name}",
                                           harness.RUN_CONFIG_FIELDS,
                                           harness.UNORDERED_IN_RESAVES), f"{what}: {name}")

# A terminal on stderr gets the progress line (every other run here, stderr a pipe, must show
# nothing but errors: check_errors.py requires exactly one stderr line).
controller, terminal = pty.openpty()
proc = subprocess.run([ucp, "reshard", tag, "--to", "dp=1", "--out", f"{work}/tty"],
                      stdout=subprocess.PIPE, stderr=terminal, timeout=300)
os.close(terminal)
drawn = b""
while True:
    try:
        chunk = os.read(controller, 4096)
    except OSError:
        break
    if not chunk:
        break
    drawn += chunk
os.close(controller)
report.check(proc.returncode == 0 and b"\rucp reshard: 100%" in drawn.replace(b"\x1b[K", b""),
             f"progress on a terminal: exit {proc.returncode}, drew {drawn!r}")

status, out, err = harness.run_ucp(ucp, "verify", tag)
report.check(status == 0, f"verify: exit {status}: {out} {err}")
flipped = "zero_pp_rank_2_mp_rank_00_optim_states.pt"
with open(f"{tag}/{flipped}", "r+b") as f:
    f.seek(os.path.getsize(f"{tag}/{flipped}") // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x40]))
status, out, err = harness.run_ucp(ucp, "verify", tag)
report.check(status == 3 and flipped in out + err, f"verify, flipped byte: exit {status}: {out}{err}")
deleted = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
os.remove(f"{tag}/{deleted}")
status, out, err = harness.run_ucp(ucp, "verify", tag)
report.check(status == 3 and flipped in out + err and deleted in out + err,
             f"verify, flipped and deleted: exit {status}: {out}{err}")
report.exit()

"""Untrusted and damaged tags: nothing outside the tag is read, no damaged byte is served.

  check_untrusted.py UCP FIXTURES WORKDIR

Every case is a copy of z1_fp32/dp4/global_step5 indexed by `ucp index`, then changed:
  - a rank file replaced by a symlink leaving the tag (absolute, relative) to a byte-identical
    copy: `ucp verify`, `reshard` and both exports refuse it, naming the file; a symlink that
    stays inside the tag is followed;
  - one byte flipped in the rank file's zip headers, in its pickle, in its fp32 partition: verify
    reports the file and what its CRC-32s locate (the tensor, derived here from the file's own
    param_slice_mappings), reshard and exports refuse it, naming the file, and write nothing;
  - one digit of index.json changed so that it still parses and validates: the index's checksum
    refuses it; verify says so and reshard builds a fresh index from the files, writing exactly
    what it writes from an intact copy.
"""

import os
import shutil
import sys
import zipfile

import ds_objects
import harness

ucp, fixtures, work = sys.argv[1], sys.argv[2], sys.argv[3]
report = harness.Report("check_untrusted")
harness.fresh_dir(work)
SOURCE = f"{fixtures}/z1_fp32/dp4/global_step5"
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
INPUT, MISMATCH = 1, 3


def indexed_copy(name):
    tag = harness.copy_tag(SOURCE, f"{work}/{name}/global_step5")
    code, _, err = harness.run_ucp(ucp, "index", tag)
    report.check(code == 0, f"{name}: ucp index: exit {code}: {err}")
    return tag


def commands_refuse(what, tag, words):
    """reshard and both exports fail with one line naming every word, and write nothing."""
    out = harness.fresh_dir(f"{work}/{what}_out")
    for args in (["reshard", tag, "--to", "dp=2", "--out", out],
                 ["export", tag, "--format", "deepspeed-universal", "--out", f"{out}/u"],
                 ["export", tag, "--format", "safetensors", "--out", f"{out}/s"]):
        code, _, err = harness.run_ucp(ucp, *args)
        lines = err.strip().splitlines()
        report.check(code == INPUT and len(lines) == 1,
                     f"{what} ({args[0]}): exit {code}, one error line: {err}")
        for word in words:
            report.check(word in err, f"{what} ({args[0]}): message names {word!r}: {err}")
        report.check(not os.listdir(out), f"{what} ({args[0]}): wrote {os.listdir(out)}")


def verify_reports(what, tag, words):
    code, out, err = harness.run_ucp(ucp, "verify", tag)
    report.check(code == MISMATCH, f"{what} (verify): exit {code}, expected {MISMATCH}: {err}")
    line = next((l for l in out.splitlines() if l.startswith(RANK1 + ":")), "")
    for word in words:
        report.check(word in line, f"{what} (verify): the {RANK1} line names {word!r}: {out}")


# Symlinks that leave the tag, to a byte-identical copy: a hash check alone would pass them.
for what, target in (("absolute_symlink", lambda tag: os.path.abspath(f"{tag}/../outside.pt")),
                     ("relative_symlink", lambda tag: "../outside.pt")):
    tag = indexed_copy(what)
    shutil.move(f"{tag}/{RANK1}", f"{tag}/../outside.pt")
    os.symlink(target(tag), f"{tag}/{RANK1}")
    verify_reports(what, tag, ["refused"])
    commands_refuse(what, tag, [RANK1, "refused"])

tag = indexed_copy("inside_symlink")
os.makedirs(f"{tag}/moved")
shutil.move(f"{tag}/{RANK1}", f"{tag}/moved/{RANK1}")
os.symlink(f"moved/{RANK1}", f"{tag}/{RANK1}")
code, out, err = harness.run_ucp(ucp, "verify", tag)
report.check(code == 0, f"inside_symlink (verify): exit {code}: {out} {err}")


def record_data_offset(path, suffix):
    """(name, first data byte, size) of the record of `path` whose name ends with `suffix`."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        header = f.read(4)
    name_length = int.from_bytes(header[0:2], "little")
    extra_length = int.from_bytes(header[2:4], "little")
    return info.filename, info.header_offset + 30 + name_length + extra_length, info.file_size


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


def fp32_partition_offset(path):
    """(file offset of the middle element of rank 1's fp32 partition, the parameter holding it),
    from the file's own bytes and param_slice_mappings."""
    optim = ds_objects.load(path)["optimizer_state_dict"]
    partition = optim["single_partition_of_fp32_groups"][0].detach()
    data = harness.read_bytes(path)
    start = data.find(partition.numpy().tobytes())
    report.check(start > 0 and data.count(partition.numpy().tobytes()) == 1,
                 "the fp32 partition's bytes are found once in the file")
    middle = partition.numel() // 2
    for name, address in optim["param_slice_mappings"][0].items():
        if address.start <= middle < address.start + address.numel:
            return start + 4 * middle, name
    raise AssertionError("no parameter holds the middle of the partition")


tag = indexed_copy("zip_header")
flip(f"{tag}/{RANK1}", 0)
verify_reports("zip_header", tag, ["xxh3", "zip structure"])
commands_refuse("zip_header", tag, [RANK1])

tag = indexed_copy("pickle")
record, start, size = record_data_offset(f"{tag}/{RANK1}", "data.pkl")
flip(f"{tag}/{RANK1}", start + size // 2)
verify_reports("pickle", tag, [f"record {record} fails its CRC-32", "the pickle"])
commands_refuse("pickle", tag, [RANK1])

tag = indexed_copy("tensor_data")
offset, param = fp32_partition_offset(f"{tag}/{RANK1}")
flip(f"{tag}/{RANK1}", offset)
chunk = 1 << 20  # the chunk hashes' size: verify names the one chunk that differs
first = offset // chunk * chunk
last = min(first + chunk, os.path.getsize(f"{tag}/{RANK1}"))
verify_reports("tensor_data", tag,
               [f"differing bytes: [{first}, {last}) (record", "fails its CRC-32", f"fp32 of {param}"])
commands_refuse("tensor_data", tag, [RANK1, f"fp32 of {param}"])

# index.json: an offset one element further still lies within its file and still tiles, so only
# the checksum can tell.
tag = indexed_copy("index")
index_path = f"{tag}/.ucp/index.json"
text = open(index_path).read()
at = text.index('"offset": ') + len('"offset": ')
digits = text[at:text.index(",", at)]
changed = text[:at] + str(int(digits) + 4) + text[at + len(digits):]
open(index_path, "w").write(changed)
code, _, err = harness.run_ucp(ucp, "verify", tag)
report.check(code == INPUT and "checksum" in err and "index.json" in err,
             f"index (verify): exit {code}, names index.json and its checksum: {err}")
intact = harness.fresh_dir(f"{work}/index_intact_out")
damaged = harness.fresh_dir(f"{work}/index_damaged_out")
code_intact, _, err_intact = harness.run_ucp(ucp, "reshard", SOURCE, "--to", "dp=2", "--out",
                                             intact)
code, _, err = harness.run_ucp(ucp, "reshard", tag, "--to", "dp=2", "--out", damaged)
report.check(code == 0 and code_intact == 0, f"index (reshard): exit {code}: {err} {err_intact}")
report.check(harness.files_under(intact) == harness.files_under(damaged) and
             all(harness.read_bytes(f"{intact}/{n}") == harness.read_bytes(f"{damaged}/{n}")
                 for n in harness.files_under(intact)),
             "index (reshard): the output equals the intact tag's")
report.exit()

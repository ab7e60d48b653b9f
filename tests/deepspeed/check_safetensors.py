"""`ucp export --format safetensors` read back with safetensors_reader against the atoms as
DeepSpeed's universal files hold them (zero/<param>/<state>.pt).

  check_safetensors.py UCP FIXTURES WORKDIR CFG...

For each CFG and DP size: --state fp32, bit16 (against the model states' module tensors; not for
ZeRO-3, whose module tensors are empty) and exp_avg (one file each, model.safetensors), and exp_avg_sq with --max-shard-size small enough to
shard (HF naming model-0000K-of-0000N.safetensors). Always
model.safetensors.index.json, whose weight_map names each tensor's file and whose
metadata.total_size is the tensor bytes; each file's __metadata__ {"format": "pt"}. Every
parameter present once, dtype, shape and bits equal.
"""

import json
import os
import re
import sys

import ds_objects
import harness
import safetensors_reader

ucp, fixtures, work, configs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
report = harness.Report("check_safetensors")
SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
MAX_SHARD_BYTES = 100000


def read_export(out, what):
    """name -> tensor of an exported folder and its shard count, checking the HF naming and the
    index file (written for one file too)."""
    names = sorted(os.listdir(out))
    with open(f"{out}/model.safetensors.index.json") as f:
        index = json.load(f)
    shards = sorted(n for n in names if n != "model.safetensors.index.json")
    if shards != ["model.safetensors"]:
        matches = [SHARD.match(n) for n in shards]
        report.check(all(matches) and [int(m.group(1)) for m in matches] ==
                     list(range(1, len(shards) + 1)) and
                     {int(m.group(2)) for m in matches} == {len(shards)},
                     f"{what}: shard names {shards}")
    tensors, total = {}, 0
    for shard in shards:
        found, metadata = safetensors_reader.read(f"{out}/{shard}")
        report.check(metadata == {"format": "pt"}, f"{what}: {shard} metadata {metadata}")
        shard_bytes = sum(t.numel() * t.element_size() for t in found.values())
        report.check(shard_bytes <= MAX_SHARD_BYTES or len(found) == 1 or len(shards) == 1,
                     f"{what}: {shard} holds {shard_bytes} bytes")
        for name, tensor in found.items():
            report.check(name not in tensors, f"{what}: {name} in two shards")
            report.check(index["weight_map"].get(name) == shard,
                         f"{what}: weight_map[{name}] = {index['weight_map'].get(name)}, in {shard}")
            tensors[name] = tensor
            total += tensor.numel() * tensor.element_size()
    report.check(set(index["weight_map"]) == set(tensors), f"{what}: weight_map names")
    report.check(index["metadata"]["total_size"] == total,
                 f"{what}: total_size {index['metadata']['total_size']} vs {total}")
    return tensors, len(shards)


def expected_tensors(tag, zero, params, state):
    """The atoms of `state` as DeepSpeed holds them: zero/<param>/<state>.pt of its universal
    export, or for bit16 the module tensors of the model states (the weights the model runs with:
    bf16 in bf16 runs, fp32 otherwise)."""
    model = ds_objects.load(f"{tag}/{harness.model_states_name(tag)}")
    if state == "bit16":
        return {param: model["module"][param] for param in params}
    # ZeRO-3's universal files hold bare flat tensors: shaped by param_shapes.
    shapes = {name: shape for group in model["param_shapes"] for name, shape in group.items()}
    out = {}
    for param in params:
        saved = ds_objects.load(f"{zero}/{param}/{state}.pt")
        out[param] = saved["param"] if isinstance(saved, dict) else saved.reshape(shapes[param])
    return out


for cfg in configs:
    for dp in ("dp4", "dp2"):
        tag = f"{fixtures}/{cfg}/{dp}/global_step5"
        zero = f"{fixtures}/{cfg}/{dp}/global_step5_universal/zero"
        params = sorted(n for n in os.listdir(zero) if os.path.isdir(f"{zero}/{n}"))
        zero3 = harness.model_states_name(tag).startswith("zero_pp_rank_")
        for state, shard in (("fp32", None), ("bit16", None), ("exp_avg", None),
                             ("exp_avg_sq", MAX_SHARD_BYTES)):
            if zero3 and state == "bit16":
                continue  # ZeRO-3 module tensors are empty placeholders
            what = f"{cfg}/{dp} {state}"
            out = f"{work}/{cfg}_{dp}_{state}"
            harness.fresh_dir(work)
            args = ["export", tag, "--format", "safetensors", "--state", state, "--out", out]
            if shard:
                args += ["--max-shard-size", str(shard)]
            status, _, err = harness.run_ucp(ucp, *args)
            if not report.check(status == 0, f"{what}: ucp export exit {status}: {err}"):
                continue
            tensors, shards = read_export(out, what)
            report.check(shards > 1 if shard else shards == 1, f"{what}: {shards} shards")
            report.check(sorted(tensors) == params, f"{what}: names {sorted(tensors)}")
            for param, expected in expected_tensors(tag, zero, params, state).items():
                mine = tensors.get(param)
                report.check(mine is not None and
                             not ds_objects.compare(expected.detach().clone(), mine),
                             f"{what}: {param} differs")
            report.check(not harness.temp_leftovers(work), f"{what}: temporaries left")
report.exit()

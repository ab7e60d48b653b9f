"""The comparison the other checks rely on, checked against DeepSpeed's own files.

  check_checker.py FIXTURES WORKDIR

DeepSpeed's dp4_from_dp4 control resave equals the original save except for the run-config
fields; without those allowed the comparison must name some of them and nothing else; a flipped bit, a changed
stride, storages shared differently, a changed float or an OrderedDict turned dict must each be
named; a file saved by ds_objects.save with the stand-ins loads back equal (and so do the
fragment_address, LossScaler and ZeroStageEnum objects in it).
"""

import collections
import os
import sys

import torch

import ds_objects
import harness

fixtures, work = sys.argv[1], sys.argv[2]
report = harness.Report("check_checker")
harness.fresh_dir(work)

for cfg in ("z1_fp32", "z2_bf16", "z1_bf16_bf16opt", "z2_fp32_odd"):
    original = f"{fixtures}/{cfg}/dp4/global_step5"
    control = f"{fixtures}/{cfg}/resaved/dp4_from_dp4/global_step5"
    report.check(harness.files_under(original) == harness.files_under(control),
                 f"{cfg}: control has the original's files")
    for name in harness.files_under(original):
        a, b = f"{original}/{name}", f"{control}/{name}"
        report.diffs(harness.compare_files(a, b, harness.RUN_CONFIG_FIELDS,
                                           harness.UNORDERED_IN_RESAVES), f"{cfg}/{name}")
        strict = harness.compare_files(a, b, unordered=harness.UNORDERED_IN_RESAVES)
        named = {diff.split(":")[0] for diff in strict}
        report.check(named and named <= set(harness.RUN_CONFIG_FIELDS),
                     f"{cfg}/{name}: strict comparison names run-config fields, got {strict}")

source = f"{fixtures}/z1_fp32_odd/dp4/global_step5"
optim = ds_objects.load(f"{source}/zero_pp_rank_3_mp_rank_00_optim_states.pt")
model = ds_objects.load(f"{source}/mp_rank_00_model_states.pt")


def mutated(obj, change):
    copy = ds_objects.load(obj)
    change(copy)
    return copy


def flip_bit(state):
    state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"].view(
        torch.int32)[5] ^= 1


def flip_padding(state):
    # The stripped padding: beyond the tensor, inside its storage.
    tensor = state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    torch.empty(0).set_(tensor.storage())[-1] = 1.0


def unshare(state):
    module = state["module"]
    module["wte.weight"] = module["wte.weight"].clone()


def change_float(state):
    state["ds_config"]["optimizer"]["params"]["eps"] = 1.0000000000000002e-08


def to_dict(state):
    state["param_shapes"][0] = dict(state["param_shapes"][0])


def change_mapping(state):
    mapping = state["optimizer_state_dict"]["param_slice_mappings"][0]
    next(iter(mapping.values())).start += 1


cases = [
    ("zero_pp_rank_3_mp_rank_00_optim_states.pt", flip_bit, "exp_avg: 1 of"),
    ("zero_pp_rank_3_mp_rank_00_optim_states.pt", flip_padding, "outside the tensor"),
    ("zero_pp_rank_3_mp_rank_00_optim_states.pt", change_mapping, "param_slice_mappings.0."),
    ("mp_rank_00_model_states.pt", unshare, "module.wte.weight: storage"),
    ("mp_rank_00_model_states.pt", change_float, "ds_config.optimizer.params.eps"),
    ("mp_rank_00_model_states.pt", to_dict, "param_shapes.0: type OrderedDict vs dict"),
]
for name, change, expected in cases:
    original = ds_objects.load(f"{source}/{name}")
    diffs = ds_objects.compare(original, mutated(f"{source}/{name}", change))
    report.check(diffs and expected in diffs[0], f"{change.__name__}: named as '{expected}', got {diffs}")

for name in ("zero_pp_rank_3_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"):
    saved = os.path.join(work, name)
    ds_objects.save(ds_objects.load(f"{source}/{name}"), saved)
    report.diffs(harness.compare_files(f"{source}/{name}", saved), f"save/load of {name}")
mappings = ds_objects.load(f"{work}/zero_pp_rank_3_mp_rank_00_optim_states.pt")
mapping = mappings["optimizer_state_dict"]["param_slice_mappings"][0]
report.check(isinstance(mapping, collections.OrderedDict) and all(
    isinstance(v, ds_objects.fragment_address) and set(vars(v)) == {"numel", "start"}
    for v in mapping.values()), "fragment_address round trip")
report.check(mappings["optimizer_state_dict"]["zero_stage"] is
             ds_objects.ZeroStageEnum.optimizer_states, "ZeroStageEnum round trip")
report.exit()

"""Megatron-DeepSpeed tensor-parallel checkpoints (ZeRO-1, fp32) written the way DeepSpeed v0.14.5
lays them out, without DeepSpeed.

  python3 tp_generator.py OUT_DIR

writes, from one training state of full (TP=1) tensors:
  OUT_DIR/<variant>/tp<T>dp<D>/global_step5/   mp_rank_<t>_model_states.pt and
      zero_pp_rank_<r>_mp_rank_<t>_optim_states.pt for every TP rank t < T, DP rank r < D
  OUT_DIR/full/<param>/<state>.pt               the full tensors (fp32, exp_avg, exp_avg_sq), the
      vocabulary without padding: what the atoms must hold
variants: "ok" at tp2dp2, tp1dp2, tp2dp1, tp1dp1, tp2dp3 (the reshard oracles of each other);
"ruled" at tp1dp2, tp1dp1, tp2dp2, tp2dp1, tp4dp2, tp4dp1: the same state with extra.scale named
replicated, so that its TP=1 tags can be split (each other's oracles); "uncovered" and
"averaged_differs" at tp2dp2 (tags ucp must refuse); "no_info" at tp1dp2 and tp2dp2: no
universal_checkpoint_info at all (no rules to split a TP=1 tag by; a TP tag told by its names and
its mp_world_size alone); "frozen" at tp2dp2, tp1dp2 and
tp4dp1: the "ruled" state with three frozen parameters (FROZEN), which ZeRO-1 keeps only in each TP
rank's module, each its own tensor: a row-parallel one and a column-parallel one split like the
trained ones, a norm every rank holds whole; "frozen_uncovered" at tp2dp2: those and a frozen
parameter split over the TP ranks that no rule names (a tag ucp must refuse).

The state's parameters cover every rule of universal_checkpoint_info: a vocabulary
(word_embeddings, 35 rows padded by Megatron's _vocab_size_with_padding with divisible_by 4: 36
at TP=1, 40 at TP=2, 48 at TP=4; 4 is the only power of two that gives 40 at TP=2 or 48 at TP=4,
and the largest that gives 36 at TP=1), fused QKV with sub-parameters of 8, 4, 4 rows
(parameter_with_sub_params), a SwiGLU gate/up pair of 8 + 8 rows
(parameter_with_2_sub_params_cat_dim_0), a row-parallel weight, a column-parallel one named as
Megatron names them (no pattern), replicated and averaged norms, and a parameter no rule names
whose slices are identical. TP rank t's slice: for every sub-parameter,
its t-th chunk on the split dimension, concatenated (universal_checkpoint.py's load rule);
replicated and averaged parameters whole. Per TP rank the parameters of each group, in order, make
the flat buffer that ZeRO-1 partitions over DP (padded at its end to a multiple of 2*D). The
module holds the fp32 master weights as views of one flat buffer per group.
"""

import collections
import os
import sys

import torch

import ds_objects

ORIGINAL_VOCAB = 35
DIVISIBLE_BY = 4

# name, full shape, rule: ("vocab",), ("sub", dim, sizes), ("two",), ("split", dim),
# ("replicated",), ("averaged",)
PARAMS = [
    [("word_embeddings.weight", (ORIGINAL_VOCAB, 6), ("vocab",)),
     ("layers.0.attention.query_key_value.weight", (16, 6), ("sub", 0, (8, 4, 4))),
     ("layers.0.attention.dense.weight", (6, 8), ("split", 1)),
     ("layers.0.mlp.gate_up.weight", (16, 6), ("two",)),
     ("layers.0.mlp.gate_up.bias", (16,), ("two",)),
     ("layers.0.mlp.dense_h_to_4h.weight", (12, 6), ("split", 0))],
    [("layers.0.norm.weight", (6,), ("averaged",)),
     ("final_norm.weight", (6,), ("replicated",)),
     ("extra.scale", (5,), ("replicated",))],
]
# Frozen parameters (requires_grad False: in the module alone, not in param_shapes), the rules as
# in PARAMS.
FROZEN = [("layers.1.attention.dense.weight", (6, 8), ("split", 1)),
          ("layers.1.mlp.dense_h_to_4h.weight", (12, 6), ("split", 0)),
          ("layers.1.frozen_norm.weight", (6,), ("replicated",))]
HYPER = [{"lr": 0.003, "betas": (0.9, 0.95), "eps": 1e-08, "weight_decay": 0.1},
         {"lr": 0.003, "betas": (0.9, 0.95), "eps": 1e-08, "weight_decay": 0.0}]

INFO = {
    "universal_checkpoint_version": 0.2,
    "original_vocab_size": ORIGINAL_VOCAB,
    "tp_replicated_parameter_patterns": [r"final_norm\.weight"],
    "parameter_to_average_patterns": [r"layers\.\d+\.norm\.weight"],
    "parameter_with_row_parallelism_patterns": [r"layers\.\d+\.attention\.dense\.weight"],
    "vocabulary_parameter_patterns": [r"word_embeddings\.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [r"layers\.\d+\.mlp\.gate_up\.(weight|bias)"],
    "parameter_with_sub_params": [
        {"patterns": [r"layers\.\d+\.attention\.query_key_value\.weight"],
         "shape": ((8, 4, 4), 6), "partition_dim": 0}],
}


def padded_vocab(tp):
    multiple = DIVISIBLE_BY * tp
    return (ORIGINAL_VOCAB + multiple - 1) // multiple * multiple


def make_state():
    gen = torch.Generator().manual_seed(11)
    state = {}
    for group in PARAMS:
        for name, shape, _ in group:
            state[name] = {"fp32": torch.randn(shape, generator=gen),
                           "exp_avg": torch.randn(shape, generator=gen),
                           "exp_avg_sq": torch.rand(shape, generator=gen)}
    return state


def tp_slice(full, rule, tp, t):
    kind = rule[0]
    if kind in ("replicated", "averaged"):
        return full.clone()
    if kind == "vocab":
        rows = padded_vocab(tp)
        padded = torch.zeros((rows,) + tuple(full.shape[1:]), dtype=full.dtype)
        padded[:full.shape[0]] = full
        return padded.chunk(tp, 0)[t].clone()
    if kind == "split":
        return full.chunk(tp, rule[1])[t].clone()
    if kind == "two":
        return torch.cat([half.chunk(tp, 0)[t] for half in full.chunk(2, 0)], 0)
    dim, sizes = rule[1], rule[2]
    return torch.cat([part.chunk(tp, dim)[t] for part in full.split(list(sizes), dim)], dim)


def write_tag(tag_dir, state, tp, dp, perturb=None, info=INFO, frozen=None):
    """perturb: a parameter whose TP rank 1 slices are changed (slices that differ); info: the
    client's universal_checkpoint_info (None: none saved); frozen: {name: full tensor} of FROZEN's
    parameters, each TP rank's slice in its module after the trained ones."""
    os.makedirs(tag_dir, exist_ok=True)
    # The same config at every size: ds_config is the new run's, which no resharder can know.
    ds_config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                 "zero_optimization": {"stage": 1}, "checkpoint": {"load_universal": False}}
    groups = [[p for p in group if p[0] in state] for group in PARAMS]
    for t in range(tp):
        slices = {}
        for group in groups:
            for name, _, rule in group:
                slices[name] = {key: tp_slice(value, rule, tp, t)
                                for key, value in state[name].items()}
                if name == perturb and t == 1:
                    slices[name] = {key: value + 1.0 for key, value in slices[name].items()}
        flats = {key: [] for key in ("fp32", "exp_avg", "exp_avg_sq")}
        layouts = []
        for group in groups:
            numel = sum(slices[name]["fp32"].numel() for name, _, _ in group)
            padding = (-numel) % (2 * dp)
            layouts.append((numel, padding))
            for key in flats:
                flats[key].append(torch.cat([slices[name][key].flatten() for name, _, _ in group]
                                            + [torch.zeros(padding)]))
        module = collections.OrderedDict()
        for group, flat in zip(groups, flats["fp32"]):
            offset = 0
            for name, _, _ in group:
                shape = slices[name]["fp32"].shape
                module[name] = flat.narrow(0, offset, shape.numel()).view(shape)
                offset += shape.numel()
        for name, _, rule in FROZEN if frozen else ():
            module[name] = tp_slice(frozen[name], rule, tp, t)
        model = {
            "module": module,
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": [collections.OrderedDict((name, slices[name]["fp32"].shape)
                                                     for name, _, _ in group)
                             for group in groups],
            "frozen_param_shapes": None,
            "shared_params": {},
            "frozen_param_fragments": None,
            "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
            "sparse_tensor_module_names": set(),
            "skipped_steps": 0, "global_steps": 5, "global_samples": 40,
            "dp_world_size": dp, "mp_world_size": tp,
            "ds_config": ds_config, "ds_version": "0.14.5", "my_step": 5,
            "checkpoint_version": 2.0,
        }
        if info is not None:
            model["universal_checkpoint_info"] = dict(info, padded_vocab_size=padded_vocab(tp))
        ds_objects.save(model, f"{tag_dir}/mp_rank_{t:02d}_model_states.pt")

        for r in range(dp):
            fp32, states, paddings, mappings = [], {}, [], []
            for g, (group, (numel, padding)) in enumerate(zip(groups, layouts)):
                size = (numel + padding) // dp
                begin, end = r * size, (r + 1) * size
                rank_padding = padding if r == dp - 1 else 0
                master = flats["fp32"][g][begin:end].clone()
                master = master.narrow(0, 0, size - rank_padding)
                master.requires_grad_(True)
                fp32.append(master)
                states[g] = {"step": torch.tensor(5.0),
                             "exp_avg": flats["exp_avg"][g][begin:end].clone(),
                             "exp_avg_sq": flats["exp_avg_sq"][g][begin:end].clone()}
                paddings.append(rank_padding)
                mapping = collections.OrderedDict()
                offset = 0
                for name, _, _ in group:
                    n = slices[name]["fp32"].numel()
                    lo, hi = max(offset, begin), min(offset + n, end)
                    if lo < hi:
                        address = ds_objects.fragment_address()
                        address.numel = hi - lo
                        address.start = lo - begin
                        mapping[name] = address
                    offset += n
                mappings.append(mapping)
            loss_scaler = ds_objects.LossScaler()
            loss_scaler.cur_scale = 1.0
            loss_scaler.dynamic = False
            param_groups = []
            for g, hyper in enumerate(HYPER):
                param_group = dict(hyper)
                param_group.update({"amsgrad": False, "maximize": False, "foreach": None,
                                    "capturable": False, "differentiable": False,
                                    "fused": False, "params": [g]})
                param_groups.append(param_group)
            optim = {
                "optimizer_state_dict": {
                    "loss_scaler": loss_scaler,
                    "dynamic_loss_scale": False,
                    "overflow": False,
                    "clip_grad": 1.0,
                    "base_optimizer_state": {"state": states, "param_groups": param_groups},
                    "single_partition_of_fp32_groups": fp32,
                    "zero_stage": ds_objects.ZeroStageEnum.optimizer_states,
                    "group_paddings": paddings,
                    "partition_count": [dp] * len(groups),
                    "ds_version": "0.14.5",
                    "param_slice_mappings": mappings,
                },
                "ds_config": ds_config,
                "ds_version": "0.14.5",
            }
            ds_objects.save(optim, f"{tag_dir}/zero_pp_rank_{r}_mp_rank_{t:02d}_optim_states.pt")


def main():
    out = sys.argv[1]
    state = make_state()
    for tp, dp in ((2, 2), (1, 2), (2, 1), (1, 1), (2, 3)):
        write_tag(f"{out}/ok/tp{tp}dp{dp}/global_step5", state, tp, dp)
    ruled = dict(INFO, tp_replicated_parameter_patterns=[r"final_norm\.weight", r"extra\.scale"])
    for tp, dp in ((1, 2), (1, 1), (2, 2), (2, 1), (4, 2), (4, 1)):
        write_tag(f"{out}/ruled/tp{tp}dp{dp}/global_step5", state, tp, dp, info=ruled)
    for tp in (1, 2):
        write_tag(f"{out}/no_info/tp{tp}dp2/global_step5", state, tp, 2, info=None)
    gen = torch.Generator().manual_seed(7)
    frozen = {name: torch.randn(shape, generator=gen) for name, shape, _ in FROZEN}
    for tp, dp in ((2, 2), (1, 2), (4, 1)):
        write_tag(f"{out}/frozen/tp{tp}dp{dp}/global_step5", state, tp, dp, info=ruled,
                  frozen=frozen)
    FROZEN.append(("extra.frozen_proj", (4, 6), ("split", 0)))  # no rule names it
    write_tag(f"{out}/frozen_uncovered/tp2dp2/global_step5", state, 2, 2, info=ruled,
              frozen=dict(frozen, **{"extra.frozen_proj": torch.randn((4, 6), generator=gen)}))
    FROZEN.pop()
    for name, tensor in frozen.items():  # what a frozen parameter's bit16 atom holds
        os.makedirs(f"{out}/full/{name}", exist_ok=True)
        torch.save(tensor, f"{out}/full/{name}/fp32.pt")
    for name, tensors in state.items():
        for key, tensor in tensors.items():
            os.makedirs(f"{out}/full/{name}", exist_ok=True)
            torch.save(tensor, f"{out}/full/{name}/{key}.pt")
    uncovered = dict(state)
    PARAMS[0].append(("extra.proj", (4, 6), ("split", 0)))
    gen = torch.Generator().manual_seed(3)
    uncovered["extra.proj"] = {key: torch.randn((4, 6), generator=gen)
                               for key in ("fp32", "exp_avg", "exp_avg_sq")}
    write_tag(f"{out}/uncovered/tp2dp2/global_step5", uncovered, 2, 2)
    PARAMS[0].pop()
    write_tag(f"{out}/averaged_differs/tp2dp2/global_step5", state, 2, 2,
              perturb="layers.0.norm.weight")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""DeepSpeed-MoE layers in a tensor- and pipeline-parallel GPT (a PipelineModule whose layers are
Megatron-style tensor-parallel), on CPU with gloo: ZeRO-1, fp32, the current release.

The model is ../shared/tools/deepspeed-cpu/train_3d.py's untied GPTModelPipe (its
PipeModelDataParallelTopology: rank = stage * DP * TP + dp_rank * TP + tp_rank; a vocabulary-
parallel embedding and output layer, column/row-parallel attention) with each transformer layer's
MLP a deepspeed.moe.layer.MoE of --experts whole experts at expert-parallel size --ep, top-1,
placed by partition_method --partition (default 'type:MoELayerPipe': the transformer layers spread
evenly over the stages). The engine's grid is the mpu, so DeepSpeed builds the expert-parallel
groups within each stage as runs of --ep consecutive ranks across its TP ranks, and writes each
stage's files under mp ranks stage * TP + tp_rank. The gating
drops no token; the gate and every GLOBAL expert get weights of their own from generators seeded
by their layer and id, so the function does not depend on the TP, PP, DP or EP layout. The global
batch of every step is train.py's, in 2 micro-batches.

Run from ../shared/tools/deepspeed-cpu (train.py, train_tp.py and train_3d.py are imported):
  launch.py NPROC PORT train_moe_3d.py --tp T --pp P --ep E [--expert_tp] [--partition METHOD]
            --steps N [--save_dir DIR --save_at STEP ...] [--load_dir DIR] --out JSON
A --save_at step that is the loaded one saves what the load gave, before any step. Each save's
client state is Megatron-DeepSpeed's (checkpoint_version, a Megatron-like `args` of the run's
sizes), and the module records universal_checkpoint_info (train_3d.py's patterns, the gates
replicated). DP = NPROC / (T * P); E must divide DP * T (with --expert_tp, DP). Rank 0 writes
{"losses": ...}.
"""
import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
import train as T  # noqa: E402  (the shared trainer: data, gloo shims)
import train_tp as TPM  # noqa: E402  (tensor-parallel building blocks)
import train_3d as M3  # noqa: E402  (the pipeline's layers, grid and record of the TP layout)
from train_moe_pipe import ExpertMLP, init_experts  # noqa: E402  (this folder's)
from train_moe_tp import TPExpertMLP, add_arguments, init_tp_experts, save  # noqa: E402
import pipeline_training  # noqa: E402  (this folder's, the loop)

import deepspeed  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from deepspeed.pipe import PipelineModule, LayerSpec  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402

GAS = 2


class MoELayerPipe(nn.Module):
    """train_3d.py's ParallelTransformerLayerPipe with its MLP an MoE of whole experts, or with
    `expert_tp` of train_moe_tp.py's TPExpertMLPs (expert tensor parallelism, its capacity as
    there)."""

    def __init__(self, cfg, layer, experts, ep, expert_tp):
        super().__init__()
        block = cfg.full.blocks[layer]
        self.input_layernorm = TPM.LN(block.ln1)
        self.self_attention = TPM.Attention(block.qkv, block.proj, cfg.d, cfg.nhead, cfg.tp, cfg.r)
        self.post_attention_layernorm = TPM.LN(block.ln2)
        expert = TPExpertMLP(cfg.d, 2 * cfg.d, cfg.tp) if expert_tp else ExpertMLP(cfg.d, 2 * cfg.d)
        capacity_factor = float(experts) if expert_tp else 1.0
        self.mlp = MoE(hidden_size=cfg.d, expert=expert, num_experts=experts, ep_size=ep, k=1,
                       capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                       min_capacity=4, use_residual=False, noisy_gate_policy=None,
                       drop_tokens=expert_tp, use_rts=False, top2_2nd_expert_sampling=False,
                       enable_expert_tensor_parallelism=expert_tp)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))[0]


def uc_info(vocab, vp):
    """train_3d.py's record of the untied model's TP layout, each MoE gate replicated, and a
    TPExpertMLP's split as Megatron's MLP's (as train_moe_tp.py records it)."""
    info = M3.uc_info(vocab, vp, True)
    expert = r'\d+.mlp.deepspeed_moe.experts.deepspeed_experts.\d+.'
    info[M3.TP_REPLICATED_PARAMETER_PATTERNS] += [r'\d+.mlp.deepspeed_moe.gate.wg.weight',
                                                  expert + r'dense_4h_to_h.bias']
    info[M3.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(expert + r'dense_4h_to_h.weight')
    return info


def main():
    p = argparse.ArgumentParser()
    add_arguments(p)  # train_moe_tp.py's
    p.add_argument('--pp', type=int, default=2)
    p.add_argument('--partition', default='type:MoELayerPipe',
                   help="PipelineModule's partition_method")
    args = p.parse_args()
    T.install_gloo_shim(bf16=False)
    deepspeed.init_distributed(dist_backend='gloo')
    # torch's gloo has no _allgather_base: DeepSpeed's list-based fallbacks (train.py's), and
    # train_3d.py's all_gather_into_tensor, which the pipeline's partitioned activations and the
    # MoE's token gathering over the TP ranks need.
    import deepspeed.comm.comm as dscomm
    dscomm.cdb.all_gather_function = None
    dscomm.cdb.reduce_scatter_function = None
    M3.install_all_gather_into_tensor_shim()
    TPM.MPU_ = mpu = M3.MPU3D(args.tp, args.pp)
    micro = T.GLOBAL_BS // (mpu.dp * GAS)
    assert micro * mpu.dp * GAS == T.GLOBAL_BS
    assert (mpu.dp if args.expert_tp else mpu.dp * mpu.tp) % args.ep == 0

    torch.manual_seed(args.seed)
    full = T.TinyGPT(vocab=args.vocab, d=args.d, nlayer=args.nlayer, nhead=args.nhead,
                     seq=args.seq)
    mult = args.vocab_div * args.tp
    vp = int(math.ceil(args.vocab / mult) * mult)
    cfg = M3.Cfg(full, args.vocab, vp, args.d, args.nhead, args.tp, mpu.tp_rank, True)
    specs = [LayerSpec(M3.EmbeddingPipe, cfg)]
    specs += [LayerSpec(MoELayerPipe, cfg, i, args.experts, args.ep, args.expert_tp)
              for i in range(args.nlayer)]
    specs += [LayerSpec(M3.FinalLayerNorm, cfg), LayerSpec(M3.LMHeadPipe, cfg)]

    def loss_fn(out, y):
        return F.cross_entropy(out.float().reshape(-1, args.vocab), y.reshape(-1))

    model = PipelineModule(layers=specs, loss_fn=loss_fn, topology=mpu.topo,
                           partition_method=args.partition, activation_checkpoint_interval=0)
    del full
    # The expert-parallel groups are runs of E consecutive ranks of the stage (dp_rank * TP +
    # tp_rank; with expert tensor parallelism of its TP rank's DP ranks), so this rank holds global
    # experts [e * n, (e + 1) * n).
    placed = mpu.dp_rank if args.expert_tp else mpu.dp_rank * mpu.tp + mpu.tp_rank
    ep_rank = placed % args.ep
    for index, module in enumerate(model.forward_funcs):
        for moe in (m for m in module.modules() if isinstance(m, MoE)):
            layer = int(model._local_start) + index
            if args.expert_tp:
                init_tp_experts(moe, layer, ep_rank, args.seed, mpu.tp, mpu.tp_rank)
            else:
                init_experts(moe, layer, ep_rank, args.seed)
    # An MoE save takes the record from the module (its client_state may not carry it).
    model.universal_checkpoint_info = uc_info(args.vocab, vp)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {'params': list(model.parameters()), 'name': 'p'})
    config = {
        "train_batch_size": T.GLOBAL_BS,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True,
                                                  "adam_w_mode": False}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1000000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)

    pipeline_training.train(engine, args, micro, GAS, tdist.get_world_size(),
                            lambda step: save(engine, args, step, mpu, vp, mpu.pp))


if __name__ == '__main__':
    main()

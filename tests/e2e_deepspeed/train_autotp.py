#!/usr/bin/env python3
"""A DeepSpeed trainer with AutoTP tensor parallelism (DeepSpeed 0.19: the config's
"tensor_parallel": {"autotp_size": T}) on CPU with gloo, for the AutoTP checks.

The model is a tiny Llama-like stack of plain torch modules, laid out as AutoTP's heuristic
parser recognises it (a class named ...Model whose layers sit in an nn.ModuleList): per layer,
q/k/v and up projections become column-parallel LinearLayers (split on dim 0, bias too),
o and down projections row-parallel LinearAllreduce (weight split on dim 1, bias whole), layer
norms stay whole; the embedding, the final norm and the head are outside the layers and stay
whole. The MLP is 65 wide, so AutoTP splits up and down unevenly (33 and 32 at TP=2; 17, 16, 16
and 16 at TP=4), attention's 32 evenly. Every rank of a data-parallel rank's TP group trains on
the same micro batch.

With --model llama it is a Hugging Face LlamaForCausalLM instead (transformers; 4 heads, 4
key/value heads, a 67-token vocabulary and an untied head, which AutoTP splits 34/33 at TP=2), and
rank 0 writes its config.json beside the tags, as the HF Trainer does.

With --model fused the tiny model's attention has q, k and v fused in one projection of 32, 16
and 16 rows (grouped-query: 8 query heads of 4, 4 key/value heads) and its MLP gate and up in one
of 65 and 65, which a custom partition_config splits as sub-parameters (shapes ((32, 16, 16), -1)
and (2, -1)): each TP rank holds its block of every part (gate's and up's 33 and 32 at TP=2).

Launch with launch.py (RANK, WORLD_SIZE, MASTER_ADDR/PORT set); rank 0 prints `STEP n loss x`
for every step it trains and writes {"losses": {step: loss}} to --out.
Usage: train_autotp.py --tp T [--model tiny|llama|fused] [--kv_heads K] [--zero_stage S]
         [--dtype fp32|bf16] [--frozen]
         --steps N [--save_dir DIR [--save_step K]]
         [--load_dir DIR --load_tag TAG [--universal]] --out JSON
  Trains up to global step N (from the loaded step, or 0) and saves global_step<K> to
  --save_dir once step K (default N) is trained: with --load_dir and K the loaded step, a resave
  of the loaded state, before the run trains on to N.
"""
import argparse
import json
import sys

import deepspeed
import deepspeed.comm as dist
import deepspeed.ops
import torch
import torch.nn as nn
import torch.nn.functional as F

# The shared-memory collectives op would be compiled at run time; gloo does without it.
deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False

VOCAB, SEQ, WIDTH, HIDDEN, HEAD = 64, 8, 32, 65, 8
LLAMA_VOCAB = 67
# --frozen's parameters (the tiny model's): AutoTP splits the first 33/32 at TP=2 and the last on
# dim 1, and keeps the norm whole.
FROZEN = ('layers.0.mlp.up_proj.weight', 'layers.0.input_layernorm.weight',
          'layers.1.self_attn.o_proj.weight')
GLOBAL_BATCH = 4
# --model fused: q, k and v rows of the fused projection (8 query heads of FUSED_HEAD, 4
# key/value heads: whole heads on each rank up to TP=4), and the width of each of gate and up
# (AutoTP splits each unevenly: 33 and 32 at TP=2).
FUSED_QKV = (32, 16, 16)
FUSED_HEAD = 4
FUSED_HIDDEN = 65
FUSED_PARTITION = {
    'use_default_specs': False,
    'layer_specs': [
        {'patterns': [r'.*\.self_attn\.o_proj\.weight$', r'.*\.mlp\.down_proj\.weight$'],
         'partition_type': 'row'},
        {'patterns': [r'.*\.self_attn\.qkv_proj\.weight$'], 'partition_type': 'column',
         'shape': [list(FUSED_QKV), -1], 'partition_dim': 0},
        {'patterns': [r'.*\.mlp\.gate_up_proj\.weight$'], 'partition_type': 'column',
         'shape': [2, -1], 'partition_dim': 0},
    ],
}


class Attention(nn.Module):

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, WIDTH)
        self.k_proj = nn.Linear(WIDTH, WIDTH)
        self.v_proj = nn.Linear(WIDTH, WIDTH)
        self.o_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        batch, length, _ = x.shape
        # The local heads: q, k and v hold this TP rank's columns.
        heads = [p(x).view(batch, length, -1, HEAD).transpose(1, 2)
                 for p in (self.q_proj, self.k_proj, self.v_proj)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class Mlp(nn.Module):

    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(WIDTH, HIDDEN)
        self.down_proj = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class Layer(nn.Module):

    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(WIDTH)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.LayerNorm(WIDTH)
        self.mlp = Mlp()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlamaModel(nn.Module):

    def __init__(self, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Layer() for _ in range(layers)])
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


class FusedAttention(nn.Module):
    """Grouped-query attention with q, k and v fused in one projection of unequal parts."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(WIDTH, sum(FUSED_QKV))
        self.o_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        batch, length, _ = x.shape
        # This TP rank's piece of each of q, k and v, in that order: AutoTP splits every part.
        rows = self.qkv_proj.weight.shape[0]
        tp = sum(FUSED_QKV) // rows
        q, k, v = self.qkv_proj(x).split([size // tp for size in FUSED_QKV], dim=-1)
        q, k, v = (t.view(batch, length, -1, FUSED_HEAD).transpose(1, 2) for t in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class FusedMlp(nn.Module):
    """A gated MLP with gate and up fused in one projection of two equal parts."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(WIDTH, 2 * FUSED_HIDDEN)
        self.down_proj = nn.Linear(FUSED_HIDDEN, WIDTH)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fused():
    """The tiny model with fused projections, split by a custom partition_config."""
    model = TinyLlamaModel()
    for layer in model.layers:
        layer.self_attn, layer.mlp = FusedAttention(), FusedMlp()
    return model, lambda engine, tokens, targets: engine(tokens, targets)


def llama(kv_heads):
    """A tiny Llama of transformers, as AutoTP splits a Hugging Face model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=2, num_attention_heads=WIDTH // HEAD,
                         num_key_value_heads=kv_heads, max_position_embeddings=2 * SEQ,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    return model, lambda engine, tokens, targets: engine(input_ids=tokens, labels=tokens).loss


def global_batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--tp', type=int, required=True)
    parser.add_argument('--model', choices=['tiny', 'llama', 'fused'], default='tiny')
    parser.add_argument('--zero_stage', type=int, default=3)
    parser.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32')
    parser.add_argument('--kv_heads', type=int, default=WIDTH // HEAD,
                        help='--model llama: its key/value heads (AutoTP gives the ranks past '
                        'them empty attention slices)')
    parser.add_argument('--steps', type=int, required=True)
    parser.add_argument('--save_dir')
    parser.add_argument('--save_step', type=int)
    parser.add_argument('--load_dir')
    parser.add_argument('--load_tag')
    parser.add_argument('--universal', action='store_true',
                        help='load --load_tag with DeepSpeed\'s universal load')
    parser.add_argument('--frozen', action='store_true',
                        help='freeze FROZEN (split unevenly, replicated, row-parallel)')
    parser.add_argument('--out', required=True)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend='gloo')
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // args.tp
    torch.manual_seed(1234)
    config = {
        'train_micro_batch_size_per_gpu': GLOBAL_BATCH // dp,
        'gradient_accumulation_steps': 1,
        'optimizer': {'type': 'Adam', 'params': {'lr': 1e-2, 'torch_adam': True,
                                                 'adam_w_mode': False}},
        'zero_optimization': {'stage': args.zero_stage},
        'tensor_parallel': {'autotp_size': args.tp},
        'bf16': {'enabled': args.dtype == 'bf16'},
        'steps_per_print': 1000000,
        'checkpoint': {'load_universal': args.universal},
    }
    if args.model == 'fused':
        config['tensor_parallel']['partition_config'] = FUSED_PARTITION
        model, loss_of = fused()
    elif args.model == 'llama':
        model, loss_of = llama(args.kv_heads)
    else:
        model, loss_of = TinyLlamaModel(), lambda engine, tokens, targets: engine(tokens, targets)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not (args.frozen and name in FROZEN))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    if args.load_dir:
        path, _ = engine.load_checkpoint(args.load_dir, tag=args.load_tag)
        if path is None:
            sys.exit(f'no checkpoint loaded from {args.load_dir}/{args.load_tag}')
    save_step = args.steps if args.save_step is None else args.save_step

    def save():
        if rank == 0 and args.model == 'llama':
            model.config.save_pretrained(args.save_dir)
        engine.save_checkpoint(args.save_dir, tag=f'global_step{save_step}')
    if args.save_dir and engine.global_steps == save_step:
        save()
    # DeepSpeed's grid: global rank = dp_rank · tp + tp_rank.
    dp_rank, micro = rank // args.tp, GLOBAL_BATCH // dp
    losses = {}
    for step in range(engine.global_steps + 1, args.steps + 1):
        tokens, targets = global_batch(step)
        rows = slice(dp_rank * micro, (dp_rank + 1) * micro)
        loss = loss_of(engine, tokens[rows], targets[rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses[step] = (total / world).item()
        if rank == 0:
            print(f'STEP {step} loss {losses[step]:.8f}', flush=True)
        if args.save_dir and step == save_step:
            save()
    dist.barrier()
    if rank == 0:
        with open(args.out, 'w') as f:
            json.dump({'losses': losses}, f)


if __name__ == '__main__':
    main()

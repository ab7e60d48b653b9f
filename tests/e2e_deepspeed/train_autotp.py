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

Launch with launch.py (RANK, WORLD_SIZE, MASTER_ADDR/PORT set); rank 0 prints `STEP n loss x`
for every step it trains and writes {"losses": {step: loss}} to --out.
Usage: train_autotp.py --tp T [--model tiny|llama] [--zero_stage S] [--dtype fp32|bf16] [--frozen]
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


def llama():
    """A tiny Llama of transformers, as AutoTP splits a Hugging Face model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=2, num_attention_heads=WIDTH // HEAD,
                         num_key_value_heads=WIDTH // HEAD, max_position_embeddings=2 * SEQ,
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
    parser.add_argument('--model', choices=['tiny', 'llama'], default='tiny')
    parser.add_argument('--zero_stage', type=int, default=3)
    parser.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32')
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
    if args.model == 'llama':
        model, loss_of = llama()
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

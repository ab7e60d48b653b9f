"""The demo's model and data, shared by zero_trainer.py and ds_trainer.py.

TinyGPT: token and position embeddings, `nlayer` pre-LayerNorm transformer blocks, a final
LayerNorm and an untied head; a persistent buffer `pos_ids`. 63,840 parameters by default.
argument_parser(): the trainers' common options.
global_batch(step): a fixed batch per step, so every data-parallel size sees the same data.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):

    def __init__(self, d, nhead, hidden):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.nhead = nhead

    def forward(self, x):
        batch, seq, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(d, dim=-1)
        hd = d // self.nhead
        q, k, v = (t.view(batch, seq, self.nhead, hd).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (hd**0.5)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(batch, seq, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):

    def __init__(self, vocab, d, nlayer, nhead, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, nhead, 4 * d) for _ in range(nlayer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("pos_ids", torch.arange(seq), persistent=True)
        self.vocab = vocab

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(self.pos_ids[:idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1))


def global_batch(step, global_bs, vocab, seq):
    """The step's global batch: next token = (3*token + 1) mod vocab, 20% noise."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (global_bs, seq + 1), generator=g)
    for t in range(1, seq + 1):
        keep = torch.rand(global_bs, generator=g) < 0.8
        x[:, t] = torch.where(keep, (3 * x[:, t - 1] + 1) % vocab, x[:, t])
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def argument_parser(description):
    """The options both trainers take."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=10, help="train until this global step (inclusive)")
    p.add_argument("--save_dir", default=None)
    p.add_argument("--save_at", type=int, nargs="*", default=[], help="global steps after which to save")
    p.add_argument("--load_dir", default=None)
    p.add_argument("--load_tag", default=None, help="tag to load (default: the one `latest` names)")
    p.add_argument("--out", default=None, help="json file for the losses (rank 0)")
    p.add_argument("--dump_state", default=None,
                   help="after loading, torch.save this rank's optimizer state here ({rank} is replaced)")
    p.add_argument("--vocab", type=int, default=67)
    p.add_argument("--d", type=int, default=48)
    p.add_argument("--nlayer", type=int, default=2)
    p.add_argument("--nhead", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--global_bs", type=int, default=8, help="sequences per step, divisible by the world size")
    return p

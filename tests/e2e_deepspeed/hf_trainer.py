#!/usr/bin/env python3
"""A user's Hugging Face Trainer script with a DeepSpeed ZeRO-2 config, nothing of ucp in it.

A tiny GPT-2 (random init, no download, dropout off) on fixed random tokens, global batch 8
split over the WORLD_SIZE processes, sequential sampling (so every world size sees the same
samples at each step), a checkpoint every SAVE_EVERY steps. Rank 0 writes the logged losses
(the Trainer's mean over the processes) to OUT as {"losses": {step: loss}}.

Usage (one process per rank, RANK/WORLD_SIZE/MASTER_* set, DS_ACCELERATOR=cpu):
  hf_trainer.py --output_dir DIR --steps N --save_every K --out OUT [--resume CHECKPOINT]
"""
import argparse
import json
import os

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)

GLOBAL_BATCH = 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count, length, vocab):
        self.data = torch.randint(0, vocab, (count, length),
                                  generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {'input_ids': self.data[i], 'labels': self.data[i]}


class LossLog(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and 'loss' in logs:
            self.losses[state.global_step] = logs['loss']


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--output_dir', required=True)
    parser.add_argument('--steps', type=int, required=True)
    parser.add_argument('--save_every', type=int, required=True)
    parser.add_argument('--out', required=True)
    parser.add_argument('--resume', default=None)
    args = parser.parse_args()
    world = int(os.environ.get('WORLD_SIZE', '1'))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=67, n_positions=16, n_embd=48, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    deepspeed = {
        'train_batch_size': GLOBAL_BATCH,
        'train_micro_batch_size_per_gpu': GLOBAL_BATCH // world,
        'gradient_accumulation_steps': 1,
        'gradient_clipping': 1.0,
        'zero_optimization': {'stage': 2},
        'optimizer': {'type': 'AdamW', 'params': {'lr': 3e-3}},
    }
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=args.steps, save_strategy='steps', save_steps=args.save_every, logging_steps=1,
        deepspeed=deepspeed, report_to=[], use_cpu=True, learning_rate=3e-3, seed=0,
        dataloader_drop_last=True, train_sampling_strategy='sequential')
    log = LossLog()
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(256, 16, 67),
                      callbacks=[log])
    trainer.train(resume_from_checkpoint=args.resume)
    if int(os.environ.get('RANK', '0')) == 0:
        with open(args.out, 'w') as f:
            json.dump({'losses': log.losses}, f)


if __name__ == '__main__':
    main()

"""Writes a DeepSpeed-shaped checkpoint the way DeepSpeed does: torch.save per file, then `latest`.

Usage: save_checkpoint.py SAVE_DIR [--plain NAME]...
  SAVE_DIR/global_step5/<the DeepSpeed names below>, each torch.save'd, then SAVE_DIR/latest.
  --plain NAME: also write SAVE_DIR/global_step5/NAME with a plain open(..., 'wb').write(), no
  torch (a file with a checkpoint's name that torch's serializer did not write).
"""
import os
import sys

import torch

TORCH_FILES = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
    "layer_00-model_states.pt",
]


def state(index):
    generator = torch.Generator().manual_seed(index)
    return {
        "module": {
            "weight": torch.randn(64, 32, generator=generator),
            "bias": torch.randn(32, generator=generator).to(torch.bfloat16),
        },
        "optimizer": {"step": 5 + index, "exp_avg": torch.randn(2048, generator=generator)},
        "ds_version": "0.0.0",
        "index": index,
    }


def main():
    save_dir = sys.argv[1]
    plain = [sys.argv[i + 1] for i, arg in enumerate(sys.argv) if arg == "--plain"]
    tag_dir = os.path.join(save_dir, "global_step5")
    os.makedirs(tag_dir, exist_ok=True)
    for index, name in enumerate(TORCH_FILES):
        torch.save(state(index), os.path.join(tag_dir, name))
    for name in plain:
        with open(os.path.join(tag_dir, name), "wb") as file:
            file.write(b"not written by torch" * 1000)
    with open(os.path.join(save_dir, "latest"), "w") as file:
        file.write("global_step5")


if __name__ == "__main__":
    main()

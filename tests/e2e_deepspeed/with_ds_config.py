#!/usr/bin/env python3
"""Runs a DeepSpeed trainer script with entries added to its config's "checkpoint" section, so
that the tests can pick DeepSpeed's checkpoint engines without changing the shared trainers.

Usage: with_ds_config.py JSON SCRIPT [ARGS...]
  JSON    entries merged into config["checkpoint"], e.g. '{"checkpoint_serialization": false}'
          or '{"writer": {"type": "python"}}' (DeepSpeed's FastCheckpointEngine)
The writer engines of DeepSpeed 0.19 ask the mpu for get_data_parallel_group_ranks, which the
mpu of the tensor-parallel trainer (written for 0.14.5) lacks: it is added, from the mpu's own
data-parallel group.
"""
import json
import runpy
import sys

import deepspeed
import torch.distributed as dist

checkpoint_entries, script = json.loads(sys.argv[1]), sys.argv[2]
initialize = deepspeed.initialize


def initialize_with_checkpoint_entries(*args, config=None, mpu=None, **kwargs):
    config = dict(config, checkpoint={**config.get('checkpoint', {}), **checkpoint_entries})
    if mpu is not None and not hasattr(mpu, 'get_data_parallel_group_ranks'):
        mpu.get_data_parallel_group_ranks = \
            lambda: dist.get_process_group_ranks(mpu.get_data_parallel_group())
    return initialize(*args, config=config, mpu=mpu, **kwargs)


deepspeed.initialize = initialize_with_checkpoint_entries
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name='__main__')

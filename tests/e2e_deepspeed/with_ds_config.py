#!/usr/bin/env python3
"""Runs a DeepSpeed trainer script with entries merged into the config it passes to
deepspeed.initialize, so that the tests can pick DeepSpeed's checkpoint engines, elastic
checkpoints or its own Adam without changing the shared trainers.

Usage: with_ds_config.py JSON SCRIPT [ARGS...]
  JSON    an object merged into the config, recursively (a nested object merges into the
          section of that name, any other value replaces it), e.g.
          '{"checkpoint": {"checkpoint_serialization": false}}',
          '{"checkpoint": {"writer": {"type": "python"}}}' (DeepSpeed's FastCheckpointEngine) or
          '{"zero_optimization": {"elastic_checkpoint": true}}'
The writer engines of DeepSpeed 0.19 ask the mpu for get_data_parallel_group_ranks, which the
mpu of the tensor-parallel trainer (written for 0.14.5) lacks: it is added, from the mpu's own
data-parallel group.
"""
import json
import runpy
import sys

import deepspeed
import torch.distributed as dist

entries, script = json.loads(sys.argv[1]), sys.argv[2]
initialize = deepspeed.initialize


def merged(config, extra):
    out = dict(config)
    for key, value in extra.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def initialize_with_entries(*args, config=None, mpu=None, **kwargs):
    if mpu is not None and not hasattr(mpu, 'get_data_parallel_group_ranks'):
        mpu.get_data_parallel_group_ranks = \
            lambda: dist.get_process_group_ranks(mpu.get_data_parallel_group())
    return initialize(*args, config=merged(config, entries), mpu=mpu, **kwargs)


deepspeed.initialize = initialize_with_entries
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name='__main__')

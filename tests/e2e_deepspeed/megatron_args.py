#!/usr/bin/env python3
"""Runs a shared trainer of ../shared/tools/deepspeed-cpu that takes --tp, --pp (and --ep), given
Megatron-LM's --tensor-model-parallel-size, --pipeline-model-parallel-size (and
--expert-model-parallel-size) instead: the process's command line then states its degrees as
Megatron-style trainers' do, which is what ucp reads of it (hooks/topology/trainer_degrees.h).
sys.argv changes; /proc/self/cmdline does not.

Usage: megatron_args.py SCRIPT [ARGS...]   ("--flag N" and "--flag=N" both translated)
"""
import runpy
import sys

FLAGS = {'--tensor-model-parallel-size': '--tp', '--pipeline-model-parallel-size': '--pp',
         '--expert-model-parallel-size': '--ep'}

script, translated = sys.argv[1], []
for argument in sys.argv[2:]:
    name, equals, value = argument.partition('=')
    if name in FLAGS:
        translated += [FLAGS[name], value] if equals else [FLAGS[name]]
    else:
        translated.append(argument)
sys.argv = [script] + translated
runpy.run_path(script, run_name='__main__')

#!/usr/bin/env python3
"""Real DeepSpeed pipeline parallelism end to end under LD_PRELOAD=libucp.so (CPU, gloo).

Two models (--model), trainers of ../shared/tools/deepspeed-cpu, ZeRO-1; the global batch of
every step is fixed, so losses compare across topologies:
  pipe  train_pipe.py: a PipelineModule of 4 layers, partition_method 'uniform', saved at
        PP=2 x DP=2 (4 ranks), resumed at PP=1 x DP=2.
  3d    train_3d.py: Megatron-DeepSpeed's GPTModelPipe imitated (tensor-parallel layers on
        DeepSpeed's pipeline grid, the word embedding tied to the LM head on the first and last
        stage, partition_method 'type:transformer', 2 transformer layers), saved at
        TP=2 x PP=2 x DP=1 (4 ranks), resumed at TP=1 x PP=1 x DP=2: the TP slices merged, the
        stages joined, the DP partitions split.
  pipe_tied  train_pipe_tied.py (this folder): a PipelineModule on DeepSpeed's own grid whose word
        embedding is tied to the LM head (TiedLayerSpec on the first and last stage, no
        universal_checkpoint_info), partition_method 'parameters', saved at PP=2 x DP=2, resumed
        at PP=1 x DP=2; with --stage 0 --dtype bf16, under DeepSpeed's BF16 optimizer.
One CTest test per step, sharing WORK/<model>[_bf16]:

  save        the save topology without and with the preload: steps 1..STEPS, saves tag
              global_step<SAVE_AT>; under the preload the save must leave a committed index,
              DeepSpeed's files byte for byte those of the run without it, and the same losses.
  universal   DeepSpeed's own path, no preload: ds_to_universal.py, then the universal load at
              the resume topology and steps SAVE_AT+1..STEPS (the oracle); `ucp export --format
              deepspeed-universal` of the tag must write ds_to_universal's files, every object
              and tensor identical.
  preload     the plain load_checkpoint at the resume topology under the preload with
              UCP_TOPOLOGY naming its tp and pp (the world size alone cannot tell them: see the
              README) and the same steps: every loss must have the same float32 bits as the
              universal run's; the served files must be the bytes `ucp reshard` writes.
  preload_megatron_args  the same resume without UCP_TOPOLOGY, the trainer given its degrees as
              Megatron's --tensor-model-parallel-size and --pipeline-model-parallel-size
              (megatron_args.py): ucp must take them from those arguments (its log names them)
              and the losses must be as above.

Usage: ds_pipe_e2e.py STEP [--model pipe|3d|pipe_tied] [--dtype fp32|bf16] [--stage 0|1]
                      --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI --deepspeed VERSION
                      [--required]
--dtype bf16 runs the same steps in bf16 with DeepSpeed's ZeRO-1 bf16 optimizer (bf16_ optimizer
files), in WORK/<model>_bf16; --stage 0 with it, DeepSpeed's BF16 optimizer, in
WORK/<model>_bf16_stage0.
Exit status 77 with the reason when that DeepSpeed is not importable (ds_e2e.py's rule).
"""
import argparse
import os
import shutil
import subprocess
import sys

import ds_e2e
from ds_e2e import fail, float32_bits, log_tail, losses, preload_env, print_losses

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'deepspeed'))
import harness  # noqa: E402

SAVE_AT, STEPS = 3, 6
TAG = f'global_step{SAVE_AT}'


class Model:
    """A trainer and its (tp, pp, dp) topologies: the save's and the resume's."""

    def __init__(self, trainer, save, resume, extra, layer_files):
        self.trainer, self.save, self.resume, self.extra = trainer, save, resume, extra
        self.layer_files = layer_files  # the tag's layer files at the save topology


MODELS = {
    'pipe': Model('train_pipe.py', (1, 2, 2), (1, 1, 2), [],
                  [f'layer_{layer:02d}-model_states.pt' for layer in range(4)]),
    # Layers 1 (the tied embedding) .. 4 (the final norm) hold parameters, on every TP rank.
    '3d': Model('train_3d.py', (2, 2, 1), (1, 1, 2), ['--nlayer', '2'],
                [f'layer_{layer:02d}-model_{t:02d}-model_states.pt'
                 for layer in range(1, 5) for t in range(2)]),
    # Layers 0 (the tied embedding) .. 4 (the final norm); layer 5, the head, is the tied
    # embedding's forward_fn and has no file.
    'pipe_tied': Model(os.path.join(HERE, 'train_pipe_tied.py'), (1, 2, 2), (1, 1, 2), [],
                       [f'layer_{layer:02d}-model_states.pt' for layer in range(5)]),
}


def name_of(topology):
    return 'tp{}pp{}dp{}'.format(*topology)


MEGATRON_ARGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'megatron_args.py')


def launch(args, env, topology, log, extra, megatron_args=False):
    """Runs the model's trainer at `topology` (tp, pp, dp), given its degrees as --tp/--pp or,
    with megatron_args, as Megatron's --tensor-model-parallel-size and
    --pipeline-model-parallel-size (megatron_args.py); returns (exit status, seconds, output)."""
    model = MODELS[args.model]
    tp, pp, dp = topology
    if megatron_args:
        degrees = ['--pipeline-model-parallel-size', str(pp)]
        if args.model == '3d':
            degrees = ['--tensor-model-parallel-size', str(tp)] + degrees
        trainer = [MEGATRON_ARGS, model.trainer] + degrees
    else:
        trainer = [model.trainer, '--pp', str(pp)] + (['--tp', str(tp)] if args.model == '3d' else [])
    trainer += ['--dtype', args.dtype, '--stage', str(args.stage)] + model.extra
    command = [sys.executable, 'launch.py', str(tp * pp * dp), ds_e2e.PORT] + trainer + extra
    return ds_e2e.run_launcher(command, args.tools, env, log)


def step_save(args, env, work):
    model = MODELS[args.model]
    save = name_of(model.save)
    tp, pp, dp = model.save
    prefix = 'bf16_' if args.dtype == 'bf16' else ''
    expected = model.layer_files + \
        [f'mp_rank_{m:02d}_model_states.pt' for m in range(tp * pp)] + \
        [f'{prefix}zero_pp_rank_{r}_mp_rank_{m:02d}_optim_states.pt'
         for m in range(tp * pp) for r in range(dp)]

    def run(name, run_env, save_dir):
        return ds_e2e.run_past_flakes(lambda: launch(
            args, run_env, model.save, os.path.join(work, f'{name}.log'),
            ['--steps', str(STEPS), '--save_dir', save_dir, '--save_at', str(SAVE_AT),
             '--out', os.path.join(work, f'{name}.json')]), STEPS, save_dir)
    tag_dir, _, _ = ds_e2e.save_with_and_without_preload(args, env, work, save, run, expected)
    index = os.path.join(tag_dir, '.ucp', 'index.json')
    print(f'index committed: {index} ({os.path.getsize(index)} bytes)')


def step_universal(args, env, work):
    resume = name_of(MODELS[args.model].resume)
    tag_dir = os.path.join(work, 'ckpt', TAG)
    universal = os.path.join(work, 'universal')
    shutil.rmtree(universal, ignore_errors=True)
    ds_e2e.ds_to_universal(env, tag_dir, os.path.join(universal, f'{TAG}_universal'))
    export = os.path.join(work, 'export')
    shutil.rmtree(export, ignore_errors=True)
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if status != 0:
        fail(f'ucp export exited {status}: {output[-2000:]}')
    report = harness.Report('ucp export')
    names = harness.compare_export(report, 'export', os.path.join(universal, f'{TAG}_universal'),
                                   export)
    if report.failures:
        fail(f'ucp export differs from ds_to_universal in {len(report.failures)} places')
    print(f'ucp export = ds_to_universal: {len(names)} files')
    status, seconds, output = ds_e2e.run_past_flakes(lambda: launch(
        args, env, MODELS[args.model].resume, os.path.join(work, 'universal.log'),
        ['--steps', str(STEPS), '--load_dir', universal, '--universal',
         '--out', os.path.join(work, 'universal.json')]), STEPS)
    if status != 0:
        fail(f'DeepSpeed universal load at {resume} exited {status}:\n'
             f'{output[-3000:]}')
    print(f'{resume} universal resume: {seconds:.1f} s')
    print_losses('losses universal', losses(os.path.join(work, 'universal.json')))


def step_preload(args, env, work, megatron_args=False):
    """The resume at the target under the preload: told tp and pp by UCP_TOPOLOGY, or, with
    megatron_args, by nothing but the trainer's own Megatron arguments."""
    model = MODELS[args.model]
    tp, pp, dp = model.resume
    resume, save = name_of(model.resume), name_of(model.save)
    name = 'preload_megatron_args' if megatron_args else 'preload'
    logs = os.path.join(work, 'logs_' + name)
    shutil.rmtree(logs, ignore_errors=True)
    run_env = preload_env(env, args.lib, logs)
    if not megatron_args:
        run_env['UCP_TOPOLOGY'] = f'tp={tp},pp={pp}'
    status, seconds, output = ds_e2e.run_past_flakes(lambda: launch(
        args, run_env, model.resume, os.path.join(work, name + '.log'),
        ['--steps', str(STEPS), '--load_dir', os.path.join(work, 'ckpt'),
         '--out', os.path.join(work, name + '.json')], megatron_args), STEPS)
    if status != 0:
        fail(f'plain load_checkpoint at {resume} under the preload exited '
             f'{status}:\n{output[-3000:]}\nucp logs:\n{log_tail(logs)}')
    print(f'{resume} plain resume under the preload'
          f'{" (degrees from the trainer arguments)" if megatron_args else ""}: {seconds:.1f} s')
    if megatron_args:
        logged = ''.join(open(os.path.join(logs, n), errors='replace').read()
                         for n in sorted(os.listdir(logs)))
        evidence = [f'pp={pp} (--pipeline-model-parallel-size {pp})']
        if args.model == '3d':
            evidence.insert(0, f'tp={tp} (--tensor-model-parallel-size {tp})')
        for said in evidence:
            if said not in logged:
                fail(f'no ucp log names {said!r} as the evidence of the target:\n'
                     f'{log_tail(logs)}')
        print(f'ucp took the target from the trainer: {", ".join(evidence)}')
    got = losses(os.path.join(work, name + '.json'))
    oracle = losses(os.path.join(work, 'universal.json'))
    full = losses(os.path.join(work, 'save.json'))
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    if sorted(got) != steps or sorted(oracle) != steps:
        fail(f'resumed steps {sorted(got)}, universal steps {sorted(oracle)}, expected {steps}')
    print_losses('losses preload', got)
    print_losses('losses universal', oracle)
    print_losses(f'losses {save} uninterrupted', {s: full[s] for s in steps})
    mismatched = [s for s in steps if float32_bits(got[s]) != float32_bits(oracle[s])]
    if mismatched:
        fail('losses differ from DeepSpeed\'s universal load at steps ' +
             ', '.join(f'{s} ({float32_bits(got[s])} vs {float32_bits(oracle[s])})'
                       for s in mismatched))
    print(f'losses bit-identical to DeepSpeed\'s universal load at steps {steps[0]}..{steps[-1]}')
    view = os.path.join(work, 'ckpt', TAG, '.ucp', 'views', f'tp{tp}-pp{pp}-dp{dp}')
    # One folder per step: the two resumes of one save run at once.
    resharded = os.path.join(work, 'reshard_' + name)
    shutil.rmtree(resharded, ignore_errors=True)
    subprocess.run([args.ucp, 'reshard', os.path.join(work, 'ckpt', TAG), '--to',
                    f'tp={tp},pp={pp},dp={dp}', '--out', resharded], check=True,
                   stdout=subprocess.DEVNULL)
    resharded = os.path.join(resharded, TAG)
    # The pipe model's layer files are the saved ones (passed through); the 3d model's hold
    # the target's TP slices.
    served = sorted(n for n in os.listdir(resharded)
                    if n.endswith('.pt') and (args.model == '3d' or not n.startswith('layer_')))
    ds_e2e.check_served(view, resharded, served, f'tp={tp},pp={pp},dp={dp}', logs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('step', choices=['save', 'universal', 'preload', 'preload_megatron_args'])
    parser.add_argument('--model', choices=sorted(MODELS), default='pipe')
    parser.add_argument('--dtype', choices=['fp32', 'bf16'], default='fp32',
                        help="the trainer's dtype (pipe bf16: DeepSpeed's ZeRO-1 bf16 optimizer)")
    parser.add_argument('--stage', type=int, choices=[0, 1], default=1,
                        help="the ZeRO stage (0 in bf16: DeepSpeed's BF16 optimizer)")
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    trainer = MODELS[args.model].trainer
    if not os.path.isfile(os.path.join(args.tools, trainer)):
        ds_e2e.skip(f'no DeepSpeed trainer {trainer} at {args.tools}')
    env = ds_e2e.trainer_environment(args)
    work = os.path.join(args.work, args.model + ('' if args.dtype == 'fp32' else '_' + args.dtype) +
                        ('' if args.stage == 1 else f'_stage{args.stage}'))
    if args.step != 'save' and not os.path.isfile(os.path.join(work, 'save.json')):
        fail(f'no saved checkpoint in {work} (run the save step first)')
    {'save': step_save, 'universal': step_universal, 'preload': step_preload,
     'preload_megatron_args': lambda *a: step_preload(*a, megatron_args=True)}[args.step](
        args, env, work)


if __name__ == '__main__':
    main()

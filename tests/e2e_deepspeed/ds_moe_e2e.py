#!/usr/bin/env python3
"""Real DeepSpeed-MoE end to end under LD_PRELOAD=libucp.so (CPU, gloo).

--model moe (the default): train_moe.py of ../shared/tools/deepspeed-cpu, train.py's model with
each block's MLP a deepspeed.moe.layer.MoE of 4 experts at expert-parallel size 2 (top-1, no
token dropping, no random gating: the function does not depend on the layout), ZeRO-2, fp32, a
fixed global batch. Saved at DP=4, resumed at DP=2, where DeepSpeed refuses the plain load ("used
a DP world size of 4 but the current world size is 2") and has no universal path (ds_to_universal
fails on MoE tags).

--model pipe: the MoE layers in a PipelineModule (train_moe_pipe.py beside this file: 4 MoE
blocks of 4 experts over 2 stages, ZeRO-1 fp32; each stage writes its own model states, expert
files numbered from layer 0 and optimizer files, as mp rank <stage>). Saved at PP=2 x DP=2 with
E=2, resumed at PP=2 x DP=1 with E=1, told by UCP_TOPOLOGY=pp=2,ep=1.

One CTest test per step, sharing WORK/<model>:

  save     at the save topology without and with the preload: steps 1..STEPS, saves tag
           global_step<SAVE_AT>; under the preload the save must leave a committed index,
           DeepSpeed's files byte for byte those of the run without it, and the same losses.
  preload  the plain load_checkpoint at the resume topology under the preload, steps
           SAVE_AT+1..STEPS. With no DeepSpeed oracle, the losses are held to the uninterrupted
           run's within TOLERANCE, and the served files must be the bytes `ucp reshard` writes
           for that target. For the pipeline, `ucp reshard` of those files back to the save
           topology must give the saved files, every object and tensor (a round trip).
  preload_ep1  (moe) the same at DP=2 with the trainer at expert-parallel size 1 (every rank
           holds all 4 experts), stated only on its command line as Megatron-LM's
           --expert-model-parallel-size 1 (megatron_args.py): ucp's log must name it as the
           evidence; served files `ucp reshard --to dp=2,ep=1`'s.
  preload_pp1  (pipe) the same at PP=1 x DP=2 (every layer on one stage, E=2), told by
           UCP_TOPOLOGY=pp=1: served files `ucp reshard --to pp=1,dp=2`'s, and those alike
           DeepSpeed's own PP=1 x DP=2 save in every object, key, shape and storage (a run of
           its own: tensor values differ). Then the other way, from one stage onto two: `ucp
           reshard` of ucp's PP=1 files to PP=2 x DP=2 gives the saved files, every object and
           tensor; DeepSpeed's own PP=1 save resumed at PP=2 x DP=1, E=1 under the preload
           (told by UCP_TOPOLOGY=pp=2,ep=1) continues that run's losses within TOLERANCE, its
           served files `ucp reshard`'s; and PP=4, where 'uniform' and 'parameters' place the
           layers differently, is refused as ambiguous; told partition=uniform it is refused
           too (its last stage would hold no MoE layer), told partition=parameters it is
           written, and `ucp reshard` of those four stages back to PP=1 gives DeepSpeed's own
           PP=1 files, every object and tensor.

Usage: ds_moe_e2e.py STEP [--model moe|pipe] --work DIR --tools DIR --lib LIBUCP --ucp UCP_CLI
                      --deepspeed VERSION [--required]
Exit status 77 with the reason when that DeepSpeed is not importable (ds_e2e.py's rule).
"""
import argparse
import os
import shutil
import subprocess
import sys

import ds_e2e
from ds_e2e import fail, log_tail, losses, preload_env, print_losses

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'deepspeed'))
import harness  # noqa: E402

SAVE_AT, STEPS = 3, 6
TAG = f'global_step{SAVE_AT}'
# |Δloss| allowed against the uninterrupted run: float32 summation over 2 against 4 partial
# gradients (the fixtures' uninterrupted DP=4 and DP=2 runs differ by up to 4.8e-7).
TOLERANCE = 1e-5


class Model:
    """A trainer; its (pp, dp, ep) at the save and at the resume (ep None: the save's, not told
    to ucp); the UCP_TOPOLOGY that tells the resume its target (None: nothing)."""

    def __init__(self, trainer, save, resume, topology):
        self.trainer, self.save, self.resume, self.topology = trainer, save, resume, topology


MODELS = {
    'moe': Model(['train_moe.py', '--stage', '2', '--experts', '4', '--k', '1'], (1, 4, 2),
                 (1, 2, None), None),
    'pipe': Model([os.path.join(HERE, 'train_moe_pipe.py')], (2, 2, 2), (2, 1, 1), 'pp=2,ep=1'),
}

MEGATRON_ARGS = os.path.join(HERE, 'megatron_args.py')
EP_FLAG = '--expert-model-parallel-size'


def launch(args, env, topology, name, extra, ep_flag=False):
    """The model's trainer at `topology` (pp, dp, ep; ep None: the save's), given its
    expert-parallel size as --ep or, with ep_flag, as Megatron's flag."""
    model = MODELS[args.model]
    pp, dp, ep = topology
    ep = model.save[2] if ep is None else ep
    trainer = [MEGATRON_ARGS] + model.trainer + [EP_FLAG, str(ep)] if ep_flag else \
        model.trainer + ['--ep', str(ep)]
    if args.model == 'pipe':
        trainer += ['--pp', str(pp)]
    command = [sys.executable, 'launch.py', str(pp * dp), ds_e2e.PORT] + trainer + \
        ['--steps', str(STEPS), '--out', os.path.join(args.work, name + '.json')] + extra
    return ds_e2e.run_past_flakes(
        lambda: ds_e2e.run_launcher(command, args.tools, env, os.path.join(args.work, name + '.log')),
        STEPS, ds_e2e.save_dir_of(extra))


def where(topology):
    pp, dp, ep = topology
    return (f'PP={pp} x ' if pp > 1 else '') + f'DP={dp}' + ('' if ep is None else f' at E={ep}')


def step_save(args, env):
    save = MODELS[args.model].save

    def run(name, run_env, save_dir):
        return launch(args, run_env, save, name, ['--save_dir', save_dir, '--save_at', str(SAVE_AT)])
    tag_dir, _, files = ds_e2e.save_with_and_without_preload(
        args, env, args.work, f'{where(save)} MoE', run)
    if not any(n.startswith('layer_0_expert_') for n in files):
        fail(f'no expert files among {files}')
    inspect = subprocess.run([args.ucp, 'inspect', tag_dir], capture_output=True, text=True)
    if 'adapter deepspeed-moe' not in inspect.stdout:
        fail(f'the index is not the deepspeed-moe adapter\'s:\n{inspect.stdout[:500]}'
             f'{inspect.stderr}')
    print(f'index committed by the deepspeed-moe adapter; {len(files)} files byte-identical to '
          f'the run without the preload')


def reshard(args, tag_dir, to, name):
    """`ucp reshard` of tag_dir to `to` into WORK/<name>; the resharded tag's directory."""
    out = os.path.join(args.work, name)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([args.ucp, 'reshard', tag_dir, '--to', to, '--out', out], check=True,
                   stdout=subprocess.DEVNULL)
    return os.path.join(out, TAG)


def check_round_trip(args, resharded, served):
    """`ucp reshard` of the files served at `served` (pp, dp, ep) back to the save's topology gives
    the saved files."""
    pp, dp, ep = MODELS[args.model].save
    to = ('' if pp == served[0] else f'pp={pp},') + f'dp={dp},ep={ep}'
    back = reshard(args, resharded, to, 'round_trip')
    names = check_same_files(os.path.join(args.work, 'ckpt', TAG), back, 'the round trip')
    print(f'round trip {where(served)} -> {where((pp, dp, ep))}: '
          f'{len(names)} files, every object and tensor the saved ones')


def check_like_deepspeed(args, env, resharded, topology):
    """ucp's files at `topology` alike DeepSpeed's own save there (its own run) in every object,
    key, shape and storage: all but tensor values and the run-config fields. DeepSpeed's tag
    directory."""
    own = os.path.join(args.work, 'deepspeed_{}x{}'.format(*topology[:2]))
    shutil.rmtree(own, ignore_errors=True)
    status, _, output = launch(args, env, topology, 'deepspeed_own',
                               ['--save_dir', own, '--save_at', str(SAVE_AT)])
    if status != 0:
        fail(f'DeepSpeed at {where(topology)} exited {status}:\n{output[-3000:]}')
    own = os.path.join(own, TAG)
    names = sorted(n for n in os.listdir(own) if n.endswith('.pt'))
    if sorted(n for n in os.listdir(resharded) if n.endswith('.pt')) != names:
        fail(f'ucp wrote {sorted(os.listdir(resharded))}, DeepSpeed {names}')
    report = harness.Report('like DeepSpeed')
    for name in names:
        report.diffs([d for d in harness.compare_files(os.path.join(own, name),
                                                       os.path.join(resharded, name),
                                                       harness.RUN_CONFIG_FIELDS)
                      if not d.endswith(' elements differ')], name)
    if report.failures:
        fail(f'ucp\'s files differ from DeepSpeed\'s own at {where(topology)} in '
             f'{len(report.failures)} places')
    print(f'{len(names)} files alike DeepSpeed\'s own save at {where(topology)} in every object, '
          f'key, shape and storage')
    return own


def check_onto_stages(args, env, own, topology):
    """DeepSpeed's own one-stage tag `own` (saved at `topology` by a run of its own) resumed on
    two stages at E=1 under the preload: the losses continue that run's, the served files are
    `ucp reshard`'s; four stages refused, since the partition methods disagree there, and
    written when told the trainer's, giving the save back at one stage."""
    resume, to = (2, topology[1] // 2, 1), f'pp=2,dp={topology[1] // 2},ep=1'
    subprocess.run([args.ucp, 'index', own], check=True, stdout=subprocess.DEVNULL)
    logs = os.path.join(args.work, 'logs_onto_stages')
    shutil.rmtree(logs, ignore_errors=True)
    run_env = dict(preload_env(env, args.lib, logs), UCP_TOPOLOGY='pp=2,ep=1')
    status, seconds, output = launch(args, run_env, resume, 'onto_stages',
                                     ['--load_dir', os.path.dirname(own)])
    if status != 0:
        fail(f'the PP=1 save resumed at {where(resume)} under the preload exited {status}:\n'
             f'{output[-3000:]}\nucp logs:\n{log_tail(logs)}')
    got = losses(os.path.join(args.work, 'onto_stages.json'))
    full = losses(os.path.join(args.work, 'deepspeed_own.json'))
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    if sorted(got) != steps:
        fail(f'resumed steps {sorted(got)}, expected {steps}')
    print_losses(f'losses {where(resume)} from the PP=1 save', got)
    print_losses(f'losses {where(topology)} uninterrupted', {s: full[s] for s in steps})
    worst = max(abs(got[s] - full[s]) for s in steps)
    if worst > TOLERANCE:
        fail(f'max |Δloss| {worst:.3g} against the uninterrupted PP=1 run exceeds {TOLERANCE}')
    print(f'{where(resume)} from DeepSpeed\'s PP=1 save under the preload: {seconds:.1f} s, max '
          f'|Δloss| against its uninterrupted run {worst:.3g}')
    check_served(own, reshard(args, own, to, 'reshard_onto_stages'),
                 os.path.join(own, '.ucp', 'views', 'tp1-pp2-dp{}-ep1'.format(resume[1])), to, logs)
    refused = subprocess.run([args.ucp, 'reshard', own, '--to', 'pp=4,dp=1,ep=1', '--out',
                              os.path.join(args.work, 'pp4')], capture_output=True, text=True)
    if refused.returncode == 0 or 'ambiguous layer placement' not in refused.stderr:
        fail(f'pp=4 was not refused as ambiguous (exit {refused.returncode}): {refused.stderr}')
    print(f'pp=4 refused: {refused.stderr.strip()}')
    # Told 'uniform': its last stage would hold the head alone, and DeepSpeed sets up no MoE
    # pipeline with a stage without MoE layers (train_moe_pipe.py hangs there): refused. Told
    # 'parameters' ([0, 2, 3, 4, 6]): the four stages, and back onto one stage the saved files.
    refused = subprocess.run([args.ucp, 'reshard', own, '--to', 'pp=4,dp=1,ep=1,partition=uniform',
                              '--out', os.path.join(args.work, 'pp4')], capture_output=True,
                             text=True)
    if refused.returncode == 0 or 'stage 3 holds no MoE layer' not in refused.stderr:
        fail(f'pp=4,partition=uniform was not refused for its stage without MoE layers (exit '
             f'{refused.returncode}): {refused.stderr}')
    pp4 = reshard(args, own, 'pp=4,dp=1,ep=1,partition=parameters', 'pp4_parameters')
    models = sorted(n for n in os.listdir(pp4) if n.startswith('mp_rank_'))
    if len(models) != 4:
        fail(f'pp=4,partition=parameters wrote model states {models}')
    own_ep = MODELS[args.model].save[2] if topology[2] is None else topology[2]
    back = reshard(args, pp4, f'pp=1,dp={topology[1]},ep={own_ep}', 'pp4_back')
    names = check_same_files(own, back, 'pp=4 and back')
    print(f'pp=4 told partition=parameters: {len(models)} stages; back at {where(topology)}: '
          f'{len(names)} files, every object and tensor the saved ones; partition=uniform '
          f'refused: {refused.stderr.strip()}')


def check_served(saved, resharded, view, to, logs):
    """The files the preload served from `view` are the bytes `ucp reshard` wrote into
    `resharded`: all but the expert files the tag `saved` has under the same name, which pass
    through (the others are made, or where pipeline stages are restaged renamed, for the
    target)."""
    served = sorted(n for n in os.listdir(resharded) if n.endswith('.pt') and not (
        n.startswith(('layer_', 'expp_')) and os.path.isfile(os.path.join(saved, n))))
    ds_e2e.check_served(view, resharded, served, to, logs)


def check_same_files(expected, got, what):
    """The .pt files of the tag `got` are those of `expected`, every object and tensor."""
    names = sorted(n for n in os.listdir(expected) if n.endswith('.pt'))
    if sorted(n for n in os.listdir(got) if n.endswith('.pt')) != names:
        fail(f'{what} wrote {sorted(os.listdir(got))}, expected {names}')
    report = harness.Report(what)
    for name in names:
        report.diffs(harness.compare_files(os.path.join(expected, name), os.path.join(got, name)),
                     name)
    if report.failures:
        fail(f'{what} differs from the expected files in {len(report.failures)} places')
    return names


def step_preload(args, env, ep=None, pp=None):
    """The resume at the model's resume topology under the preload; with `ep`, at that
    expert-parallel size, told only by the trainer's Megatron flag; with `pp`, at that pipeline
    degree and the save's DP and E, told by UCP_TOPOLOGY."""
    work = args.work
    model = MODELS[args.model]
    resume = model.resume if ep is None else model.resume[:2] + (ep,)
    topology = model.topology
    if pp is not None:
        resume, topology = (pp, model.save[1], None), f'pp={pp}'
    name = 'preload' + ('' if ep is None else f'_ep{ep}') + ('' if pp is None else f'_pp{pp}')
    logs = os.path.join(work, 'logs_' + name)
    shutil.rmtree(logs, ignore_errors=True)
    run_env = preload_env(env, args.lib, logs)
    if topology:
        run_env['UCP_TOPOLOGY'] = topology
    status, seconds, output = launch(args, run_env, resume, name,
                                     ['--load_dir', os.path.join(work, 'ckpt')], ep is not None)
    if status != 0:
        fail(f'plain load_checkpoint at {where(resume)} under the preload exited {status}:\n'
             f'{output[-3000:]}\nucp logs:\n{log_tail(logs)}')
    print(f'{where(resume)}: plain resume under the preload: {seconds:.1f} s')
    if ep is not None:
        said = f'ep={ep} ({EP_FLAG} {ep})'
        logged = ''.join(open(os.path.join(logs, n), errors='replace').read()
                         for n in sorted(os.listdir(logs)))
        if said not in logged:
            fail(f'no ucp log names {said!r} as the evidence of the target:\n{log_tail(logs)}')
        print(f'ucp took the target from the trainer: {said}')
    got = losses(os.path.join(work, name + '.json'))
    full = losses(os.path.join(work, 'plain.json'))
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    if sorted(got) != steps:
        fail(f'resumed steps {sorted(got)}, expected {steps}')
    print_losses('losses preload', got)
    print_losses(f'losses {where(model.save)} uninterrupted', {s: full[s] for s in steps})
    worst = max(abs(got[s] - full[s]) for s in steps)
    if worst > TOLERANCE:
        fail(f'max |Δloss| {worst:.3g} against the uninterrupted run exceeds {TOLERANCE}')
    print(f'max |Δloss| against the uninterrupted {where(model.save)} run: {worst:.3g}')
    at_pp, dp, told_ep = resume
    view = os.path.join(work, 'ckpt', TAG, '.ucp', 'views',
                        f'tp1-pp{at_pp}-dp{dp}' + ('' if told_ep is None else f'-ep{told_ep}'))
    to = ('' if args.model == 'moe' else f'pp={at_pp},') + f'dp={dp}' + \
        ('' if told_ep is None else f',ep={told_ep}')
    saved = os.path.join(work, 'ckpt', TAG)
    resharded = reshard(args, saved, to, 'reshard_' + name)
    check_served(saved, resharded, view, to, logs)
    if args.model == 'pipe':
        check_round_trip(args, resharded, resume)
    if args.model == 'pipe' and pp is not None:
        check_onto_stages(args, env, check_like_deepspeed(args, env, resharded, resume), resume)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('step', choices=['save', 'preload', 'preload_ep1', 'preload_pp1'])
    parser.add_argument('--model', choices=sorted(MODELS), default='moe')
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    trainer = MODELS[args.model].trainer[0]
    if not os.path.isfile(os.path.join(args.tools, trainer)):
        ds_e2e.skip(f'no DeepSpeed trainer {trainer} at {args.tools}')
    if {'pipe': 'preload_ep1', 'moe': 'preload_pp1'}[args.model] == args.step:
        fail(f'{args.step} is not a step of --model {args.model}')
    env = ds_e2e.trainer_environment(args)
    args.work = os.path.join(args.work, 'moe' if args.model == 'moe' else 'moe_' + args.model)
    if args.step != 'save' and not os.path.isfile(os.path.join(args.work, 'save.json')):
        fail(f'no saved checkpoint in {args.work} (run the save step first)')
    {'save': step_save, 'preload': step_preload,
     'preload_ep1': lambda *a: step_preload(*a, ep=1),
     'preload_pp1': lambda *a: step_preload(*a, pp=1)}[args.step](args, env)


if __name__ == '__main__':
    main()

#!/usr/bin/env python3
"""Native DeepSpeed-MoE over a Megatron-style mpu's tensor parallelism, end to end under
LD_PRELOAD=libucp.so (CPU, gloo), with the release under test.

train_moe_tp.py beside this file: train_tp.py's Megatron-style GPT (column/row-parallel attention,
a padded vocabulary-parallel embedding and output layer) with each MLP a deepspeed.moe.layer.MoE of
4 whole experts, ZeRO-1, fp32. DeepSpeed's default grouping (no expert tensor parallelism): the
expert-parallel groups are runs of E consecutive ranks across the TP ranks, each expert's file is
written once, under TP rank (expert-parallel rank mod T). DeepSpeed loads such a save only at its
own grid (its plain load checks the DP size; ds_to_universal does not place native experts), so
the oracles are DeepSpeed's strict loads of ucp's files, saved again before they train, and the
uninterrupted run's losses.

One CTest test per step, sharing WORK/moe_tp:

  save     T=2 x DP=2 at E=2 (4 ranks) without and with the preload: steps 1..STEPS, saves tag
           global_step<SAVE_AT>; under the preload the save must leave a committed index,
           DeepSpeed's files byte for byte those of the run without it, the same losses; and the
           index's atoms (`ucp export --format safetensors`, the module's tensors) every dense
           tensor the TP slices made whole by universal_checkpoint_info's rules (the vocabulary
           unpadded), every expert tensor its file's.
  reshard  `ucp reshard` to T=1 x DP=2 at E=2, T=4 x DP=1 at E=2 and T=2 x DP=2 at E=4; at each,
           DeepSpeed's strict load of ucp's files saved again before it trains equals them in
           every object and bit but the run's micro batch (where T > E DeepSpeed's save lacks the
           model states of TP ranks >= E and the expert files of lanes other than e mod T, which
           its own load reads: ucp writes them), its losses within TOLERANCE of the uninterrupted
           run's; and ucp's files resharded back to T=2 x DP=2 at E=2 equal the save (from T=1 by
           universal_checkpoint_info's rules, which a tag of one TP rank records as well). Then
           what ucp refuses, naming it (check_refusals).
  preload  the plain load_checkpoint at T=1 x DP=2 under the preload, told tp=1 by UCP_TOPOLOGY:
           losses bit-identical to DeepSpeed's strict load of `ucp reshard`'s files (the reshard
           step's), every file served `ucp reshard`'s.

And in WORK/moe_tp_data_before, a save of its own:

  data_before  DeepSpeed's other rank order (use_data_before_expert_parallelism: runs of W/E
           consecutive ranks are one expert-parallel rank's): a T=1 x DP=4 save at E=2 (its
           model states record Megatron's rules) resharded to T=2 x DP=2 at E=2, checked as the
           reshard step checks a target. DeepSpeed's own save there writes lane 0 alone (its
           writers are the ranks of expert-data-parallel rank 0, ranks 0 and 2): ucp writes
           mp_rank_01 and lane 1's expert files too, and refuses DeepSpeed's, naming the file.

And each with a save of its own (WORK/moe_tp_<step>):

  expert_tp  expert tensor parallelism (train_moe_tp.py --expert_tp): a T=2 x DP=2 save at E=2
           whose lanes hold slices of every expert, resharded to T=1 x DP=2 at E=2 and
           T=4 x DP=1 at E=1 (check_target; DeepSpeed's own save there lacks nothing), resumed
           live at the latter under the preload (step_expert_tp).
  pipeline  MoE in a T=2 x PP=2 x DP=1 pipeline (train_moe_3d.py) at E=2, resharded at its pp
           to T=1 x DP=2 at E=2 and E=1, and onto one stage at T=2 x DP=2 and T=1 x DP=4, and
           back; resumed live on one stage (step_pipeline).

Usage: ds_moe_tp_e2e.py save|reshard|preload|data_before|expert_tp|pipeline --work DIR
                         --tools DIR --lib LIBUCP --ucp UCP_CLI --deepspeed VERSION [--required]
Exit status 77 with the reason when that DeepSpeed is not importable (ds_e2e.py's rule).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

import ds_e2e
from ds_e2e import fail, float32_bits, log_tail, losses, preload_env, print_losses
from ds_moe_e2e import TAG, reshard  # the same tag, `ucp reshard` into WORK/<name>

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'deepspeed'))
import ds_objects  # noqa: E402
import harness  # noqa: E402

TRAINER = os.path.join(HERE, 'train_moe_tp.py')
PIPELINE_TRAINER = os.path.join(HERE, 'train_moe_3d.py')
SAVE_AT, STEPS = 3, 6
SAVE = (2, 2, 2)  # (tp, dp, ep)
# |Δloss| allowed against the uninterrupted run: float32 sums over other TP and DP splits.
TOLERANCE = 1e-5
TARGETS = [(1, 2, 2), (4, 1, 2), (2, 2, 4)]
RESUME = (1, 2, 2)
# The data_before step's save and target (tp, dp, ep).
DATA_BEFORE_SAVE, DATA_BEFORE_TARGET = (1, 4, 2), (2, 2, 2)
# The expert_tp step's targets (E' must divide D' there) and its live resume.
EXPERT_TP_TARGETS = [(1, 2, 2), (4, 1, 1)]
EXPERT_TP_RESUME = (4, 1, 1)
# The pipeline step's save, targets and live resume (tp, pp, dp, ep).
PIPELINE_SAVE = (2, 2, 1, 2)
PIPELINE_TARGETS = [(1, 2, 2, 2), (1, 2, 2, 1), (2, 1, 2, 2), (1, 1, 4, 2)]
PIPELINE_RESUME = (2, 1, 2, 2)


# A grid is (tp, dp, ep) for train_moe_tp.py, (tp, pp, dp, ep) for train_moe_3d.py's pipeline.
def axes_of(grid):
    return list(zip(('tp', 'dp', 'ep') if len(grid) == 3 else ('tp', 'pp', 'dp', 'ep'), grid))


def name_of(grid):
    return ''.join(f'{axis}{size}' for axis, size in axes_of(grid))


def to_of(grid):
    return ','.join(f'{axis}={size}' for axis, size in axes_of(grid))


def launch(args, env, grid, name, extra):
    """train_moe_tp.py (train_moe_3d.py for a pipeline's grid) at `grid` through STEPS; returns
    (status, seconds, output)."""
    sizes = dict(axes_of(grid))
    trainer, ranks, flags = TRAINER, sizes['tp'] * sizes['dp'], []
    if 'pp' in sizes:
        trainer, ranks, flags = PIPELINE_TRAINER, ranks * sizes['pp'], ['--pp', str(sizes['pp'])]
    command = [sys.executable, 'launch.py', str(ranks), ds_e2e.PORT, trainer, '--tp',
               str(sizes['tp']), '--ep', str(sizes['ep']), '--steps', str(STEPS), '--out',
               os.path.join(args.work, name + '.json')] + flags + extra
    log = os.path.join(args.work, name + '.log')
    return ds_e2e.run_past_flakes(lambda: ds_e2e.run_launcher(command, args.tools, env, log),
                                  STEPS, ds_e2e.save_dir_of(extra))


def step_save(args, env):
    def run(name, run_env, save_dir):
        return launch(args, run_env, SAVE, name,
                      ['--save_dir', save_dir, '--save_at', str(SAVE_AT)])
    tag_dir, _, files = ds_e2e.save_with_and_without_preload(args, env, args.work,
                                                             'T=2 x DP=2 MoE at E=2', run)
    # DeepSpeed's writers: each expert once, under TP rank (its expert-parallel rank) mod T.
    experts = sorted(n for n in files if n.startswith('layer_'))
    expected = sorted(f'layer_{layer}_expert_{g}_mp_rank_{(g // 2) % 2:02d}_model_states.pt'
                      for layer in range(2) for g in range(4))
    if experts != expected:
        fail(f'expert files {experts}, expected {expected}')
    inspect = subprocess.run([args.ucp, 'inspect', tag_dir], capture_output=True, text=True)
    if 'adapter deepspeed-moe' not in inspect.stdout:
        fail(f'the index is not the deepspeed-moe adapter\'s:\n{inspect.stdout[:500]}'
             f'{inspect.stderr}')
    check_atoms(args, env, tag_dir)


def check_atoms(args, env, tag_dir):
    """The index's bit16 atoms against the TP slices merged by universal_checkpoint_info's rules
    (replicated: lane 0's, row-parallel: on dim 1, else on dim 0; the vocabulary unpadded): the
    lanes' module tensors, and each expert's tensors in its files (one file, or with expert tensor
    parallelism one per lane)."""
    export = os.path.join(args.work, 'export_bit16')
    shutil.rmtree(export, ignore_errors=True)
    subprocess.run([args.ucp, 'export', tag_dir, '--format', 'safetensors', '--state', 'bit16',
                    '--out', export], check=True, stdout=subprocess.DEVNULL)
    import torch
    from safetensors.torch import load_file
    atoms = {}
    for name in os.listdir(export):
        if name.endswith('.safetensors'):
            atoms.update(load_file(os.path.join(export, name)))
    tp = SAVE[0]
    lanes = [ds_objects.load(os.path.join(tag_dir, f'mp_rank_{t:02d}_model_states.pt'))
             for t in range(tp)]
    info = lanes[0]['universal_checkpoint_info']
    rules = {key: [re.compile(p) for p in info[key]]
             for key in ('tp_replicated_parameter_patterns',
                         'parameter_with_row_parallelism_patterns',
                         'vocabulary_parameter_patterns')}

    def named(key, name):
        return any(p.match(name) for p in rules[key])

    def merged(name, slices):
        if len(slices) == 1 or named('tp_replicated_parameter_patterns', name):
            whole = slices[0]
        else:
            whole = torch.cat(slices, 1 if named('parameter_with_row_parallelism_patterns', name)
                              else 0)
        if named('vocabulary_parameter_patterns', name):
            whole = whole[:info['original_vocab_size']]
        return whole
    wrong = []
    for name in lanes[0]['module']:
        if name not in atoms or not torch.equal(atoms[name],
                                                merged(name, [l['module'][name] for l in lanes])):
            wrong.append(name)
    expert_slices = {}  # an expert's tensors in lane order (the files are named by lane)
    for name in sorted(os.listdir(tag_dir)):
        if name.startswith('layer_'):
            for key, tensor in ds_objects.load(os.path.join(tag_dir, name)).items():
                expert_slices.setdefault(key, []).append(tensor)
    experts = len(expert_slices)
    for key, slices in expert_slices.items():
        if key not in atoms or not torch.equal(atoms[key], merged(key, slices)):
            wrong.append(key)
    if wrong or len(atoms) != len(lanes[0]['module']) + experts:
        fail(f'bit16 atoms unlike the TP slices merged: {wrong[:5]}; {len(atoms)} atoms')
    print(f'index atoms = the TP slices merged by universal_checkpoint_info: '
          f'{len(lanes[0]["module"])} dense parameters, {experts} expert tensors')


def compare(report, expected, got, what, extra=None):
    """The tag `got` holds `expected`'s .pt files, every object and bit but the run's micro batch,
    and besides them exactly the files `extra` names, each like the expected file it names (None:
    no file of `expected` is like it)."""
    extra = extra or {}
    names = sorted(n for n in os.listdir(expected) if n.endswith('.pt'))
    have = sorted(n for n in os.listdir(got) if n.endswith('.pt'))
    report.check(have == sorted(names + list(extra)),
                 f'{what}: files {have}, expected {names} and {sorted(extra)}')
    pairs = [(n, n) for n in names] + [(n, like) for n, like in extra.items() if like]
    for name, like in pairs:
        report.diffs(harness.compare_files(os.path.join(expected, like), os.path.join(got, name),
                                           harness.RUN_CONFIG_FIELDS), f'{what}/{name}')


def beyond_deepspeed(grid, data_before=False):
    """The files of ucp's files at `grid` that DeepSpeed's save there lacks though its load reads
    them, each with the file of DeepSpeed's it must be like. DeepSpeed's writers are the ranks of
    expert-data-parallel rank 0 (with `data_before` in use_data_before_expert_parallelism's order:
    runs of W/E ranks one expert-parallel rank's): so the model states of each TP rank t that is
    not one (none), and each expert's file under a TP rank whose ranks hold it other than its
    writer's (the expert's file under the writer's lane)."""
    tp, dp, ep = grid
    world = tp * dp

    def expert_rank(r):
        return r // (world // ep) if data_before else r % ep

    def expert_dp_rank(r):
        return r % (world // ep) if data_before else r // ep

    def writer(e):  # the rank of expert-parallel rank e and expert-data-parallel rank 0
        return e * (world // ep) if data_before else e

    # Lane t's model states are written by rank t (dense-data-parallel rank 0) where it writes.
    files = {f'mp_rank_{t:02d}_model_states.pt': None for t in range(tp) if expert_dp_rank(t) != 0}
    for g in range(4):
        e = g // (4 // ep)
        for t in sorted({r % tp for r in range(world) if expert_rank(r) == e} - {writer(e) % tp}):
            for layer in range(2):
                name = f'layer_{layer}_expert_{g}_mp_rank_{{:02d}}_model_states.pt'
                files[name.format(t)] = name.format(writer(e) % tp)
    return files


def check_refusals(args, report, saved):
    """What ucp refuses of such tags, naming the reason: a save lacking a TP rank's model states
    (DeepSpeed's own at T > E), lanes holding unlike copies of a replicated parameter, an expert
    group partitioned as expert tensor parallelism does where the Megatron args say the run had
    none, a pipeline of a model whose layers are not numbered, and a TP degree the rules do not
    divide."""
    def copy(name):
        tag = harness.copy_tag(saved, os.path.join(args.work, 'refused', name, TAG))
        shutil.rmtree(os.path.join(tag, '.ucp'), ignore_errors=True)
        return tag
    cases = []
    tag = copy('lane_missing')
    os.remove(os.path.join(tag, 'mp_rank_01_model_states.pt'))
    cases.append(('a lane\'s model states missing', ['index', tag],
                  'mp_rank_01_model_states.pt: not found (tp_degree 2 in '
                  'mp_rank_00_model_states.pt); '
                  'DeepSpeed writes a TP rank\'s model states from a rank of expert- and '
                  'dense-data-parallel rank 0 only'))
    tag = copy('unlike_replica')
    lane1 = os.path.join(tag, 'mp_rank_01_model_states.pt')
    states = ds_objects.load(lane1)
    states['module']['final_layernorm.weight'][0] += 1
    ds_objects.save(states, lane1)
    cases.append(('unlike copies of a replicated parameter', ['index', tag],
                  'final_layernorm.weight: universal_checkpoint_info has every TP rank hold it '
                  'whole (or names it in no rule), but its bit16 of TP lane 1 differs'))
    # Expert tensor parallelism partitions the expert group over D/E ranks (here 1), not W/E: so
    # do these files, but their Megatron args record the run without it.
    tag = copy('expert_tensor_parallel')
    for name in sorted(os.listdir(tag)):
        if name.startswith('zero_pp_rank_'):
            states = ds_objects.load(os.path.join(tag, name))
            states['optimizer_state_dict']['partition_count'][1] = 1
            ds_objects.save(states, os.path.join(tag, name))
    cases.append(('an expert group partitioned as the args do not say', ['index', tag],
                  'args/enable_expert_tensor_parallelism: False, but'))
    out = os.path.join(args.work, 'refused', 'out')
    cases.append(('pp=2 of a model that is no PipelineModule',
                  ['reshard', saved, '--to', 'tp=2,pp=2,dp=1', '--out', out],
                  'word_embeddings.weight names no numbered layer'))
    cases.append(('tp=3', ['reshard', saved, '--to', 'tp=3,dp=1,ep=1', '--out', out],
                  'does not split evenly'))
    check_refused(report, args, cases, out)


def check_refused(report, args, cases, out):
    """Each of `cases`, (what, ucp's arguments, words), fails naming the reason: its error holds
    the words. `out`: the output folder the arguments name, emptied before each."""
    for what, command, words in cases:
        shutil.rmtree(out, ignore_errors=True)
        status, _, err = harness.run_ucp(args.ucp, *command)
        report.check(status != 0 and words in err, f'{what}: not refused as expected: {err}')
        print(f'refused, {what}: {err.strip()}')


def check_target(args, env, report, saved, source, grid, full, extra=(), beyond=None, back=None):
    """`ucp reshard` of `saved` (at grid `source`) to `grid`: DeepSpeed's strict load of ucp's
    files there (run with `extra` arguments), saved again before it trains, equals them but for
    the files `beyond` names, which its save lacks (beyond_deepspeed), its steps after SAVE_AT are
    within TOLERANCE of `full`'s, and ucp's files resharded back to `source` (`back`: that
    --to) are the save."""
    name = name_of(grid)
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    out = reshard(args, saved, to_of(grid), 'reshard_' + name)
    resave = os.path.join(args.work, 'resave_' + name)
    shutil.rmtree(resave, ignore_errors=True)
    status, _, output = launch(args, env, grid, 'load_' + name,
                               list(extra) + ['--load_dir', os.path.dirname(out), '--save_dir',
                                              resave, '--save_at', str(SAVE_AT)])
    if status != 0:
        fail(f'DeepSpeed\'s load of ucp\'s {name} files exited {status}:\n{output[-3000:]}')
    got = losses(os.path.join(args.work, f'load_{name}.json'))
    print_losses(f'losses {name} (DeepSpeed\'s load of ucp\'s files)', got)
    worst = max(abs(got[s] - full[s]) for s in steps)
    report.check(sorted(got) == steps and worst <= TOLERANCE,
                 f'{name}: max |Δloss| {worst:.3g} against the uninterrupted run')
    beyond = beyond or {}
    compare(report, os.path.join(resave, TAG), out, f'{name} vs DeepSpeed\'s resave', beyond)
    back = reshard(args, out, back or to_of(source), f'reshard_{name}_back')
    compare(report, saved, back, f'{name} -> {name_of(source)}')
    print(f'{name}: ucp\'s files = DeepSpeed\'s strict load and resave there'
          f'{f" (and the {len(beyond)} files it lacks)" if beyond else ""}; max |Δloss| '
          f'{worst:.3g}; back = the save')


def step_reshard(args, env):
    saved = os.path.join(args.work, 'ckpt', TAG)
    full = losses(os.path.join(args.work, 'plain.json'))
    report = harness.Report('moe_tp reshard')
    for grid in TARGETS:
        check_target(args, env, report, saved, SAVE, grid, full, beyond=beyond_deepspeed(grid))
    print_losses('losses uninterrupted', {s: full[s] for s in range(SAVE_AT + 1, STEPS + 1)})
    check_refusals(args, report, saved)
    report.exit()


def step_data_before(args, env):
    """DeepSpeed's other rank order (use_data_before_expert_parallelism: runs of W/E consecutive
    ranks one expert-parallel rank's, across the TP ranks): DeepSpeed's own save at T=1 x DP=4,
    E=2 resharded to T=2 x DP=2, E=2 (check_target), where DeepSpeed's save would write lane 0
    only."""
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    order = ['--data_before_expert']
    status, seconds, output = launch(args, env, DATA_BEFORE_SAVE, 'plain',
                                     order + ['--save_dir', os.path.join(args.work, 'ckpt'),
                                              '--save_at', str(SAVE_AT)])
    if status != 0:
        fail(f'DeepSpeed {name_of(DATA_BEFORE_SAVE)} in the data-before-expert order exited '
             f'{status}:\n{output[-3000:]}')
    print(f'{name_of(DATA_BEFORE_SAVE)} in the data-before-expert order: {seconds:.1f} s')
    report = harness.Report('moe_tp data before expert')
    check_target(args, env, report, os.path.join(args.work, 'ckpt', TAG), DATA_BEFORE_SAVE,
                 DATA_BEFORE_TARGET, losses(os.path.join(args.work, 'plain.json')), order,
                 beyond_deepspeed(DATA_BEFORE_TARGET, data_before=True))
    # DeepSpeed's own save at the target (its resave there) lacks lane 1: refused, naming it.
    resave = os.path.join(args.work, 'resave_' + name_of(DATA_BEFORE_TARGET), TAG)
    status, _, err = harness.run_ucp(args.ucp, 'index', resave)
    report.check(status != 0 and 'mp_rank_01_model_states.pt: not found' in err and
                 'with use_data_before_expert_parallelism: above 1' in err,
                 f'DeepSpeed\'s own save without lane 1: not refused as expected: {err}')
    print(f'refused, DeepSpeed\'s own save there: {err.strip()}')
    report.exit()


def check_live_resume(args, env, grid, topology, view, extra=()):
    """A plain load_checkpoint of WORK/ckpt at `grid` under the preload, told `topology` by
    UCP_TOPOLOGY: losses bit-identical to DeepSpeed's strict load of `ucp reshard`'s files there
    (check_target's), every file it reads that the save lacks served from the view cache `view`
    as `ucp reshard` wrote it."""
    name = name_of(grid)
    oracle = os.path.join(args.work, f'load_{name}.json')
    if not os.path.isfile(oracle):
        fail(f'no strict load of ucp\'s {name} files in {args.work} (run the reshard step first)')
    logs = os.path.join(args.work, 'logs_preload')
    shutil.rmtree(logs, ignore_errors=True)
    run_env = dict(preload_env(env, args.lib, logs), UCP_TOPOLOGY=topology)
    status, seconds, output = launch(args, run_env, grid, 'preload',
                                     list(extra) + ['--load_dir', os.path.join(args.work, 'ckpt')])
    if status != 0:
        fail(f'plain load_checkpoint at {name} under the preload exited {status}:\n'
             f'{output[-3000:]}\nucp logs:\n{log_tail(logs)}')
    print(f'{name}: plain resume under the preload: {seconds:.1f} s')
    got, want = losses(os.path.join(args.work, 'preload.json')), losses(oracle)
    print_losses('losses preload', got)
    print_losses('losses DeepSpeed\'s load of ucp\'s files', want)
    def bits(values):
        return {s: float32_bits(v) for s, v in values.items()}
    if bits(got) != bits(want):
        fail('the resume under the preload differs from DeepSpeed\'s load of ucp\'s files')
    print('losses bit-identical to DeepSpeed\'s load of `ucp reshard`\'s files')
    resharded = os.path.join(args.work, 'reshard_' + name, TAG)
    saved = os.path.join(args.work, 'ckpt', TAG)
    served = sorted(n for n in os.listdir(resharded) if n.endswith('.pt') and not (
        n.startswith('layer_') and os.path.isfile(os.path.join(saved, n)) and
        open(os.path.join(saved, n), 'rb').read() ==
        open(os.path.join(resharded, n), 'rb').read()))
    ds_e2e.check_served(os.path.join(saved, '.ucp', 'views', view), resharded, served,
                        to_of(grid), logs)


def step_preload(args, env):
    check_live_resume(args, env, RESUME, f'tp={RESUME[0]}', f'tp1-pp1-dp{RESUME[1]}')


def step_expert_tp(args, env):
    """Expert tensor parallelism (enable_expert_tensor_parallelism, train_moe_tp.py --expert_tp):
    a T=2 x DP=2 save at E=2, each expert split over the TP ranks (Megatron's ParallelMLP) and
    every lane writing its slices of every expert, the expert groups within each lane's DP ranks.
    Saved without and with the preload (the same bytes and losses, indexed at save), its atoms
    each expert whole by the rules, resharded to each of EXPERT_TP_TARGETS (check_target: there
    DeepSpeed's own save lacks nothing), resumed live at EXPERT_TP_RESUME under the preload, and
    a target DeepSpeed cannot run with it refused."""
    expert_tp = ['--expert_tp']

    def run(name, run_env, save_dir):
        return launch(args, run_env, SAVE, name,
                      expert_tp + ['--save_dir', save_dir, '--save_at', str(SAVE_AT)])
    tp, dp, ep = SAVE
    expected = ([f'mp_rank_{t:02d}_model_states.pt' for t in range(tp)] +
                [f'zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt'
                 for d in range(dp) for t in range(tp)] +
                [f'layer_{layer}_expert_{g}_mp_rank_{t:02d}_model_states.pt'
                 for layer in range(2) for g in range(4) for t in range(tp)])
    tag_dir, _, _ = ds_e2e.save_with_and_without_preload(
        args, env, args.work, 'T=2 x DP=2 MoE at E=2 with expert tensor parallelism', run,
        sorted(expected))
    check_atoms(args, env, tag_dir)
    report = harness.Report('moe_tp expert tensor parallelism')
    full = losses(os.path.join(args.work, 'plain.json'))
    for grid in EXPERT_TP_TARGETS:
        # Every lane's expert-data-parallel rank 0 writes: DeepSpeed's save lacks nothing.
        check_target(args, env, report, tag_dir, SAVE, grid, full, expert_tp)
    out = os.path.join(args.work, 'refused')
    check_refused(report, args, [('tp=4,dp=1,ep=2', ['reshard', tag_dir, '--to', 'tp=4,dp=1,ep=2',
                                                     '--out', out],
                                  'the dense-data-parallel size 1 is not a multiple of the '
                                  'expert-parallel size 2')], out)
    tp, dp, ep = EXPERT_TP_RESUME
    check_live_resume(args, env, EXPERT_TP_RESUME, f'tp={tp},ep={ep}', f'tp{tp}-pp1-dp{dp}-ep{ep}',
                      expert_tp)
    report.exit()


def step_pipeline(args, env):
    """MoE in a tensor- and pipeline-parallel model (train_moe_3d.py: train_3d.py's GPT pipeline,
    each transformer layer's MLP an MoE): a T=2 x PP=2 x DP=1 save at E=2 (4 ranks; each stage's
    files under mp ranks stage * T + t) saved without and with the preload (the same bytes and
    losses, indexed at save), resharded to each of PIPELINE_TARGETS, at its pp and onto one stage
    (DeepSpeed's strict load of ucp's files there saved again before it trains equals them, its
    steps within TOLERANCE of the uninterrupted run, and back = the save: from one stage split
    again where the trainer's 'type:' placement puts the layers, which `--to` names since
    'parameters' gives the saved stages too), ucp's T=1 x PP=2 files (stages of one TP lane whose
    padded vocabulary the atoms keep unpadded) onto one stage as the save is, four stages refused
    (a stage would hold no MoE layer), and resumed live on one stage under the preload."""
    def run(name, run_env, save_dir):
        return launch(args, run_env, PIPELINE_SAVE, name,
                      ['--save_dir', save_dir, '--save_at', str(SAVE_AT)])
    tag_dir, _, _ = ds_e2e.save_with_and_without_preload(
        args, env, args.work, 'T=2 x PP=2 x DP=1 MoE at E=2', run)
    full = losses(os.path.join(args.work, 'plain.json'))
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    report = harness.Report('moe_tp pipeline')
    _, pp, _, _ = PIPELINE_SAVE
    for grid in PIPELINE_TARGETS:
        back = None if grid[1] == pp else to_of(PIPELINE_SAVE) + ',partition=type'
        check_target(args, env, report, tag_dir, PIPELINE_SAVE, grid, full, back=back)
    print_losses('losses uninterrupted', {s: full[s] for s in steps})
    one_lane = os.path.join(args.work, 'reshard_' + name_of(PIPELINE_TARGETS[0]), TAG)
    one_stage = name_of(PIPELINE_TARGETS[-1])
    got = reshard(args, one_lane, to_of(PIPELINE_TARGETS[-1]), 'reshard_one_lane_' + one_stage)
    compare(report, os.path.join(args.work, 'reshard_' + one_stage, TAG), got,
            f'{name_of(PIPELINE_TARGETS[0])} -> {one_stage} vs the save\'s')
    out = os.path.join(args.work, 'refused')
    check_refused(report, args, [
        ('pp=4', ['reshard', tag_dir, '--to', 'tp=1,pp=4,dp=1,ep=1,partition=type', '--out', out],
         'stage 2 holds no MoE layer')], out)

    tp, pp, dp, ep = PIPELINE_RESUME
    check_live_resume(args, env, PIPELINE_RESUME, f'tp={tp},pp={pp},ep={ep}',
                      f'tp{tp}-pp{pp}-dp{dp}-ep{ep}')
    report.exit()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('step', choices=['save', 'reshard', 'preload', 'data_before', 'expert_tp',
                                         'pipeline'])
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    for trainer in ('train_tp.py', 'train_3d.py'):
        if not os.path.isfile(os.path.join(args.tools, trainer)):
            ds_e2e.skip(f'no DeepSpeed trainer {trainer} at {args.tools}')
    env = ds_e2e.trainer_environment(args)
    if args.step in ('data_before', 'expert_tp', 'pipeline'):  # each a save of its own
        args.work = os.path.join(args.work, 'moe_tp_' + args.step)
        {'data_before': step_data_before, 'expert_tp': step_expert_tp,
         'pipeline': step_pipeline}[args.step](args, env)
        return
    args.work = os.path.join(args.work, 'moe_tp')
    if args.step != 'save' and not os.path.isfile(os.path.join(args.work, 'save.json')):
        fail(f'no saved checkpoint in {args.work} (run the save step first)')
    {'save': step_save, 'reshard': step_reshard, 'preload': step_preload}[args.step](args, env)


if __name__ == '__main__':
    main()

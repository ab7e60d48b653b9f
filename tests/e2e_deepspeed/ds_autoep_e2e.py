#!/usr/bin/env python3
"""AutoEP expert parallelism (DeepSpeed 0.19's "expert_parallel": {"autoep_size": E}: fused
experts) under ZeRO-1, as the current DeepSpeed release writes it, against DeepSpeed's own
converter and its universal load.

  1. train_autoep.py saves a tiny Mixtral (2 MoE layers of 4 experts) at DP=4, E=2 (3 steps)
     under the preload, which indexes it at save: mp_rank_00 model states without the experts,
     one layer_<L>_expert_<G> file per expert (its rows of the fused w1/w2/w3), ZeRO-1 optimizer
     files whose "ep_size_2" group holds each expert-parallel rank's fused tensors partitioned
     over its 2 expert-data-parallel ranks.
  2. DeepSpeed's ds_to_universal.py converts it (each fused parameter whole, every expert's
     rows); DeepSpeed's universal load of that at another size, saved again, is the oracle.
  3. The index built at save is the one `ucp index` builds: each expert's rows an atom under the
     expert file's name. `ucp export --format deepspeed-universal` writes exactly DeepSpeed's
     files: each fused parameter whole ({'param', 'cat_dim', 'is_expert_param',
     'ep_num_experts'}), the router's unused gate (in the module only) as its fp32 copy, the
     optimizer state with every group's partition count the DP size, the model states with
     DeepSpeed's digest of the AutoEP layers; every object, tensor and bit, and the model
     states' pickle byte for byte (DeepSpeed saves them again with torch 2.13, whose zip layout
     ucp's writer does not copy).
  4. `ucp reshard` to DP=2 E=2, DP=2 E=1 and DP=4 E=4 (one expert per rank) writes DeepSpeed's own
     files there: those its universal load saves again, every object, tensor and bit but the
     resaving run's micro batch and load_universal (DeepSpeed keeps the saved "ep_size_2" group
     name at E=1, and so does ucp). Back to DP=4 E=2 from ucp's DP=2 E=1 files and from
     DeepSpeed's own, the save again.
  5. Live: a plain load_checkpoint at DP=2 E=2, and at DP=2 E=1 told only by the trainer's
     --deepspeed_config file (expert_parallel.autoep_size 1, which ucp's log must name), under
     the preload trains steps 4..6 with losses bit-identical to DeepSpeed's universal load
     there (given by item 4's resaving run, which trains on after its save); the files served
     are `ucp reshard`'s.
  6. DeepSpeed's other rank order (use_data_before_expert_parallelism: each expert-data-parallel
     group a run of consecutive ranks), set in the trainer's config file: a DP=4 E=2 save
     resharded to DP=2 E=1 = DeepSpeed's resave there, and back to DP=4 E=2 = the save.
  7. bf16 (ZeRO-1's bf16_ optimizer files): `ucp export` = ds_to_universal, the router's unused
     gate (a bfloat16 module tensor) widened to the float32 DeepSpeed converts it to. Frozen
     experts (check_frozen_experts): exported whole, resharded to DP=2 E=1 and back.
  8. What ucp does not read is refused by name: another checkpoint_format, experts not placed
     in consecutive runs. AutoEP with AutoTP (DeepSpeed's folded layout, --tp 2; check_folded):
     indexed at save, exported to the T=1 universal checkpoint that DeepSpeed resumes bit for
     bit, resharded to T=1 as DeepSpeed's own files there.
  9. ZeRO-3 (checkpoint_format zero3_partitioned: no expert files; each expert-parallel rank's
     fused parameters partitioned over its expert-data-parallel ranks, ds_zero_partition_groups
     recording each flat group's ranks), saved at DP=4 E=2 under the preload: the index built at
     save is `ucp index`'s, each fused parameter one atom of all its experts' rows; `ucp export`
     = ds_to_universal (every object, tensor and bit, the model states' pickles byte for byte);
     `ucp reshard` to DP=2 E=1 = DeepSpeed's resave there after its universal load (but for two
     things that load leaves: every flat group's Adam step one shared tensor, the expert group
     named "dense-params"), and back to DP=4 E=2 the save; a plain load_checkpoint under the
     preload at DP=2 E=1 (told by the trainer's config file) trains steps 4..6 as the
     uninterrupted DP=4 E=2 run does (step 4 bit-identical, then within 1e-6: another DP and E
     sum the update in another order). DeepSpeed's universal load is no oracle here: it leaves
     the flat groups' Adam steps one shared tensor, counted once per group each step, and its
     losses leave the uninterrupted run's from step 5 (4.15685415 against 4.15691185). A tp 1
     save is refused at tp 2: it records no AutoTP split.
 10. ZeRO-3 with AutoEP folded over AutoTP (--tp 2, which ds_to_universal refuses:
     check_folded_zero3): indexed at save, exported to a universal checkpoint of model states at
     tp 1 that DeepSpeed's universal load takes (its resave = ucp's reshard there), resharded to
     another folded grid and back, resumed live there (DeepSpeed's strict load of the served
     files saves them again unchanged). By hand, not here: the reshard to T=2 E=4 (one expert
     per rank, DP 2) = DeepSpeed's strict load and resave there, step 4 bit-identical to the
     folded run's.

Usage: ds_autoep_e2e.py --work DIR --tools DIR --lib LIB --ucp UCP --deepspeed VERSION
       [--required] [--zero3]
  --zero3 runs items 9 and 10 alone (a test of their own, to run beside the others); without
  it, items 1 to 8 run.
"""
import argparse
import json
import os
import re
import shutil
import sys
import zipfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', 'deepspeed'))

import ds_e2e  # noqa: E402
import ds_objects  # noqa: E402
import harness  # noqa: E402

DP, EP, STEPS, RESUME_STEPS = 4, 2, 3, 6
TAG = f'global_step{STEPS}'
TRAINER = os.path.join(HERE, 'train_autoep.py')
# (dp, ep) of the reshards checked against DeepSpeed's resaves, and of the live resumes.
TARGETS = ((2, 2), (2, 1), (4, 4))
LIVE = ((2, 2), (2, 1))
ZERO3 = ['--zero_stage', '3']
# The folded saves' frozen dense parameters, one split over TP and one replicated: ZeRO-1/2 keeps
# them in each lane's module alone (a split one's slices placed by AutoTP's affine map); ZeRO-3's
# frozen_param_shapes at another TP degree are tuples, as DeepSpeed writes them under AutoEP.
FOLDED_FROZEN = ['--freeze', r'layers\.0\.input_layernorm|layers\.1\.self_attn\.q_proj']
# A resume at another DP and E against the uninterrupted run: the losses after the first resumed
# step may differ by the rounding of an update summed in another order.
RESUME_TOLERANCE = 1e-6


def run_trainer(args, env, work, name, dp, ep, extra, steps=STEPS, save=True):
    """train_autoep.py at `dp` ranks and expert-parallel size `ep` (None: the trainer's config
    file in `extra` says) up to step `steps`, saving to work/name when `save`; fails the test
    unless it ran. Returns (tag folder, losses)."""
    save_dir = os.path.join(work, name)
    out = os.path.join(work, f'{name}.json')
    command = [sys.executable, 'launch.py', str(dp), ds_e2e.PORT, TRAINER, '--steps', str(steps),
               '--out', out] + ([] if ep is None else ['--ep', str(ep)]) + extra
    status, seconds, output = ds_e2e.run_past_flakes(lambda: ds_e2e.run_launcher(
        command + (['--save_dir', save_dir] if save else []), args.tools, env,
        os.path.join(work, f'{name}.log')), steps, save_dir if save else None, out)
    if status != 0:
        ds_e2e.fail(f'DeepSpeed AutoEP DP={dp} ({name}) exited {status}:\n{output[-3000:]}')
    print(f'AutoEP DP={dp} E={"from the config" if ep is None else ep} {name}: {seconds:.1f} s')
    return os.path.join(save_dir, TAG), ds_e2e.losses(out)


def reshard_to(report, args, source, to, out):
    """`ucp reshard source --to <to> --out out`; whether it succeeded (a failure reported)."""
    status, output = harness.run_ucp_output(args.ucp, 'reshard', source, '--to', to, '--out', out)
    return report.check(status == 0, f'ucp reshard {source} --to {to} exited {status}: '
                        f'{output[-2000:]}')


def reshard(report, args, source, out, dp, ep):
    return reshard_to(report, args, source, f'dp={dp},ep={ep}', out)


def check_index(report, tag_dir):
    with open(os.path.join(tag_dir, '.ucp', 'index.json')) as f:
        index = json.load(f)
    state = index['adapter_state']
    report.check(index['adapter']['name'] == 'deepspeed-moe' and state.get('fused_experts') and
                 state['expert_parallel'] == EP and state['num_experts'] == [4, 4],
                 f'index adapter {index["adapter"]}, state {state}')
    # Every expert's rows of every fused parameter, under the expert file's name.
    experts = sorted({a['param'] for a in index['atoms'] if '.mlp.experts.' in a['param']})
    expected = sorted(f'model.layers.{layer}.mlp.experts.{w}.{g}' for layer in range(2)
                      for w in ('w1', 'w2', 'w3') for g in range(4))
    report.check(experts == expected, f'expert atoms {experts}')


def pickle_of(path):
    """The pickle record (<archive>/data.pkl) of a torch.save file."""
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith('/data.pkl')))


def check_export(report, args, case, tag_dir, universal, export, same_pickles=(), extra=None):
    """`ucp export --format deepspeed-universal` of tag_dir into `export` holds DeepSpeed's
    ds_to_universal output `universal`: every file, object, tensor and bit, and the pickle of each
    of `same_pickles` byte for byte; `extra(export)` checks more."""
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if not report.check(status == 0, f'{case}: ucp export exited {status}: {output[-2000:]}'):
        return
    failures = len(report.failures)
    names = harness.compare_export(report, f'{case} export', universal, export)
    for name in same_pickles:
        report.check(pickle_of(os.path.join(universal, name)) ==
                     pickle_of(os.path.join(export, name)),
                     f'{case} export: the pickle of {name} is not ds_to_universal\'s')
    if extra is not None:
        extra(export)
    if len(report.failures) == failures:
        print(f'{case}: ucp export = ds_to_universal: {len(names)} files')


def same_as_save(report, case, tag_dir, out, allowed=(), unordered=None):
    """out/TAG holds the save's files, every object and bit but the `allowed` fields and the
    `unordered` state dicts' key order."""
    names = sorted(n for n in os.listdir(tag_dir) if n.endswith('.pt'))
    report.check(sorted(n for n in os.listdir(os.path.join(out, TAG)) if n.endswith('.pt')) ==
                 names, f'{case}: other files than the save\'s')
    for name in names:
        report.diffs(harness.compare_files(os.path.join(tag_dir, name),
                                           os.path.join(out, TAG, name), allowed, unordered),
                     f'{case}/{name}')


def check_reshard(report, args, env, work, tag_dir, universal):
    """ucp's files at each target against DeepSpeed's resave there, and both ways back: from ucp's
    files the save again, from DeepSpeed's the save but for what its resaving run changed (its
    micro batch, load_universal and the Adam states' key order). At a LIVE size the resaving run
    trains on to RESUME_STEPS after it saved what it loaded: returns those runs' losses by
    (dp, ep), DeepSpeed's universal resume there."""
    resaved, resumed = {}, {}
    for dp, ep in TARGETS:
        name = f'dp{dp}ep{ep}'
        live = (dp, ep) in LIVE
        resaved[name], losses = run_trainer(
            args, env, work, f'resaved_{name}', dp, ep,
            ['--load_dir', os.path.dirname(universal), '--load_tag', TAG, '--universal'] +
            (['--save_step', str(STEPS)] if live else []), steps=RESUME_STEPS if live else STEPS)
        if live:
            resumed[(dp, ep)] = losses
        failures = len(report.failures)
        out = os.path.join(work, f'reshard_{name}')
        if reshard(report, args, tag_dir, out, dp, ep):
            harness.compare_resaved(report, name, out, resaved[name], TAG)
        if len(report.failures) == failures:
            print(f'ucp reshard to {name} = DeepSpeed\'s resave there')
    deepspeed_dp2ep1 = harness.copy_tag(resaved['dp2ep1'], os.path.join(work, 'ds_dp2ep1', TAG))
    for source, what, allowed, unordered in (
            (os.path.join(work, 'reshard_dp2ep1', TAG), 'ucp', (), None),
            (deepspeed_dp2ep1, 'DeepSpeed', harness.RUN_CONFIG_FIELDS,
             harness.UNORDERED_IN_RESAVES)):
        back = os.path.join(work, f'back_from_{what}')
        failures = len(report.failures)
        if reshard(report, args, source, back, DP, EP):
            same_as_save(report, f'{what}\'s dp2ep1 -> dp{DP}ep{EP}', tag_dir, back, allowed,
                         unordered)
        if len(report.failures) == failures:
            print(f'{what}\'s files at dp2ep1 resharded to dp{DP}ep{EP} = the save')
    return resumed


def check_live_resume(report, args, env, work, tag_dir, dp, ep, universal_losses=None,
                      prefix='', stage=()):
    """The save resumed at `dp` x `ep` by a plain load_checkpoint under the preload (at another E
    told only by the trainer's config file) against DeepSpeed's universal resume there (its
    `universal_losses`), or without them against the run that saved it trained on. The trainer
    runs with `stage` (its ZeRO stage arguments); `prefix` names this case's files in work."""
    size = f'{prefix}dp{dp}ep{ep}'
    load = ['--load_tag', TAG] + list(stage)
    uninterrupted = universal_losses is None
    if uninterrupted:
        _, oracle = run_trainer(args, env, work, f'uninterrupted_{size}', DP, EP, list(stage),
                                steps=RESUME_STEPS, save=False)
        oracle = {s: v for s, v in oracle.items() if s > STEPS}
    else:
        oracle = {s: v for s, v in universal_losses.items() if s > STEPS}
    what = 'the uninterrupted run' if uninterrupted else 'DeepSpeed\'s universal load'
    ds_e2e.print_losses(f'losses {size} {what}', oracle)
    logs = os.path.join(work, f'logs_preload_{size}')
    extra = load + ['--load_dir', os.path.dirname(tag_dir)]
    trainer_ep = ep
    if ep != EP:
        config = os.path.join(work, f'ds_config_{size}.json')
        with open(config, 'w') as f:
            json.dump({'expert_parallel': {'enabled': True, 'autoep_size': ep}}, f)
        extra += ['--deepspeed_config', config]
        trainer_ep = None
    _, got = run_trainer(args, ds_e2e.preload_env(env, args.lib, logs), work, f'preload_{size}',
                         dp, trainer_ep, extra, steps=RESUME_STEPS, save=False)
    steps = list(range(STEPS + 1, RESUME_STEPS + 1))
    ds_e2e.print_losses(f'losses {size} preload', got)
    report.check(sorted(got) == steps and sorted(oracle) == steps,
                 f'{size}: resumed steps {sorted(got)}, {what}\'s steps {sorted(oracle)}')
    if uninterrupted and sorted(got) == steps and sorted(oracle) == steps:
        # The first resumed step's loss is the loaded model's; later ones follow an update summed
        # in another order at another DP and E.
        report.check(ds_e2e.float32_bits(got.get(STEPS + 1)) ==
                     ds_e2e.float32_bits(oracle.get(STEPS + 1)) and
                     all(abs(got[s] - oracle[s]) <= RESUME_TOLERANCE for s in steps),
                     f'{size}: losses under the preload {got} are not {what}\'s {oracle} (step '
                     f'{STEPS + 1} exactly, then within {RESUME_TOLERANCE})')
    elif not uninterrupted:
        report.check({s: ds_e2e.float32_bits(v) for s, v in got.items()} ==
                     {s: ds_e2e.float32_bits(v) for s, v in oracle.items()},
                     f'{size}: losses under the preload differ from {what}\'s')
    if ep != EP:
        said = f'ep={ep} ({config} expert_parallel.autoep_size {ep})'
        logged = ''.join(open(os.path.join(logs, n), errors='replace').read()
                         for n in sorted(os.listdir(logs)))
        report.check(said in logged, f'{size}: no ucp log names {said!r}:\n'
                     f'{ds_e2e.log_tail(logs)}')
    view = os.path.join(tag_dir, '.ucp', 'views',
                        f'tp1-pp1-dp{dp}' + ('' if ep == EP else f'-ep{ep}'))
    resharded = os.path.join(work, f'reshard_{size}', TAG)
    # The expert files are the saved ones, passed through; the others are made for the target.
    served = sorted(n for n in os.listdir(resharded)
                    if n.endswith('.pt') and not n.startswith('layer_'))
    for name in served:
        stored = os.path.join(view, 'served.' + name)
        report.check(os.path.isfile(stored) and harness.read_bytes(stored) ==
                     harness.read_bytes(os.path.join(resharded, name)),
                     f'{size}/{name}: not served, or not `ucp reshard`\'s bytes; ucp logs:\n'
                     f'{ds_e2e.log_tail(logs)}')


def check_data_before_expert(report, args, env, work):
    config = os.path.join(work, 'data_before_expert.json')
    with open(config, 'w') as f:
        json.dump({'use_data_before_expert_parallelism': True}, f)
    order = ['--deepspeed_config', config]
    tag_dir, _ = run_trainer(args, env, work, 'dbe', DP, EP, order)
    universal = os.path.join(work, 'dbe_universal', TAG)
    ds_e2e.ds_to_universal(env, tag_dir, universal)
    resaved, _ = run_trainer(args, env, work, 'dbe_resaved_dp2ep1', 2, 1,
                             order + ['--load_dir', os.path.dirname(universal), '--load_tag',
                                      TAG, '--universal'])
    out, back = os.path.join(work, 'dbe_reshard_dp2ep1'), os.path.join(work, 'dbe_back')
    failures = len(report.failures)
    if reshard(report, args, tag_dir, out, 2, 1):
        harness.compare_resaved(report, 'data before expert: dp2ep1', out, resaved, TAG)
        if reshard(report, args, os.path.join(out, TAG), back, DP, EP):
            same_as_save(report, 'data before expert: dp2ep1 -> dp4ep2', tag_dir, back)
    if len(report.failures) == failures:
        print('data before expert: ucp reshard to dp2ep1 = DeepSpeed\'s resave there; back to '
              'dp4ep2 = the save')


def check_bf16_export(report, args, env, work):
    tag_dir, _ = run_trainer(args, env, work, 'bf16', DP, EP, ['--dtype', 'bf16'])
    universal = os.path.join(work, 'bf16_universal', TAG)
    ds_e2e.ds_to_universal(env, tag_dir, universal)

    def gate_widened(export):
        gate = ds_objects.load(os.path.join(export, 'zero', 'model.layers.0.mlp.gate.gate.weight',
                                            'fp32.pt'))['param']
        report.check(gate.dtype == torch.float32, f'bf16: the gate exported as {gate.dtype}')
    check_export(report, args, 'bf16', tag_dir, universal, os.path.join(work, 'bf16_export'),
                 extra=gate_widened)


def check_frozen_experts(report, args, env, work):
    """A ZeRO-1 DP=4 E=2 save whose layer-0 experts' down projection is frozen (train_autoep.py
    --freeze: AutoEP's fused w2, in the expert files alone). DeepSpeed 0.19.8's ds_to_universal
    fails on it ("AutoEP expert parameter model.layers.0.mlp.experts.w2 is missing from
    checkpoint parameter shapes", by hand): ucp's export writes the frozen tensor whole as
    zero/<w2>/fp32.pt in the fused form, every expert's rows those of its file; DeepSpeed's plain
    load of `ucp reshard`'s DP=2 E=1 files trains steps 4..6 as the uninterrupted run (step 4
    exactly, then within RESUME_TOLERANCE); those files back at DP=4 E=2 are the save."""
    frozen = ['--freeze', r'layers\.0\.mlp\.experts\.down_proj']
    fused = 'model.layers.0.mlp.experts.w2'
    tag_dir, run = run_trainer(args, env, work, 'frozen', DP, EP,
                               frozen + ['--save_step', str(STEPS)], steps=RESUME_STEPS)
    export = os.path.join(work, 'frozen_export')
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if report.check(status == 0, f'frozen: ucp export exited {status}: {output[-2000:]}'):
        entry = ds_objects.load(os.path.join(export, 'zero', fused, 'fp32.pt'))
        rows = [ds_objects.load(os.path.join(tag_dir, f'layer_0_expert_{g}_mp_rank_00_model_'
                                             'states.pt'))[f'{fused}.{g}'] for g in range(4)]
        report.check(sorted(entry) == ['cat_dim', 'ep_num_experts', 'is_expert_param', 'param'] and
                     entry['ep_num_experts'] == 4 and not entry['param'].requires_grad and
                     torch.equal(entry['param'], torch.stack(rows)),
                     f'frozen: the export\'s {fused} is not the expert files\' rows: {entry}')
    out, back = os.path.join(work, 'frozen_dp2ep1'), os.path.join(work, 'frozen_back')
    if not reshard(report, args, tag_dir, out, 2, 1):
        return
    config = os.path.join(work, 'ds_config_frozen_dp2ep1.json')
    with open(config, 'w') as f:
        json.dump({'expert_parallel': {'enabled': True, 'autoep_size': 1}}, f)
    _, got = run_trainer(args, env, work, 'frozen_load_dp2ep1', 2, None,
                         frozen + ['--deepspeed_config', config, '--load_dir', out, '--load_tag',
                                   TAG], steps=RESUME_STEPS, save=False)
    steps = list(range(STEPS + 1, RESUME_STEPS + 1))
    ds_e2e.print_losses('losses frozen dp2ep1 (DeepSpeed\'s load of ucp\'s files)', got)
    report.check(sorted(got) == steps and
                 ds_e2e.float32_bits(got[steps[0]]) == ds_e2e.float32_bits(run[steps[0]]) and
                 all(abs(got[s] - run[s]) <= RESUME_TOLERANCE for s in steps),
                 f'frozen: losses at dp2ep1 {got} are not the uninterrupted run\'s {run}')
    if reshard(report, args, os.path.join(out, TAG), back, DP, EP):
        same_as_save(report, 'frozen: dp2ep1 -> dp4ep2', tag_dir, back)
    print('frozen experts: ucp export holds them; dp2ep1 trains as the uninterrupted run; back = '
          'the save')


def indexed_at_save(report, args, case, tag_dir, logs):
    """The index the preload built at save of `tag_dir` (ucp's logs in `logs`), which must be
    there and be what `ucp index` builds, byte for byte; None (a failure reported) otherwise."""
    index = os.path.join(tag_dir, '.ucp', 'index.json')
    if not report.check(os.path.isfile(index), f'{case}: no index built at save; ucp logs:\n'
                        f'{ds_e2e.log_tail(logs)}'):
        return None
    at_save = harness.read_bytes(index)
    status, output = harness.run_ucp_output(args.ucp, 'index', tag_dir)
    if not report.check(status == 0 and harness.read_bytes(index) == at_save,
                        f'{case}: ucp index exited {status} or wrote another index than the one '
                        f'built at save: {output[-2000:]}'):
        return None
    with open(index) as f:
        return json.load(f)


def check_zero3(report, args, env, work):
    logs = os.path.join(work, 'logs_z3_save')
    tag_dir, _ = run_trainer(args, ds_e2e.preload_env(env, args.lib, logs), work, 'z3', DP, EP,
                             ZERO3)
    contents = indexed_at_save(report, args, 'ZeRO-3', tag_dir, logs)
    if contents is None:
        return
    autoep = contents['adapter_state'].get('autoep', {})
    experts = {a['param']: a['shape'] for a in contents['atoms']
               if '.mlp.experts.' in a['param'] and a['state'] == 'fp32'}
    expected = {f'model.layers.{layer}.mlp.experts.{w}': [4, 64, 32] if w != 'w2' else [4, 32, 64]
                for layer in range(2) for w in ('w1', 'w2', 'w3')}
    report.check(contents['adapter']['name'] == 'deepspeed-zero3' and autoep.get('ep') == EP and
                 experts == expected, f'ZeRO-3: index adapter {contents["adapter"]}, autoep '
                 f'{autoep}, expert atoms {experts}')
    universal = os.path.join(work, 'z3_universal', TAG)
    ds_e2e.ds_to_universal(env, tag_dir, universal)
    check_export(report, args, 'ZeRO-3', tag_dir, universal, os.path.join(work, 'z3_export'),
                 [f'zero_pp_rank_{r}_mp_rank_00_model_states.pt' for r in range(DP)])
    # DeepSpeed's universal load leaves every flat group's Adam step one shared tensor, and the
    # expert group named as the dense one; a save of a run at the target has neither.
    quirks = harness.RUN_CONFIG_FIELDS + (
        'optimizer_state_dict.optimizer_state_dict.param_groups.1.name',
        'optimizer_state_dict.optimizer_state_dict.state.1.step')
    resaved, _ = run_trainer(args, env, work, 'z3_resaved_dp2ep1', 2, 1,
                             ZERO3 + ['--load_dir', os.path.dirname(universal), '--load_tag', TAG,
                                      '--universal'])
    out, back = os.path.join(work, 'reshard_z3_dp2ep1'), os.path.join(work, 'z3_back')
    failures = len(report.failures)
    if reshard(report, args, tag_dir, out, 2, 1):
        harness.compare_resaved(report, 'ZeRO-3 dp2ep1', out, resaved, TAG, quirks)
        if reshard(report, args, os.path.join(out, TAG), back, DP, EP):
            same_as_save(report, 'ZeRO-3 dp2ep1 -> dp4ep2', tag_dir, back)
    if len(report.failures) == failures:
        print('ZeRO-3: ucp reshard to dp2ep1 = DeepSpeed\'s resave there; back to dp4ep2 = the '
              'save')
    # DeepSpeed's universal load is no oracle here: the Adam step it shares between the flat
    # groups is counted once per group each step, and its losses leave the uninterrupted run's
    # from step 5 (4.15685415 against 4.15691185); a run at the target trains on as the
    # uninterrupted one does.
    check_live_resume(report, args, env, work, tag_dir, 2, 1, None, 'z3_', ZERO3)
    # A tp 1 save records no AutoTP split, so it cannot be folded over tensor parallelism.
    status, output = harness.run_ucp_output(args.ucp, 'reshard', tag_dir, '--to',
                                            'tp=2,dp=2,ep=2', '--out', os.path.join(work, 'z3_tp2'))
    report.check(status != 0 and 'an AutoEP tag saved at tp 1 records no AutoTP split' in output,
                 f'ZeRO-3: reshard of a tp 1 save to tp=2: exit {status}, not the refusal: '
                 f'{output[-500:]}')


FOLDED_ZERO3 = ZERO3 + FOLDED_FROZEN + ['--tp', '2']


def folded_zero3_gather(tag_dir):
    """Each parameter's universal tensors, {(name, state): tensor}, gathered here from a ZeRO-3
    save of AutoEP folded over AutoTP without ucp: rank g = d·T + t writes
    zero_pp_rank_<d>_mp_rank_<t>; a parameter of numel n is ceil(n / P) elements of each of its
    P partitions, parameter after parameter; a dense parameter's TP slice is lane t's partitions
    over its dense-data-parallel ranks d, the slices concatenated along the dimension where
    AutoTP's affine map says the lane's shape is not the whole one (a replicated one: lane 0's);
    a fused expert parameter's rows of expert-parallel rank e are the partitions of its
    expert-data-parallel ranks g = e + i·E, e after e."""
    def load(name):
        return ds_objects.load(os.path.join(tag_dir, name))
    model0 = load('zero_pp_rank_0_mp_rank_00_model_states.pt')
    tp, dense_dp = model0['mp_world_size'], model0['dp_world_size']
    ep = model0['folding']['ep_size']
    world = tp * dense_dp
    models = {(t, d): load(f'zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt')
              for t in range(tp) for d in range(dense_dp)}
    optims = {(t, d): load(f'zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt')
              ['optimizer_state_dict'] for t in range(tp) for d in range(dense_dp)}
    affine = model0['universal_checkpoint_info']['affine_map']['params']

    def gather(ranks, group, name, state):
        shapes = models[ranks[0]]['param_shapes'][group]
        count = len(ranks)
        offset = 0
        for other, shape in shapes.items():
            if other == name:
                break
            offset += -(-torch.Size(shape).numel() // count)
        numel = torch.Size(shapes[name]).numel()
        piece = -(-numel // count)
        parts = []
        for rank in ranks:
            osd = optims[rank]
            flat = (osd['fp32_flat_groups'][group] if state == 'fp32' else
                    osd['optimizer_state_dict']['state'][group][state])
            parts.append(flat[offset:offset + piece])
        return torch.cat(parts)[:numel].view(shapes[name])

    gathered = {}
    for state in ('fp32', 'exp_avg', 'exp_avg_sq'):
        for name in model0['param_shapes'][0]:
            slices = [gather([(t, d) for d in range(dense_dp)], 0, name, state)
                      for t in range(tp)]
            whole = [list(e['logical_shape']) for pattern, e in affine.items()
                     if re.fullmatch(pattern, name)][0]
            split = [d for d in range(len(whole)) if whole[d] != slices[0].shape[d]]
            gathered[(name, state)] = torch.cat(slices, split[0]) if split else slices[0]
        for name in model0['param_shapes'][1]:
            gathered[(name, state)] = torch.cat([
                gather([((e + i * ep) % tp, (e + i * ep) // tp) for i in range(world // ep)], 1,
                       name, state) for e in range(ep)])
    return gathered


def check_folded_zero3(report, args, env, work):
    """AutoEP folded over AutoTP under ZeRO-3 (--tp 2, which ds_to_universal refuses): a T=2 E=2
    save at 4 ranks (dense DP 2, expert DP 2; two dense parameters frozen, FOLDED_FROZEN), saved
    at step 3 under the preload and trained on to step 5.
      - The index built at save is `ucp index`'s: each dense atom whole (AutoTP's logical shape),
        each fused expert parameter one atom of all its experts' rows.
      - `ucp export` = folded_zero3_gather, every parameter and state bit for bit; its model
        states a tp 1 run's over the 4 ranks. DeepSpeed's universal load of it at T=1 DP=4 E=2,
        saved again before it trains, = `ucp reshard` of the save to T=1 DP=4 E=2 (but for the
        two things that load leaves, check_zero3's quirks), and trains step 4 within 1e-6 of the
        folded run (another TP degree sums in another order).
      - `ucp reshard` to its own grid: the save, every object and bit; to T=4 E=2 (dense DP 1)
        and back: the save.
      - Live: the save resumed at T=4 E=2 by a plain load_checkpoint under the preload, told the
        grid by the trainer's --deepspeed_config file: every file served `ucp reshard`'s there;
        the run's save of what it loaded (before it trains) = those files, every object and bit
        but the micro batch (DeepSpeed's strict load checks each rank's partition groups and
        folding dict against its own); steps 4 and 5 within 1e-6 of the folded run's.
      - Refused by name: an expert-parallel size of 1 with AutoTP (DeepSpeed folds none); an
        optimizer file of another rank in a rank's place (its folding dict)."""
    logs = os.path.join(work, 'logs_folded_z3')
    tag_dir, uninterrupted = run_trainer(
        args, ds_e2e.preload_env(env, args.lib, logs), work, 'folded_z3', 4, 2,
        FOLDED_ZERO3 + ['--save_step', str(STEPS)], steps=STEPS + 2)
    indexed = indexed_at_save(report, args, 'folded ZeRO-3', tag_dir, logs)
    if indexed is None:
        return
    shapes = {(a['param'], a['state']): a['shape'] for a in indexed['atoms']}
    q_proj = shapes.get(('model.layers.0.self_attn.q_proj.weight', 'fp32'))
    expert = shapes.get(('model.layers.1.mlp.experts.w2', 'fp32'))
    report.check(indexed['adapter']['name'] == 'deepspeed-zero3' and
                 indexed['topology']['tp'] == 2 and
                 indexed['adapter_state'].get('autoep', {}).get('ep') == 2 and
                 q_proj == [32, 32] and expert == [4, 32, 64],
                 f'folded ZeRO-3: index adapter {indexed["adapter"]}, topology '
                 f'{indexed["topology"]}, q_proj {q_proj}, w2 {expert}')

    failures = len(report.failures)
    export = os.path.join(work, 'folded_z3_export', TAG)
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if report.check(status == 0, f'folded ZeRO-3: ucp export exited {status}: {output[-2000:]}'):
        gathered = folded_zero3_gather(tag_dir)
        # 15 trainable dense parameters and 6 fused expert ones, 3 states each.
        report.check(len(gathered) == 3 * (15 + 6), f'folded ZeRO-3: gathered {len(gathered)}')
        check_exported(report, 'folded ZeRO-3', export, gathered)
        states = [ds_objects.load(os.path.join(export, n)) for n in sorted(os.listdir(export))
                  if n.endswith('_model_states.pt')]
        report.check(len(states) == 4 and all(
            'folding' not in s and s['mp_world_size'] == 1 and s['dp_world_size'] == 4 and
            'tensor_parallel' not in s['ds_config'] for s in states),
            'folded ZeRO-3 export: the model states are not a tp 1 run\'s over 4 ranks')
    if len(report.failures) == failures:
        print(f'folded ZeRO-3: ucp export = the save gathered ({len(gathered)} tensors), its '
              'model states a tp 1 run\'s')
    resaved, loaded = run_trainer(args, env, work, 'folded_z3_universal_load', 4, 2,
                                  ZERO3 + FOLDED_FROZEN +
                                  ['--load_dir', os.path.dirname(export), '--load_tag', TAG,
                                   '--universal', '--save_step', str(STEPS)],
                                  steps=STEPS + 1)
    step = STEPS + 1
    report.check(step in loaded and abs(loaded[step] - uninterrupted[step]) <= RESUME_TOLERANCE,
                 f'folded ZeRO-3: DeepSpeed\'s tp 1 universal load of ucp\'s export trains step '
                 f'{step} to {loaded.get(step)}, the folded run to {uninterrupted[step]}')
    print(f'folded ZeRO-3: DeepSpeed\'s tp 1 universal load of ucp\'s export: step {step} loss '
          f'{loaded.get(step)!r}, the folded run\'s {uninterrupted[step]!r}')
    quirks = harness.RUN_CONFIG_FIELDS + (
        'optimizer_state_dict.optimizer_state_dict.param_groups.1.name',
        'optimizer_state_dict.optimizer_state_dict.state.1.step')
    failures = len(report.failures)
    t1 = os.path.join(work, 'folded_z3_t1')
    if reshard_to(report, args, tag_dir, 'tp=1,dp=4,ep=2', t1):
        harness.compare_resaved(report, 'folded ZeRO-3 -> t1', t1, resaved, TAG, quirks)
    same = os.path.join(work, 'folded_z3_same')
    if reshard_to(report, args, tag_dir, 'tp=2,dp=2,ep=2', same):
        compare_folded(report, 'folded ZeRO-3 -> t2e2', tag_dir, os.path.join(same, TAG))
    t4e2, back = os.path.join(work, 'folded_z3_t4e2'), os.path.join(work, 'folded_z3_back')
    if reshard_to(report, args, tag_dir, 'tp=4,dp=1,ep=2', t4e2) and reshard_to(
            report, args, os.path.join(t4e2, TAG), 'tp=2,dp=2,ep=2', back):
        compare_folded(report, 'folded ZeRO-3 -> t4e2 -> t2e2', tag_dir, os.path.join(back, TAG))
    if len(report.failures) == failures:
        print('folded ZeRO-3: ucp reshard to t1 = DeepSpeed\'s resave after its universal load '
              'of ucp\'s export; to t2e2 = the save; to t4e2 and back = the save')

    logs, live_saved, got = run_live_t4e2(args, env, work, 'folded_z3_live', tag_dir,
                                          ZERO3 + FOLDED_FROZEN, save=True)
    check_served(report, 'folded ZeRO-3: t4e2', got,
                 {s: v for s, v in uninterrupted.items() if s > STEPS},
                 os.path.join(tag_dir, '.ucp', 'views', 'tp4-pp1-dp1-ep2'),
                 os.path.join(t4e2, TAG), logs, RESUME_TOLERANCE)
    compare_folded(report, 'folded ZeRO-3 live t4e2 resave', live_saved, os.path.join(t4e2, TAG))

    status, output = harness.run_ucp_output(args.ucp, 'reshard', tag_dir, '--to',
                                            'tp=2,dp=2,ep=1', '--out',
                                            os.path.join(work, 'folded_z3_ep1'))
    report.check(status != 0 and 'folds AutoEP over AutoTP only at an expert-parallel size '
                 'above 1' in output, f'folded ZeRO-3 to ep=1: exit {status}: {output[-500:]}')
    swapped = harness.copy_tag(tag_dir, os.path.join(work, 'folded_z3_swapped'))
    shutil.rmtree(os.path.join(swapped, '.ucp'), ignore_errors=True)
    first, other = (os.path.join(swapped, f'zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt')
                    for d, t in ((0, 1), (1, 1)))
    os.rename(first, first + '.tmp')
    os.rename(other, first)
    os.rename(first + '.tmp', other)
    status, output = harness.run_ucp_output(args.ucp, 'index', swapped)
    report.check(status != 0 and 'zero_pp_rank_0_mp_rank_01_optim_states.pt: folding/' in output,
                 f'folded ZeRO-3 with two ranks\' optimizer files swapped: ucp index exit '
                 f'{status}, not the refusal: {output[-500:]}')


def check_refusals(report, args, tag_dir, work):
    def edited(name, edit):
        copy = harness.copy_tag(tag_dir, os.path.join(work, name))
        shutil.rmtree(os.path.join(copy, '.ucp'), ignore_errors=True)
        path = os.path.join(copy, 'mp_rank_00_model_states.pt')
        states = ds_objects.load(path)
        edit(states['ds_autoep_layers'][1])
        ds_objects.save(states, path)
        return copy

    def other_format(layer):
        layer['checkpoint_format'] = 'fused_file'

    def swapped(layer):
        ranks = layer['expert_placement']['ranks']
        ranks[0]['experts'], ranks[1]['experts'] = ranks[1]['experts'], ranks[0]['experts']
    for name, edit, expected in (
            ('other_format', other_format,
             'ds_autoep_layers/1/checkpoint_format: "fused_file"; ucp reads AutoEP\'s '
             'per_expert_files'),
            ('swapped', swapped, 'ds_autoep_layers/1/expert_placement/ranks/0: rank 0 holding '
             'experts [2, 3]')):
        status, output = harness.run_ucp_output(args.ucp, 'index', edited(name, edit))
        report.check(status != 0 and expected in output,
                     f'index of {name}: exit {status}, not the refusal: {output[-500:]}')
    # A tp 1 save records no AutoTP split, so it cannot be folded over tensor parallelism.
    status, output = harness.run_ucp_output(args.ucp, 'reshard', tag_dir, '--to',
                                            'tp=2,dp=2,ep=2', '--out', os.path.join(work, 'to_tp2'))
    report.check(status != 0 and 'an AutoEP tag saved at tp 1 records no AutoTP split' in output,
                 f'reshard of a tp 1 save to tp=2: exit {status}, not the refusal: '
                 f'{output[-500:]}')


def check_exported(report, case, export, gathered):
    """Each (name, state) of `gathered` (a test's own gather of a save) is export's
    zero/<name>/<state>.pt 'param', dtype and bits."""
    for (name, state), expected in sorted(gathered.items()):
        path = os.path.join(export, 'zero', name, f'{state}.pt')
        got = torch.load(path, weights_only=False)['param'] if os.path.isfile(path) else None
        report.check(got is not None and got.dtype == expected.dtype and
                     torch.equal(got, expected),
                     f'{case} export: {name}/{state} is not the gather of the save')


def folded_gather(tag_dir):
    """Each parameter's universal tensors at tp 1, {(name, state): tensor}, gathered here from a
    folded save's files without ucp: a dense parameter's slices from each TP lane's optimizer
    files (lane t's dense-data-parallel ranks d·T + t, by their param_slice_mappings),
    concatenated along the dimension where AutoTP's affine map says the lane's shape is not the
    whole one (a replicated one: lane 0's, every lane's alike); a fused expert parameter from the
    expert group of each expert-parallel rank e (ranks g = e mod E, by g div E), e after e."""
    model0 = ds_objects.load(os.path.join(tag_dir, 'mp_rank_00_model_states.pt'))
    folding = model0['folding']
    tp, ep = folding['tp_size'], folding['ep_size']
    world = model0['dp_world_size'] * tp
    models = [model0] + [ds_objects.load(os.path.join(tag_dir, f'mp_rank_{t:02d}_model_states.pt'))
                         for t in range(1, tp)]
    optims = [ds_objects.load(os.path.join(
        tag_dir, f'zero_pp_rank_{g // tp}_mp_rank_{g % tp:02d}_optim_states.pt'))
        for g in range(world)]
    affine = model0['universal_checkpoint_info']['affine_map']['params']

    def gather(ranks, group, name, state):
        parts = []
        for g in ranks:
            osd = optims[g]['optimizer_state_dict']
            flat = (osd['single_partition_of_fp32_groups'][group] if state == 'fp32' else
                    osd['base_optimizer_state']['state'][group][state])
            fragment = osd['param_slice_mappings'][group].get(name)
            if fragment is not None:
                parts.append(flat[fragment.start:fragment.start + fragment.numel])
        return torch.cat(parts)

    def whole_shape(name):
        entries = [e for pattern, e in affine.items() if re.fullmatch(pattern, name)]
        return list(entries[0]['logical_shape'])

    gathered = {}
    for state in ('fp32', 'exp_avg', 'exp_avg_sq'):
        for name in model0['param_shapes'][0]:
            slices = [gather([d * tp + t for d in range(world // tp)], 0, name, state)
                      .view(models[t]['param_shapes'][0][name]) for t in range(tp)]
            whole = whole_shape(name)
            split = [d for d in range(len(whole)) if whole[d] != slices[0].shape[d]]
            if split:
                gathered[(name, state)] = torch.cat(slices, split[0])
            elif all(torch.equal(s, slices[0]) for s in slices):
                gathered[(name, state)] = slices[0]
        for name, local in model0['param_shapes'][1].items():
            gathered[(name, state)] = torch.cat([
                gather(sorted((g for g in range(world) if g % ep == e), key=lambda g: g // ep), 1,
                       name, state).view(local) for e in range(ep)])
    module = {}
    for name, tensor in model0['module'].items():
        # Each dense parameter's, frozen ones' too (the router's unused gate has no AutoTP record).
        if not any(re.fullmatch(pattern, name) for pattern in affine):
            continue
        whole = whole_shape(name)
        split = [d for d in range(len(whole)) if whole[d] != tensor.shape[d]]
        module[name] = (torch.cat([m['module'][name] for m in models], split[0]) if split else
                        tensor)
    return gathered, module, world


def check_folded_export(report, args, tag_dir, export):
    """`ucp export` of a folded save against folded_gather: every trained dense and expert
    parameter's fp32, exp_avg and exp_avg_sq bit for bit; the model states a tp 1 run's: every
    dense module tensor whole (the lanes' slices joined; the frozen ones' too), no folding dict,
    mp_world_size and tp_degree 1, dp_world_size every rank, no ds_config tensor_parallel, and of
    universal_checkpoint_info AutoEP's three entries."""
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if not report.check(status == 0, f'folded: ucp export exited {status}: {output[-2000:]}'):
        return False
    gathered, module, world = folded_gather(tag_dir)
    failures = len(report.failures)
    # 17 dense parameters (embedding, head, final norm, per layer q/k/v/o, router, 2 norms) but
    # the 2 frozen, and 6 fused expert ones (w1/w2/w3 of 2 layers), 3 states each; the module's 17.
    report.check(len(gathered) == 3 * (15 + 6) and len(module) == 17,
                 f'folded: gathered {len(gathered)} tensors, {len(module)} module tensors')
    check_exported(report, 'folded', export, gathered)
    states = ds_objects.load(os.path.join(export, 'mp_rank_00_model_states.pt'))
    for name, expected in module.items():
        # A trained parameter's param_shapes entry is its whole shape; a frozen one has none.
        listed = states['param_shapes'][0].get(name)
        trained = (name, 'fp32') in gathered
        report.check(torch.equal(states['module'][name], expected) and
                     (list(listed) == list(expected.shape) if trained else listed is None),
                     f'folded export: module/{name} is not the lanes\' slices joined, or its '
                     f'param_shapes entry {listed} not its whole shape')
    report.check('folding' not in states and states['mp_world_size'] == 1 and
                 states['checkpoint_parallel_dimensions']['tp_degree'] == 1 and
                 states['dp_world_size'] == world and
                 'tensor_parallel' not in states['ds_config'] and
                 sorted(states['universal_checkpoint_info']) ==
                 ['ds_autoep_layers', 'expert_parameter_patterns',
                  'universal_checkpoint_version'],
                 'folded export: the model states are not a tp 1 run\'s: '
                 f'{sorted(states)} {states["mp_world_size"]} {states["dp_world_size"]} '
                 f'{sorted(states["universal_checkpoint_info"])}')
    if len(report.failures) == failures:
        print(f'folded: ucp export = the lanes\' slices gathered ({len(gathered)} tensors, '
              f'{len(module)} module tensors)')
    return len(report.failures) == failures


def check_folded_refusals(report, args, tag_dir, work):
    """A folded tag's files that do not make its grid, or whose TP lanes hold unlike copies of a
    parameter AutoTP replicates (trained or frozen), are refused naming the file and the field;
    so are targets DeepSpeed does not fold (E = 1, a pipeline, an E that does not divide the
    world)."""
    def variant(name, change):
        copy = harness.copy_tag(tag_dir, os.path.join(work, f'folded_{name}', TAG))
        shutil.rmtree(os.path.join(copy, '.ucp'), ignore_errors=True)
        change(copy)
        return copy

    def without_expert(copy):
        os.remove(os.path.join(copy, 'layer_1_expert_2_mp_rank_01_model_states.pt'))

    def extra_expert(copy):
        shutil.copy(os.path.join(copy, 'layer_0_expert_0_mp_rank_00_model_states.pt'),
                    os.path.join(copy, 'layer_0_expert_0_mp_rank_01_model_states.pt'))

    def other_lane(copy):
        path = os.path.join(copy, 'mp_rank_01_model_states.pt')
        states = ds_objects.load(path)
        states['folding']['tp_rank'] = 0
        ds_objects.save(states, path)

    def edited_on_lane_1(name):
        def edit(copy):
            path = os.path.join(copy, 'mp_rank_01_model_states.pt')
            states = ds_objects.load(path)
            states['module'][name] += 1
            ds_objects.save(states, path)
        return edit
    for name, change, expected in (
            ('unlike_replica', edited_on_lane_1('model.norm.weight'),
             'model.norm.weight: AutoTP\'s affine map has every TP rank hold it whole, but its '
             'bit16 of TP lane 1 differs from lane 0\'s'),
            # A frozen parameter (in the module alone) AutoTP replicates.
            ('unlike_frozen', edited_on_lane_1('model.layers.0.input_layernorm.weight'),
             'module/model.layers.0.input_layernorm.weight: not in the optimizer\'s groups (a '
             'frozen parameter or a buffer) and its TP lanes\' copies differ, and AutoTP\'s affine '
             'map does not split it'),
            ('without_expert', without_expert, 'layer_1_expert_2_mp_rank_01_model_states.pt: not '
             'found (a folded save at tp 2, ep 2 writes it)'),
            ('extra_expert', extra_expert, 'layer_0_expert_0_mp_rank_01_model_states.pt: no rank '
             'of a folded save at tp 2, ep 2 writes it'),
            ('other_lane', other_lane, 'mp_rank_01_model_states.pt: folding/tp_rank: 0, '
             'expected 1')):
        status, output = harness.run_ucp_output(args.ucp, 'index', variant(name, change))
        report.check(status != 0 and expected in output,
                     f'folded {name}: ucp index exited {status}, not the refusal: {output[-500:]}')
    for target, expected in (
            ('tp=2,dp=2,ep=1', 'DeepSpeed folds AutoEP over AutoTP only at an expert-parallel '
             'size above 1'),
            ('tp=2,dp=2,pp=2', 'AutoEP with AutoTP in a pipeline (DeepSpeed does not fold one)'),
            ('tp=2,dp=3,ep=4', 'the world 6 is not a multiple of the expert-parallel size 4')):
        status, output = harness.run_ucp_output(args.ucp, 'reshard', tag_dir, '--to', target,
                                                '--out', os.path.join(work, 'folded_reshard'))
        report.check(status != 0 and expected in output,
                     f'folded: ucp reshard --to {target} exited {status}, not the refusal: '
                     f'{output[-500:]}')


def check_served(report, case, got, oracle, view, resharded, logs, tolerance=None):
    """A live resume under the preload: its losses `got` (steps 4 and 5) bit-identical to
    `oracle`'s (with `tolerance`, within it), and every file of `resharded` (a `ucp reshard` tag
    folder) served from the view folder `view` with its bytes."""
    ds_e2e.print_losses(f'{case} losses under the preload', got)
    steps = [STEPS + 1, STEPS + 2]
    alike = (sorted(oracle) == steps and all(abs(got[s] - oracle[s]) <= tolerance for s in steps)
             if tolerance is not None else
             {s: ds_e2e.float32_bits(v) for s, v in got.items()} ==
             {s: ds_e2e.float32_bits(v) for s, v in oracle.items()})
    report.check(sorted(got) == steps and alike,
                 f'{case}: losses under the preload {got} are not the oracle\'s {oracle}' +
                 (f' (within {tolerance})' if tolerance is not None else ''))
    for name in sorted(n for n in os.listdir(resharded) if n.endswith('.pt')):
        stored = os.path.join(view, 'served.' + name)
        report.check(os.path.isfile(stored) and harness.read_bytes(stored) ==
                     harness.read_bytes(os.path.join(resharded, name)),
                     f'{case} live/{name}: not served, or not `ucp reshard`\'s bytes; ucp logs:\n'
                     f'{ds_e2e.log_tail(logs)}')


def check_folded_live(report, args, env, work, tag_dir, oracle, resharded):
    """The folded save resumed at T=1 DP=2 E=2 by a plain load_checkpoint under the preload, the
    grid told by the trainer's --deepspeed_config file alone (AutoEP enabled at size 2 and no
    tensor_parallel section, which makes tp 1: DeepSpeed runs AutoEP at its AutoTP size only, and
    ucp's log names that evidence): steps 4 and 5 bit-identical to DeepSpeed's universal load of
    ucp's export there (`oracle`), and every file served `ucp reshard`'s (`resharded`: the expert
    files too, made without their folding dicts)."""
    logs = os.path.join(work, 'logs_folded_live')
    config = os.path.join(work, 'ds_config_t1e2.json')
    with open(config, 'w') as f:
        json.dump({'expert_parallel': {'enabled': True, 'autoep_size': 2}}, f)
    _, got = run_trainer(args, ds_e2e.preload_env(env, args.lib, logs), work, 'folded_live', 2,
                         None, FOLDED_FROZEN + ['--deepspeed_config', config, '--load_dir',
                                                os.path.dirname(tag_dir), '--load_tag', TAG],
                         steps=STEPS + 2, save=False)
    check_served(report, 'folded: tp1dp2ep2', got, oracle,
                 os.path.join(tag_dir, '.ucp', 'views', 'tp1-pp1-dp2-ep2'), resharded, logs)
    evidence = 'expert_parallel enabled without tensor_parallel.autotp_size'
    report.check(evidence in ds_e2e.log_tail(logs, lines=1000),
                 f'folded live: ucp\'s log does not name the evidence of tp 1 ({evidence}):\n'
                 f'{ds_e2e.log_tail(logs)}')


def compare_folded(report, case, expected, got, racing=False):
    """The folded tag folder `got` holds `expected`'s files, every object and bit alike but the
    run's micro batch and, with `racing`, the expert files' zero_partition_rank (two ranks write
    each, and whichever lands last gives it)."""
    names = sorted(n for n in os.listdir(expected) if n.endswith('.pt'))
    report.check(sorted(n for n in os.listdir(got) if n.endswith('.pt')) == names,
                 f'{case}: files {sorted(os.listdir(got))} vs {names}')
    for name in names:
        allowed = harness.RUN_CONFIG_FIELDS + (
            ('folding.zero_partition_rank',) if racing and name.startswith('layer_') else ())
        report.diffs(harness.compare_files(os.path.join(expected, name), os.path.join(got, name),
                                           allowed), f'{case}/{name}')


def run_live_t4e2(args, env, work, name, tag_dir, extra, save):
    """A plain load_checkpoint of the folded save `tag_dir` at T=4 E=2 under the preload, told the
    grid by the trainer's --deepspeed_config file (autotp_size 4, autoep_size 2; its --tp 4 gives
    its micro batch), with `extra` (the save's other trainer arguments), trained to step 5 and with
    `save` saving what it loaded before it trains. Returns (ucp's log folder, the run's tag
    folder, its losses)."""
    logs = os.path.join(work, f'logs_{name}')
    config = os.path.join(work, f'ds_config_{name}.json')
    with open(config, 'w') as f:
        json.dump({'tensor_parallel': {'autotp_size': 4},
                   'expert_parallel': {'enabled': True, 'autoep_size': 2}}, f)
    saved, got = run_trainer(args, ds_e2e.preload_env(env, args.lib, logs), work, name, 4, None,
                             extra + ['--tp', '4', '--deepspeed_config', config, '--load_dir',
                                      os.path.dirname(tag_dir), '--load_tag', TAG] +
                             (['--save_step', str(STEPS)] if save else []),
                             steps=STEPS + 2, save=save)
    return logs, saved, got


def check_folded_grids(report, args, env, work, tag_dir, uninterrupted):
    """The folded T=2 E=2 save at 4 ranks resharded to other folded grids by `ucp reshard`:
      - to its own grid: the save, every object and bit (its racing expert files aside);
      - to T=4 E=2 (dense DP 1): DeepSpeed's strict load of ucp's files in a folded run there,
        saved again before it trains, = ucp's files in every object and bit but the micro batch;
        its step 4 within 1e-5 of the folded run's (another TP degree sums in another order);
        and ucp's files resharded back to T=2 E=2 = the save;
      - live: the save resumed at T=4 E=2 by a plain load_checkpoint under the preload, told the
        grid by the trainer's --deepspeed_config file (autotp_size 4, autoep_size 2; the trainer's
        own arguments give its micro batch only): steps 4 and 5 bit-identical
        to DeepSpeed's strict load of ucp's files, every file served `ucp reshard`'s."""
    failures = len(report.failures)
    same = os.path.join(work, 'folded_same')
    if reshard_to(report, args, tag_dir, 'tp=2,dp=2,ep=2', same):
        compare_folded(report, 'folded -> t2e2', tag_dir, os.path.join(same, TAG), racing=True)
    t4e2 = os.path.join(work, 'folded_t4e2')
    if not reshard_to(report, args, tag_dir, 'tp=4,dp=1,ep=2', t4e2):
        return
    resaved, loaded = run_trainer(args, env, work, 'folded_t4e2_load', 4, 2,
                                  FOLDED_FROZEN + ['--tp', '4', '--load_dir', t4e2, '--load_tag',
                                                   TAG, '--save_step', str(STEPS)],
                                  steps=STEPS + 2)
    compare_folded(report, 'folded -> t4e2', resaved, os.path.join(t4e2, TAG))
    step = STEPS + 1
    report.check(step in loaded and abs(loaded[step] - uninterrupted[step]) < 1e-5,
                 f'folded: DeepSpeed\'s load of ucp\'s T4E2 files trains step {step} to '
                 f'{loaded.get(step)}, the folded T2E2 run to {uninterrupted[step]}')
    print(f'folded: DeepSpeed\'s T4E2 load of ucp\'s files: step {step} loss '
          f'{loaded.get(step)!r}, the folded T2E2 run\'s {uninterrupted[step]!r}')
    back = os.path.join(work, 'folded_t4e2_back')
    if reshard_to(report, args, os.path.join(t4e2, TAG), 'tp=2,dp=2,ep=2', back):
        compare_folded(report, 'folded -> t4e2 -> t2e2', tag_dir, os.path.join(back, TAG),
                       racing=True)
    if len(report.failures) == failures:
        print('folded: ucp reshard to t2e2 = the save; to t4e2 = DeepSpeed\'s strict load and '
              'resave there; back = the save')
    logs, _, got = run_live_t4e2(args, env, work, 'folded_t4e2_live', tag_dir, FOLDED_FROZEN,
                                 save=False)
    check_served(report, 'folded: t4e2', got, loaded,
                 os.path.join(tag_dir, '.ucp', 'views', 'tp4-pp1-dp1-ep2'),
                 os.path.join(t4e2, TAG), logs)


def check_folded(report, args, env, work):
    """AutoEP with AutoTP (DeepSpeed's folded layout: dense tensors split over the tensor-parallel
    ranks, each expert whole on its ranks' files).
      - T=2 E=2 at 2 ranks under the preload writes DeepSpeed's files byte for byte, trains
        bit-identically to the run without it, and commits an index. (At a dense DP above 1 two
        ranks write each expert file and race, so the bytes are compared here.)
      - T=2 E=2 at 4 ranks (dense DP 2, expert DP 2; FOLDED_FROZEN's two dense parameters frozen)
        saved at step 3 under the preload, trained on to step 4: the index built at save is `ucp
        index`'s, each dense atom whole (AutoTP's logical shape; a frozen one split over TP its
        bit16 atom from the lanes' module slices), each expert's rows an atom as at T=1; `ucp
        export` is the lanes' slices gathered here (check_folded_export); DeepSpeed's universal
        load of it at T=1 (DP 2, E 2)
        trains step 4 bit-identically to the folded run's step 4; `ucp reshard` of the folded tag
        to T=1 DP=2 E=2 writes DeepSpeed's own files there (that universal load, saved again
        before it trains: every object and bit but its micro batch and load_universal); other
        folded grids, check_folded_grids; the refusals of check_folded_refusals; live,
        check_folded_live."""
    folded = ['--tp', '2']
    plain_dir, plain = run_trainer(args, env, work, 'folded_plain', 2, 2, folded)
    logs = os.path.join(work, 'logs_folded')
    tag_dir, got = run_trainer(args, ds_e2e.preload_env(env, args.lib, logs), work, 'folded', 2,
                               2, folded)
    report.check({s: ds_e2e.float32_bits(v) for s, v in got.items()} ==
                 {s: ds_e2e.float32_bits(v) for s, v in plain.items()},
                 f'folded: losses under the preload {got} differ from {plain}')
    names = sorted(n for n in os.listdir(plain_dir) if n.endswith('.pt'))
    report.check(sorted(n for n in os.listdir(tag_dir) if n.endswith('.pt')) == names and
                 any(n.startswith('layer_') for n in names) and
                 all(harness.read_bytes(os.path.join(tag_dir, n)) ==
                     harness.read_bytes(os.path.join(plain_dir, n)) for n in names),
                 f'folded: the files saved under the preload are not the plain run\'s {names}')
    report.check(os.path.isfile(os.path.join(tag_dir, '.ucp', 'index.json')),
                 f'folded: no index committed at save:\n{ds_e2e.log_tail(logs)}')

    logs = os.path.join(work, 'logs_folded_w4')
    tag_dir, uninterrupted = run_trainer(
        args, ds_e2e.preload_env(env, args.lib, logs), work, 'folded_w4', 4, 2,
        folded + FOLDED_FROZEN + ['--save_step', str(STEPS)], steps=STEPS + 1)
    indexed = indexed_at_save(report, args, 'folded W=4', tag_dir, logs)
    if indexed is None:
        return
    shapes = {(a['param'], a['state']): a['shape'] for a in indexed['atoms']}
    folded_tp = indexed['adapter_state'].get('folded_tp', {}).get('degree')
    q_proj = shapes.get(('model.layers.0.self_attn.q_proj.weight', 'fp32'))
    expert = shapes.get(('model.layers.1.mlp.experts.w2.3', 'fp32'))
    report.check(folded_tp == 2 and indexed['topology']['tp'] == 2 and q_proj == [32, 32] and
                 expert == [32, 64], f'folded W=4: index folded_tp {folded_tp}, topology '
                 f'{indexed["topology"]}, q_proj {q_proj}, expert 3\'s w2 {expert}')
    export = os.path.join(work, 'folded_export', TAG)
    if check_folded_export(report, args, tag_dir, export):
        resaved, loaded = run_trainer(args, env, work, 'folded_universal_load', 2, 2,
                                      FOLDED_FROZEN + ['--load_dir', os.path.dirname(export),
                                                       '--load_tag', TAG, '--universal',
                                                       '--save_step', str(STEPS)],
                                      steps=STEPS + 2)
        step = STEPS + 1
        report.check(step in loaded and ds_e2e.float32_bits(loaded[step]) ==
                     ds_e2e.float32_bits(uninterrupted[step]),
                     f'folded: DeepSpeed\'s tp 1 universal load of ucp\'s export trains step '
                     f'{step} to {loaded.get(step)}, the folded run to {uninterrupted[step]}')
        print(f'folded: DeepSpeed\'s tp 1 universal load of ucp\'s export: step {step} loss '
              f'{loaded.get(step)!r}, the folded run\'s {uninterrupted[step]!r}')
        failures = len(report.failures)
        out = os.path.join(work, 'folded_reshard_dp2ep2')
        if reshard_to(report, args, tag_dir, 'tp=1,dp=2,ep=2', out):
            harness.compare_resaved(report, 'folded -> tp1 dp2ep2', out, resaved, TAG)
        if len(report.failures) == failures:
            print('folded: ucp reshard to tp 1 dp2ep2 = DeepSpeed\'s resave there')
        check_folded_live(report, args, env, work, tag_dir, loaded, os.path.join(out, TAG))
    check_folded_grids(report, args, env, work, tag_dir, uninterrupted)
    check_folded_refusals(report, args, tag_dir, work)


def main():
    parser = argparse.ArgumentParser()
    ds_e2e.add_run_arguments(parser)
    parser.add_argument('--zero3', action='store_true',
                        help='run the ZeRO-3 checks (items 9 and 10) alone; without it, the others')
    args = ds_e2e.parse_run_arguments(parser)
    env = ds_e2e.trainer_environment(args)
    if args.zero3:
        work = harness.fresh_dir(os.path.join(args.work, 'autoep_zero3'))
        report = harness.Report('AutoEP ZeRO-3')
        check_zero3(report, args, env, work)
        check_folded_zero3(report, args, env, work)
        report.exit()
    work = harness.fresh_dir(os.path.join(args.work, 'autoep'))
    report = harness.Report('AutoEP')

    logs = os.path.join(work, 'logs_save')
    tag_dir, _ = run_trainer(args, ds_e2e.preload_env(env, args.lib, logs), work, 'ckpt', DP, EP,
                             [])
    index = os.path.join(tag_dir, '.ucp', 'index.json')
    if not report.check(os.path.isfile(index), f'no index built at save; ucp logs:\n'
                        f'{ds_e2e.log_tail(logs)}'):
        report.exit()
    at_save = harness.read_bytes(index)
    universal = os.path.join(work, 'universal', TAG)
    ds_e2e.ds_to_universal(env, tag_dir, universal)
    status, output = harness.run_ucp_output(args.ucp, 'index', tag_dir)
    if not report.check(status == 0, f'ucp index exited {status}: {output[-2000:]}'):
        report.exit()
    report.check(harness.read_bytes(index) == at_save, 'the index built at save differs from '
                 'ucp index\'s')
    check_index(report, tag_dir)
    check_export(report, args, 'ZeRO-1', tag_dir, universal, os.path.join(work, 'export'),
                 ['mp_rank_00_model_states.pt'])
    resumed = check_reshard(report, args, env, work, tag_dir, universal)
    for dp, ep in LIVE:
        check_live_resume(report, args, env, work, tag_dir, dp, ep, resumed[(dp, ep)])
    check_data_before_expert(report, args, env, work)
    check_bf16_export(report, args, env, work)
    check_frozen_experts(report, args, env, work)
    check_refusals(report, args, tag_dir, work)
    check_folded(report, args, env, work)
    report.exit()


if __name__ == '__main__':
    main()

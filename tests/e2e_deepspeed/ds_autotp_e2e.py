#!/usr/bin/env python3
"""AutoTP tensor parallelism under ZeRO-3 (or with --zero_stage, ZeRO-1 or 2), as the current
DeepSpeed release writes it, against DeepSpeed's own converter.

  1. train_autotp.py saves a ZeRO-3 checkpoint at TP=2 x DP=2 (4 ranks, 3 steps) under the
     preload, which indexes it at save (ZeRO-1/2: mp_rank_XX model states and
     zero_pp_rank_D_mp_rank_XX optimizer files, the splits only in the affine map).
  2. DeepSpeed's ds_to_universal.py converts it (the oracle: every parameter whole, from the TP
     slices its affine map describes).
  3. The index built at save is the one `ucp index` builds: per parameter the rule its affine
     map gives (column-parallel weights and biases split on dim 0, row-parallel weights on dim 1,
     the rest whole; the MLP's 65 in blocks of 33 and 32), and `ucp export --format
     deepspeed-universal` writes exactly DeepSpeed's files: every object, tensor, dtype, stride
     and bit, and the model states byte for byte.
  4. `ucp reshard` to TP=2 x DP=1, TP=1 x DP=2, TP=4 x DP=1 and TP=3 x DP=1 writes DeepSpeed's
     own files there: those its universal load of the converted tag saves again (every object,
     tensor and bit but the resaving run's micro batch and load_universal); so do the ways through
     DP=3 (padding) and through TP=4 back to TP=2 x DP=1.
  5. Live: the save resumed at TP=1 x DP=2 and TP=4 x DP=1 (the MLP's 65 as 17, 16, 16 and 16)
     by a plain load_checkpoint under the preload (told the TP degree by UCP_TOPOLOGY) trains
     steps 4..6 with losses bit-identical to DeepSpeed's universal load of the converted tag at
     that size; the files served are `ucp reshard`'s.
  6. What ucp does not do is refused by name: a slice the affine map places other than as a
     whole rank's block (the map edited); mp_world_size 2 without the map.
  7. A model config beside the tag: with its true key/value head count (4) the tp=4 files are
     those without a config; with 2 heads an attention layer would split as 16, 16, 0, 0 at tp=4,
     an MLP's as 8 each, and the saved 16, 16 do not say which q/k/v are: refused.
  8. (fp32) Frozen parameters: indexed, round-tripped through tp4dp1, and resumed there live
     (check_frozen); under ZeRO-1 also saved at TP=1 x DP=2, where ds_to_universal converts
     them (0.19.8 writes each frozen parameter's fp32.pt from the module) and `ucp export`
     writes the same files (check_frozen_export).
  9. (ZeRO-1) A Llama with 2 key/value heads saved at TP=4, whose ranks 2 and 3 hold empty
     attention slices, is refused by `ucp index` naming the slice (check_empty_slices).

Steps 4 and 5 take the sizes of the model's, dtype's and ZeRO stage's plan (PLANS): those above
in ZeRO-3 fp32, fewer in bf16 and under ZeRO-1/2. Steps 6 and 7 run under ZeRO-3 only: the affine
map and the split rule are read by the same code under every stage.

With --model llama the trainer's model is a Hugging Face LlamaForCausalLM (its head of 67 rows
split 34/33) and its config.json lies beside the tag: 3 to 5 for the sizes of its plan (PLANS),
and instead of 6 and 7 the TP=3 refusal that names the config.json's heads.

With --model fused q, k and v (32, 16 and 16 rows) are one projection and gate and up (65 each,
33 and 32 at TP=2) another, split by a partition_config's sub-parameter shapes ((q, k, v), -1)
and (2, -1): each TP rank holds its block of every part, which AutoTP's affine map records as
one piece per part and its sub_param_shard_widths as each part's widths. 3 to 5 for the sizes of
its plan (tp4: gate's and up's 65 as 17, 16, 16, 16 each), the index holding each as a split of
its parts (check_fused_index).

Usage: ds_autotp_e2e.py --dtype fp32|bf16 [--model tiny|llama] [--zero_stage 1|2|3] --work DIR
       --tools DIR --lib LIB --ucp UCP --deepspeed VERSION [--required]
"""
import argparse
import json
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', 'deepspeed'))

import ds_e2e  # noqa: E402
import ds_objects  # noqa: E402
import harness  # noqa: E402

TP, DP, STEPS, RESUME_STEPS = 2, 2, 3, 6
TAG = f'global_step{STEPS}'
TRAINER = os.path.join(HERE, 'train_autotp.py')
# train_autotp.py's attention heads: WIDTH 32 in heads of HEAD 8.
MODEL_HEADS = 4
# Per model (train_autotp.py's --model), dtype and ZeRO stage: the sizes (tp, dp) ucp reshards to
# against DeepSpeed's own resaves there ('targets'), those it reshards to and then back to
# TP=2 x DP=1 ('through'), and those resumed live under the preload ('live': each a target too,
# whose resaving run trains on as the live resume's oracle). At TP=3 every split
# of the tiny model is uneven (attention's 32 as 11, 11, 10; the MLP's 65 as 22, 22, 21); the
# resave trains no step, whose attention could not take heads of 8 from 11 rows. The split logic
# does not depend on the dtype: bf16 takes each kind of size once (the saved degree, tp1, uneven
# tp4 there and back, live). The Llama's head of 67 is 34/33 at TP=2, 17/17/17/16 at TP=4.
# ZeRO-1 and 2 share the split rule with ZeRO-3 and write other files (mp_rank_XX model states,
# ZeRO-1/2 optimizer partitions): ZeRO-1 in fp32 the saved degree and uneven tp4 there and back,
# ZeRO-2 in bf16 tp1 and tp4; both live at tp4. The fused model under ZeRO-3 the saved degree
# and tp4 there and back, under ZeRO-1 tp1 and tp4 (its parts of 16 rows do not split over 3
# ranks); both live at tp4.
PLANS = {
    ('tiny', 'fp32', 3): {'targets': ((2, 1), (1, 2), (4, 1), (3, 1)),
                          'through': ((2, 3), (4, 1)), 'live': ((1, 2), (4, 1))},
    ('tiny', 'bf16', 3): {'targets': ((2, 1), (1, 2), (4, 1)), 'through': ((4, 1),),
                          'live': ((4, 1),)},
    ('llama', 'fp32', 3): {'targets': ((2, 1), (1, 2), (4, 1)), 'through': (), 'live': ((4, 1),)},
    ('tiny', 'fp32', 1): {'targets': ((2, 1), (4, 1)), 'through': ((4, 1),), 'live': ((4, 1),)},
    ('tiny', 'bf16', 2): {'targets': ((1, 2), (4, 1)), 'through': (), 'live': ((4, 1),)},
    ('fused', 'fp32', 1): {'targets': ((1, 2), (4, 1)), 'through': (), 'live': ((4, 1),)},
    ('fused', 'fp32', 3): {'targets': ((2, 1), (4, 1)), 'through': ((4, 1),), 'live': ((4, 1),)},
}
# A ZeRO-3 optimizer file: (DP rank, TP rank).
ZERO3_OPTIM = re.compile(r'(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt')
# check_frozen: the relative difference allowed between the losses of a resume at tp4dp1 under the
# preload and DeepSpeed's own at the saved tp2dp2 (measured: at most 1.1e-7).
FROZEN_LOSS_TOLERANCE = 1e-6
# train_autotp.py --frozen's parameters.
FROZEN_NAMES = ('layers.0.mlp.up_proj.weight', 'layers.0.input_layernorm.weight',
                'layers.1.self_attn.o_proj.weight')
# The rule each parameter's affine map gives (index adapter_state.tp.params), by name suffix.
EXPECTED_RULES = {
    'self_attn.q_proj.weight': ('split', 0), 'self_attn.q_proj.bias': ('split', 0),
    'self_attn.o_proj.weight': ('split', 1), 'self_attn.o_proj.bias': ('replicated', None),
    'mlp.up_proj.weight': ('split', 0), 'mlp.down_proj.weight': ('split', 1),
    'input_layernorm.weight': ('replicated', None), 'embed_tokens.weight': ('replicated', None),
    'lm_head.weight': ('replicated', None),
}
# The blocks of the uneven splits (train_autotp.py's MLP, 65 wide), by name suffix; the others
# are equal and have none.
EXPECTED_BLOCKS = {'mlp.up_proj.weight': [33, 32], 'mlp.up_proj.bias': [33, 32],
                   'mlp.down_proj.weight': [33, 32]}


def run_trainer(args, env, work, name, tp, dp, extra, steps=STEPS, save=True):
    """train_autotp.py at `tp` x `dp` ranks up to step `steps` with `extra` arguments, saving to
    work/name when `save`; fails the test unless it ran. Returns (tag folder, losses)."""
    save_dir = os.path.join(work, name)
    out = os.path.join(work, f'{name}.json')
    command = [sys.executable, 'launch.py', str(tp * dp), ds_e2e.PORT, TRAINER, '--tp', str(tp),
               '--model', args.model, '--dtype', args.dtype, '--zero_stage', str(args.zero_stage),
               '--steps', str(steps), '--out', out] + extra
    status, seconds, output = ds_e2e.run_past_flakes(lambda: ds_e2e.run_launcher(
        command + (['--save_dir', save_dir] if save else []), args.tools, env,
        os.path.join(work, f'{name}.log')), steps, save_dir if save else None, out)
    if status != 0:
        ds_e2e.fail(f'DeepSpeed TP={tp} x DP={dp} ZeRO-{args.zero_stage} ({name}) exited '
                    f'{status}:\n{output[-3000:]}')
    print(f'TP={tp} x DP={dp} ZeRO-{args.zero_stage} AutoTP {args.dtype} {name}: {seconds:.1f} s')
    return os.path.join(save_dir, TAG), ds_e2e.losses(out)


def train(args, env, work):
    env = ds_e2e.preload_env(env, args.lib, os.path.join(work, 'logs_save'))
    return run_trainer(args, env, work, 'ckpt', TP, DP, [])[0]


def reshard(report, args, source, out, tp, dp):
    status, output = harness.run_ucp_output(args.ucp, 'reshard', source, '--to', f'dp={dp},tp={tp}',
                                            '--out', out)
    return report.check(status == 0, f'ucp reshard {source} --to dp={dp},tp={tp} exited '
                        f'{status}: {output[-2000:]}')


def check_reshard(report, args, env, work, tag_dir, universal):
    """ucp's files at each of the plan's targets against DeepSpeed's resave there (its universal
    load of the converted tag, saved again), and the ways through its sizes to tp2dp1. At a size
    the plan resumes live the resaving run trains on to RESUME_STEPS after it saved what it
    loaded: returns those runs' losses by (tp, dp), DeepSpeed's universal resume there."""
    resaved, resumed = {}, {}
    for tp, dp in args.plan['targets']:
        name = f'tp{tp}dp{dp}'
        live = (tp, dp) in args.plan['live']
        resaved[name], losses = run_trainer(
            args, env, work, f'resaved_{name}', tp, dp,
            ['--load_dir', os.path.dirname(universal), '--load_tag', TAG, '--universal'] +
            (['--save_step', str(STEPS)] if live else []), steps=RESUME_STEPS if live else STEPS)
        if live:
            resumed[(tp, dp)] = losses
        failures = len(report.failures)
        out = os.path.join(work, f'reshard_{name}')
        if reshard(report, args, tag_dir, out, tp, dp):
            harness.compare_resaved(report, name, out, resaved[name], TAG)
        if len(report.failures) == failures:
            print(f'ucp reshard to {name} = DeepSpeed\'s resave there')
    for through in args.plan['through']:
        name = f'tp{through[0]}dp{through[1]}'
        middle = os.path.join(work, f'reshard_{name}')
        back = os.path.join(work, f'reshard_{name}_tp2dp1')
        failures = len(report.failures)
        if (os.path.isdir(middle) or reshard(report, args, tag_dir, middle, *through)) and \
                reshard(report, args, os.path.join(middle, TAG), back, 2, 1):
            harness.compare_resaved(report, f'{name} -> tp2dp1', back, resaved['tp2dp1'], TAG)
        if len(report.failures) == failures:
            print(f'ucp reshard to {name}, then to tp2dp1 = DeepSpeed\'s resave at tp2dp1')
    return resumed


def check_live_resume(report, args, env, work, tag_dir, universal_losses, tp, dp):
    """The save resumed at `tp` x `dp` for steps 4..6 by DeepSpeed's universal load of the
    converted tag (the oracle: its `universal_losses`, check_reshard's) and by a plain
    load_checkpoint of the tag under the preload, told the TP degree by UCP_TOPOLOGY (DeepSpeed
    refuses that load without ucp): losses bit-identical, and the files served are `ucp
    reshard`'s."""
    size = f'tp{tp}dp{dp}'
    load = ['--load_tag', TAG]
    oracle = {s: v for s, v in universal_losses.items() if s > STEPS}
    logs = os.path.join(work, f'logs_preload_{size}')
    preload = dict(ds_e2e.preload_env(env, args.lib, logs), UCP_TOPOLOGY=f'tp={tp}')
    _, got = run_trainer(args, preload, work, f'preload_{size}', tp, dp,
                         load + ['--load_dir', os.path.dirname(tag_dir)], steps=RESUME_STEPS,
                         save=False)
    steps = list(range(STEPS + 1, RESUME_STEPS + 1))
    ds_e2e.print_losses(f'losses {size} universal', oracle)
    ds_e2e.print_losses(f'losses {size} preload', got)
    report.check(sorted(got) == steps and sorted(oracle) == steps,
                 f'{size}: resumed steps {sorted(got)}, universal steps {sorted(oracle)}')
    report.check({s: ds_e2e.float32_bits(v) for s, v in got.items()} ==
                 {s: ds_e2e.float32_bits(v) for s, v in oracle.items()},
                 f'{size}: losses under the preload differ from DeepSpeed\'s universal load')
    view = os.path.join(tag_dir, '.ucp', 'views', f'tp{tp}-pp1-dp{dp}')
    if not report.check(os.path.isdir(view), f'{size}: no view {view}; ucp logs:\n'
                        f'{ds_e2e.log_tail(logs)}'):
        return
    resharded = os.path.join(work, f'reshard_{size}', TAG)
    for name in sorted(n for n in os.listdir(resharded) if n.endswith('.pt')):
        stored = os.path.join(view, 'served.' + name)
        report.check(os.path.isfile(stored) and harness.read_bytes(stored) ==
                     harness.read_bytes(os.path.join(resharded, name)),
                     f'{size}/{name}: not served, or not `ucp reshard`\'s bytes')


def check_index(report, tag_dir):
    with open(os.path.join(tag_dir, '.ucp', 'index.json')) as f:
        index = json.load(f)
    topology = index['topology']
    report.check((topology['dp'], topology['tp']) == (DP, TP), f'index topology {topology}')
    rules = index['adapter_state']['tp']['params']
    for suffix, (rule, dim) in EXPECTED_RULES.items():
        names = [name for name in rules if name.endswith(suffix)]
        report.check(bool(names), f'no shard map of a parameter ending in {suffix}')
        for name in names:
            got = (rules[name]['rule'], rules[name].get('dim'))
            report.check(got == (rule, dim), f'{name}: rule {got}, expected {(rule, dim)}')
    for name, rule in rules.items():
        expected = next((b for suffix, b in EXPECTED_BLOCKS.items() if name.endswith(suffix)), None)
        report.check(rule.get('blocks') == expected,
                     f'{name}: blocks {rule.get("blocks")}, expected {expected}')


def check_fused_index(report, tag_dir):
    """The fused projections are splits of their parts: q, k and v of 32, 16 and 16 rows in
    equal blocks, gate and up of 65 each in blocks of 33 and 32 (the index's blocks part by
    part); the row-parallel weights split on dim 1, down's 65 as 33 and 32."""
    with open(os.path.join(tag_dir, '.ucp', 'index.json')) as f:
        rules = json.load(f)['adapter_state']['tp']['params']
    gate_up = (0, [65, 65], [33, 32, 33, 32])
    expected = {'self_attn.qkv_proj.weight': (0, [32, 16, 16], None),
                'self_attn.qkv_proj.bias': (0, [32, 16, 16], None),
                'mlp.gate_up_proj.weight': gate_up, 'mlp.gate_up_proj.bias': gate_up,
                'self_attn.o_proj.weight': (1, [32], None),
                'mlp.down_proj.weight': (1, [65], [33, 32])}
    for suffix, (dim, sub_params, blocks) in expected.items():
        for layer in (0, 1):
            name = f'layers.{layer}.{suffix}'
            rule = rules.get(name, {})
            got = (rule.get('rule'), rule.get('dim'), rule.get('sub_params'), rule.get('blocks'))
            report.check(got == ('split', dim, sub_params, blocks),
                         f'{name}: (rule, dim, sub_params, blocks) {got}, expected '
                         f'{("split", dim, sub_params, blocks)}')


def check_llama_index(report, tag_dir):
    """The Llama's head of 67 rows in blocks of 34 and 33, a vocabulary parameter; attention's and
    the MLP's splits even."""
    with open(os.path.join(tag_dir, '.ucp', 'index.json')) as f:
        tp_state = json.load(f)['adapter_state']['tp']
    # deepspeed-zero3 lists them in tp.vocabulary, deepspeed-tp (ZeRO-1/2) in tp.autotp.vocabulary.
    vocabulary = tp_state.get('autotp', tp_state).get('vocabulary')
    report.check(vocabulary == ['lm_head.weight'], f'vocabulary {vocabulary}')
    for name, rule in tp_state['params'].items():
        expected = [34, 33] if name == 'lm_head.weight' else None
        report.check(rule.get('blocks') == expected,
                     f'{name}: blocks {rule.get("blocks")}, expected {expected}')


def check_llama_heads(report, args, work, tag_dir):
    """The key/value heads come from the config.json the trainer wrote beside the tag: at TP=3 an
    attention layer of the Llama's 4 heads would split 16/8/8 and an MLP's 11/11/10, and the saved
    16/16 do not say which q is: refused, naming the heads and the file."""
    status, output = harness.run_ucp_output(args.ucp, 'reshard', tag_dir, '--to', 'dp=1,tp=3',
                                            '--out', os.path.join(work, 'reshard_tp3'))
    config = os.path.join(os.path.dirname(tag_dir), 'config.json')
    report.check(status != 0 and 'of [16, 8, 8] (4 key/value heads (' + config in output and
                 'self_attn.q_proj.weight' in output,
                 f'ucp reshard --to dp=1,tp=3: exit {status}, not the refusal: {output[-500:]}')


def check_frozen(report, args, env, work):
    """Frozen parameters (train_autotp.py --frozen: one split 33/32, one row-parallel, a norm) are
    in each TP rank's module alone (ZeRO-1/2) or in its frozen_param_fragments, DP pieces of its
    slices (ZeRO-3). DeepSpeed 0.19.8's ds_to_universal fails on such a save ("Unused patterns
    ... while merging tp slices") and its plain load takes no other size, so there is no oracle
    but the round trip and the losses: the save resharded to tp4dp1 and back to tp2dp2 is the
    save again, every object and bit (under ZeRO-3 but the optimizer partitions' padding, which a
    training save leaves uninitialised); resumed at tp4dp1 under the preload it trains steps 4..6
    with the losses of DeepSpeed's own resume at the saved size within FROZEN_LOSS_TOLERANCE (the
    split's reductions differ in their last bits; a wrong slice moves them by far more)."""
    logs = os.path.join(work, 'logs_frozen_save')
    tag_dir, _ = run_trainer(args, ds_e2e.preload_env(env, args.lib, logs), work, 'frozen', TP,
                             DP, ['--frozen'])
    index = os.path.join(tag_dir, '.ucp', 'index.json')
    if not report.check(os.path.isfile(index), f'frozen: no index built at save; ucp logs:\n'
                        f'{ds_e2e.log_tail(logs)}'):
        return
    with open(index) as f:
        state = json.load(f)['adapter_state']
    # deepspeed-zero3 lists every frozen parameter, deepspeed-tp those split over the TP ranks.
    split = ['layers.0.mlp.up_proj.weight', 'layers.1.self_attn.o_proj.weight']
    if args.zero_stage == 3:
        frozen, expected = state['frozen_params'], ['layers.0.input_layernorm.weight'] + split
    else:
        frozen, expected = state['tp'].get('frozen'), split
    report.check(frozen == expected, f'frozen: the index lists {frozen} as frozen')
    middle = os.path.join(work, 'frozen_tp4dp1')
    back = os.path.join(work, 'frozen_tp4dp1_tp2dp2')
    if reshard(report, args, tag_dir, middle, 4, 1) and \
            reshard(report, args, os.path.join(middle, TAG), back, TP, DP):
        for name in sorted(n for n in os.listdir(tag_dir) if n.endswith('.pt')):
            saved, got = os.path.join(tag_dir, name), os.path.join(back, TAG, name)
            optim = ZERO3_OPTIM.match(name)
            if args.zero_stage == 3 and optim:
                shapes = ds_objects.load(os.path.join(
                    tag_dir, f'zero_pp_rank_{optim[1]}_mp_rank_{optim[2]}_model_states.pt'))
                saved = harness.zero3_padding_zeroed(ds_objects.load(saved),
                                                     shapes['param_shapes'], DP, int(optim[1]))
                diffs = ds_objects.compare(saved, ds_objects.load(got))
            else:
                diffs = harness.compare_files(saved, got)
            report.diffs(diffs, f'frozen: tp4dp1 and back/{name}')
    load = ['--frozen', '--load_tag', TAG, '--load_dir', os.path.dirname(tag_dir)]
    _, oracle = run_trainer(args, env, work, 'frozen_resumed', TP, DP, load, steps=RESUME_STEPS,
                            save=False)
    preload = dict(ds_e2e.preload_env(env, args.lib, os.path.join(work, 'logs_frozen_tp4dp1')),
                   UCP_TOPOLOGY='tp=4')
    _, got = run_trainer(args, preload, work, 'frozen_preload_tp4dp1', 4, 1, load,
                         steps=RESUME_STEPS, save=False)
    ds_e2e.print_losses('frozen: losses tp2dp2 resumed', oracle)
    ds_e2e.print_losses('frozen: losses tp4dp1 preload', got)
    steps = list(range(STEPS + 1, RESUME_STEPS + 1))
    report.check(sorted(got) == steps and sorted(oracle) == steps and
                 all(abs(got[s] - oracle[s]) <= FROZEN_LOSS_TOLERANCE * abs(oracle[s])
                     for s in steps),
                 f'frozen: tp4dp1 losses under the preload {got}, DeepSpeed\'s at tp2dp2 {oracle}')


def check_frozen_export(report, args, env, work):
    """At TP=1 DeepSpeed 0.19.8's ds_to_universal converts a save with frozen parameters, writing
    zero/<name>/fp32.pt ({'param': the module's tensor}) for each: `ucp export` of the same save
    (deepspeed-zero12, without an affine map) writes exactly its files."""
    tag_dir, _ = run_trainer(args, env, work, 'frozen_tp1', 1, DP, ['--frozen'])
    universal = os.path.join(work, 'frozen_tp1_universal', TAG)
    ds_e2e.ds_to_universal(env, tag_dir, universal)
    export = os.path.join(work, 'frozen_tp1_export')
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if report.check(status == 0, f'frozen tp1: ucp export exited {status}: {output[-2000:]}'):
        failures = len(report.failures)
        names = harness.compare_export(report, 'frozen tp1 export', universal, export)
        report.check(all(f'zero/{name}/fp32.pt' in names for name in FROZEN_NAMES),
                     f'frozen tp1: ds_to_universal wrote no fp32.pt of {FROZEN_NAMES}')
        if len(report.failures) == failures:
            print(f'frozen tp1: ucp export = ds_to_universal: {len(names)} files')


def check_empty_slices(report, args, env, work):
    """AutoTP at a TP degree above the model's key/value heads (the Llama with 2 at TP=4) gives
    ranks 2 and 3 empty attention slices, which ZeRO-1 leaves out of their param_shapes (ZeRO-3
    cannot train it; DeepSpeed's ds_to_universal fails on it): `ucp index` refuses it, naming the
    file and the parameter."""
    tag_dir, _ = run_trainer(args, env, work, 'empty_slices', 4, 1,
                             ['--model', 'llama', '--kv_heads', '2'])
    status, output = harness.run_ucp_output(args.ucp, 'index', tag_dir)
    report.check(status != 0 and 'mp_rank_02_model_states.pt: module/model.layers.0.self_attn.'
                 'q_proj.weight: an empty slice [0, 32]' in output,
                 f'empty slices: ucp index exited {status}, not the refusal: {output[-500:]}')


def edited_copy(tag_dir, work, name, edit):
    """A copy of the tag whose model states `edit` changed (every one alike)."""
    copy = harness.copy_tag(tag_dir, os.path.join(work, name))
    shutil.rmtree(os.path.join(copy, '.ucp'), ignore_errors=True)
    for file in os.listdir(copy):
        if file.endswith('_model_states.pt'):
            states = ds_objects.load(os.path.join(copy, file))
            edit(states['universal_checkpoint_info'])
            ds_objects.save(states, os.path.join(copy, file))
    return copy


def check_refusals(report, args, tag_dir, work):
    pattern = '^layers\\.0\\.self_attn\\.q_proj\\.weight$'

    def shift_rank_1(info):
        piece = info['affine_map']['params'][pattern]['ranks'][1]['pieces'][0]
        piece['source'][0] += 1
    copy = edited_copy(tag_dir, work, 'shifted', shift_rank_1)
    status, output = harness.run_ucp_output(args.ucp, 'index', copy)
    report.check(status != 0 and f'affine_map/params/{pattern}/ranks/1' in output and
                 'after those of the ranks before it' in output,
                 f'index of a shifted slice: exit {status}: {output[-500:]}')

    copy = edited_copy(tag_dir, work, 'no_map', lambda info: info.pop('affine_map'))
    status, output = harness.run_ucp_output(args.ucp, 'index', copy)
    report.check(status != 0 and 'mp_world_size 2 without AutoTP' in output,
                 f'index without the affine map: exit {status}: {output[-500:]}')


def check_model_config(report, args, work, tag_dir):
    """AutoTP splits an attention layer in whole key/value heads where the model has a config that
    names them, and ucp reads them from the Hugging Face config.json beside the tag: with the
    model's 4 heads tp=4 is the even split ucp writes without a config; with 2 heads AutoTP would
    split q/k/v at tp=4 as 16, 16, 0, 0, which ucp refuses naming the heads and their source."""
    for heads in (MODEL_HEADS, 2):
        folder = os.path.join(work, f'kv_heads_{heads}')
        copy = harness.copy_tag(tag_dir, os.path.join(folder, TAG))
        with open(os.path.join(folder, 'config.json'), 'w') as f:
            json.dump({'num_attention_heads': MODEL_HEADS, 'num_key_value_heads': heads}, f)
        out = os.path.join(work, f'reshard_kv_heads_{heads}')
        status, output = harness.run_ucp_output(args.ucp, 'reshard', copy, '--to', 'dp=1,tp=4',
                                                '--out', out)
        if heads == MODEL_HEADS:
            if report.check(status == 0, f'ucp reshard with 4 heads: exit {status}: '
                            f'{output[-2000:]}'):
                plain = os.path.join(work, 'reshard_tp4dp1', TAG)
                names = [n for n in harness.files_under(plain) if n.endswith('.pt')]
                report.check(bool(names) and all(
                    harness.read_bytes(os.path.join(plain, n)) ==
                    harness.read_bytes(os.path.join(out, TAG, n)) for n in names),
                    'tp=4 with the model\'s 4 heads: not the files of the reshard without them')
        else:
            report.check(status != 0 and 'of [16, 16, 0, 0] (2 key/value heads' in output and
                         'config.json: num_key_value_heads' in output and 'q_proj' in output,
                         f'ucp reshard with 2 heads: exit {status}, not the refusal: '
                         f'{output[-500:]}')


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--dtype', choices=['fp32', 'bf16'], required=True)
    parser.add_argument('--model', choices=sorted({model for model, _, _ in PLANS}),
                        default='tiny')
    parser.add_argument('--zero_stage', type=int, choices=(1, 2, 3), default=3)
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    plan = (args.model, args.dtype, args.zero_stage)
    if plan not in PLANS:
        ds_e2e.fail(f'no plan for --model {args.model} --dtype {args.dtype} '
                    f'--zero_stage {args.zero_stage}')
    args.plan = PLANS[plan]
    env = ds_e2e.trainer_environment(args)
    model = '' if args.model == 'tiny' else f'{args.model}_'
    stage = '' if args.zero_stage == 3 else f'z{args.zero_stage}_'
    work = harness.fresh_dir(os.path.join(args.work, f'autotp_{stage}{model}{args.dtype}'))
    report = harness.Report(f'ZeRO-{args.zero_stage} AutoTP {model}{args.dtype}')

    tag_dir = train(args, env, work)
    index = os.path.join(tag_dir, '.ucp', 'index.json')
    if not report.check(os.path.isfile(index), f'no index built at save; ucp logs:\n'
                        f'{ds_e2e.log_tail(os.path.join(work, "logs_save"))}'):
        report.exit()
    at_save = harness.read_bytes(index)
    universal = os.path.join(work, 'universal', TAG)
    ds_e2e.ds_to_universal(env, tag_dir, universal)
    status, output = harness.run_ucp_output(args.ucp, 'index', tag_dir)
    if not report.check(status == 0, f'ucp index exited {status}: {output[-2000:]}'):
        report.exit()
    report.check(harness.read_bytes(index) == at_save, 'the index built at save differs from '
                 'ucp index\'s')
    if args.model == 'tiny':
        check_index(report, tag_dir)
    elif args.model == 'fused':
        check_fused_index(report, tag_dir)
    else:
        check_llama_index(report, tag_dir)
    export = os.path.join(work, 'export')
    status, output = harness.run_ucp_output(args.ucp, 'export', tag_dir, '--format',
                                            'deepspeed-universal', '--out', export)
    if report.check(status == 0, f'ucp export exited {status}: {output[-2000:]}'):
        failures = len(report.failures)
        names = harness.compare_export(report, 'export', universal, export)
        for name in names:
            if name.endswith('model_states.pt'):
                report.check(harness.read_bytes(f'{universal}/{name}') ==
                             harness.read_bytes(f'{export}/{name}'), f'{name}: bytes differ')
        if len(report.failures) == failures:
            print(f'ucp export = ds_to_universal: {len(names)} files')
    resumed = check_reshard(report, args, env, work, tag_dir, universal)
    for tp, dp in args.plan['live']:
        check_live_resume(report, args, env, work, tag_dir, resumed[(tp, dp)], tp, dp)
    if args.model == 'tiny' and args.dtype == 'fp32':  # FROZEN names the tiny model's
        check_frozen(report, args, env, work)
        if args.zero_stage == 1:
            check_frozen_export(report, args, env, work)
            check_empty_slices(report, args, env, work)
    if args.zero_stage == 3 and args.model == 'tiny':
        check_refusals(report, args, tag_dir, work)
        check_model_config(report, args, work, tag_dir)
    elif args.zero_stage == 3 and args.model == 'llama':
        check_llama_heads(report, args, work, tag_dir)
    report.exit()


if __name__ == '__main__':
    main()

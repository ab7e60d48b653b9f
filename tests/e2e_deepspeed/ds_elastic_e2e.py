#!/usr/bin/env python3
"""DeepSpeed's zero_optimization.elastic_checkpoint under LD_PRELOAD=libucp.so: the optimizer
files hold base_optimizer_state as a list of per-group states without the DP padding, and no
param_groups. ZeRO-2 fp32 with DeepSpeed's own Adam (torch_adam false), which keeps its step in
its param groups: with torch's Adam DeepSpeed cannot load an elastic checkpoint at any size (it
asserts that base_optimizer_state_step was saved).
  1. DP=4, steps 1..6, saving global_step3 elastic, without and under the preload: losses and
     files bit-identical, the index committed (adapter_state elastic_checkpoint true).
  2. The oracle: the same run saving the rigid form without the preload (losses bit-identical to
     the elastic runs'), ds_to_universal.py of it and DeepSpeed's universal load at DP=2.
     DeepSpeed refuses a DP change from either form, and ds_to_universal cannot read the elastic
     one.
  3. The plain resume at DP=2 under the preload, with the elastic config and with the rigid one
     (elastic_checkpoint false): losses bit-identical to the oracle. The files served are
     elastic, equal to what `ucp reshard --to dp=2` writes; `ucp export --format
     deepspeed-universal` refuses the tag, naming the field. Without the preload DeepSpeed
     refuses the resume.
Usage: ds_elastic_e2e.py --work DIR --tools DIR --lib LIBUCP --ucp UCP --deepspeed VERSION
       [--required]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_e2e  # noqa: E402 (the shared environment, launch and loss helpers)

WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'with_ds_config.py')
DEEPSPEED_ADAM = {'optimizer': {'params': {'torch_adam': False}}}
ELASTIC = dict(DEEPSPEED_ADAM, zero_optimization={'elastic_checkpoint': True})
SAVE_DP, RESUME_DP, SAVE_AT, STEPS = 4, 2, 3, 6
TAG = f'global_step{SAVE_AT}'
OPTIM = 'zero_pp_rank_{}_mp_rank_00_optim_states.pt'
# What the served optimizer files hold, read by torch: the form of base_optimizer_state, its
# partition lengths and the step saved beside it.
FORM_PROBE = r"""
import json, sys, torch
forms = []
for path in sys.argv[1:]:
    osd = torch.load(path, map_location='cpu', weights_only=False)['optimizer_state_dict']
    base = osd['base_optimizer_state']
    forms.append({'elastic': isinstance(base, list),
                  'exp_avg': [g['exp_avg'].numel() for g in base] if isinstance(base, list) else None,
                  'fp32': [t.numel() for t in osd['single_partition_of_fp32_groups']],
                  'step': osd.get('base_optimizer_state_step')})
print(json.dumps(forms))
"""

# CONCAT_PROBE SAVE_DP SOURCE RESHARDED: every partition-shaped state and the fp32 partition of
# each group, laid end to end over the ranks, must be equal in SOURCE (SAVE_DP files) and
# RESHARDED (as many files as its model states' dp_world_size), the padded last rank shorter.
CONCAT_PROBE = r"""
import sys, torch
def ranks(folder, n):
    return [torch.load(f'{folder}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt', map_location='cpu',
                       weights_only=False)['optimizer_state_dict'] for r in range(n)]
source = ranks(sys.argv[2], int(sys.argv[1]))
target = ranks(sys.argv[3], torch.load(sys.argv[3] + '/mp_rank_00_model_states.pt',
                                      map_location='cpu', weights_only=False)['dp_world_size'])
lengths = []
for g in range(len(source[0]['base_optimizer_state'])):
    for key in ('exp_avg', 'exp_avg_sq', 'fp32'):
        def flat(files):
            return torch.cat([f['single_partition_of_fp32_groups'][g] if key == 'fp32'
                              else f['base_optimizer_state'][g][key] for f in files])
        if not torch.equal(flat(source), flat(target)):
            sys.exit(f'group {g} {key}: the resharded states differ from the saved ones')
    paddings = [f['group_paddings'][g] for f in target]
    lengths.append([f['base_optimizer_state'][g]['exp_avg'].numel() for f in target])
    if not any(paddings) or lengths[-1][-1] + paddings[-1] != lengths[-1][0]:
        sys.exit(f'group {g}: paddings {paddings}, lengths {lengths[-1]}')
print(f'DP=9 (paddings {[f["group_paddings"] for f in target][-1]}): exp_avg lengths '
      f'{lengths}, the states laid end to end equal the saved ones')
"""


def train(args, env, work, name, nproc, config, extra, logs=None):
    """train.py at `nproc` ranks with `config` merged into its DeepSpeed config; returns
    (exit status, output, losses or None)."""
    out = os.path.join(work, name + '.json')
    command = [sys.executable, 'launch.py', str(nproc), ds_e2e.PORT, WRAPPER, json.dumps(config),
               'train.py', '--stage', '2', '--dtype', 'fp32', '--steps', str(STEPS),
               '--out', out] + extra
    run_env = ds_e2e.preload_env(env, args.lib, logs) if logs else env

    def launch():
        return ds_e2e.run_launcher(command, args.tools, run_env, os.path.join(work, name + '.log'))

    status, seconds, output = ds_e2e.run_past_flakes(launch, STEPS,
                                                             ds_e2e.save_dir_of(extra))
    print(f'{name}: DP={nproc}, {seconds:.1f} s, exit {status}', flush=True)
    return status, output, ds_e2e.losses(out) if status == 0 else None


def trained(args, env, work, name, nproc, config, extra, logs=None):
    status, output, losses = train(args, env, work, name, nproc, config, extra, logs)
    if status != 0:
        ds_e2e.fail(f'{name} exited {status}:\n{output[-3000:]}'
                    + (f'\nucp logs:\n{ds_e2e.log_tail(logs)}' if logs else ''))
    return losses


def bits(losses):
    return {step: ds_e2e.float32_bits(value) for step, value in losses.items()}


def main():
    parser = argparse.ArgumentParser()
    ds_e2e.add_run_arguments(parser)
    args = ds_e2e.parse_run_arguments(parser)
    env = ds_e2e.trainer_environment(args)
    work = os.path.join(args.work, 'elastic_checkpoint')
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    # 1. The elastic save, without and under the preload.
    save = ['--save_at', str(SAVE_AT)]
    plain = trained(args, env, work, 'save_plain', SAVE_DP, ELASTIC,
                    save + ['--save_dir', os.path.join(work, 'ckpt_plain')])
    saved = trained(args, env, work, 'save', SAVE_DP, ELASTIC,
                    save + ['--save_dir', os.path.join(work, 'ckpt')],
                    logs=os.path.join(work, 'logs_save'))
    ds_e2e.print_losses(f'losses DP={SAVE_DP} elastic save', saved)
    if bits(saved) != bits(plain):
        ds_e2e.fail('the preload changed the losses of the saving run')
    tag_dir = os.path.join(work, 'ckpt', TAG)
    names = sorted(n for n in os.listdir(tag_dir) if n.endswith('.pt'))
    for name in names:
        with open(os.path.join(tag_dir, name), 'rb') as a, \
                open(os.path.join(work, 'ckpt_plain', TAG, name), 'rb') as b:
            if a.read() != b.read():
                ds_e2e.fail(f'{name} saved under the preload differs from the plain save')
    index_path = os.path.join(tag_dir, '.ucp', 'index.json')
    if not os.path.isfile(index_path):
        ds_e2e.fail(f'no committed index {index_path}; ucp logs:\n'
                    f'{ds_e2e.log_tail(os.path.join(work, "logs_save"))}')
    with open(index_path) as f:
        index = json.load(f)
    if index['adapter']['name'] != 'deepspeed-zero12' or \
            index['adapter_state'].get('elastic_checkpoint') is not True:
        ds_e2e.fail(f'index adapter {index["adapter"]}, adapter_state {index["adapter_state"]}')
    print(f'elastic tag indexed by {index["adapter"]["name"]}: {len(index["atoms"])} atoms')

    # 2. The oracle: the rigid form of the same run, through DeepSpeed's universal checkpoint.
    rigid = trained(args, env, work, 'save_rigid', SAVE_DP, DEEPSPEED_ADAM,
                    save + ['--save_dir', os.path.join(work, 'ckpt_rigid')])
    if bits(rigid) != bits(saved):
        ds_e2e.fail('the rigid and elastic saving runs differ in their losses')
    universal = os.path.join(work, 'universal')
    ds_e2e.ds_to_universal(env, os.path.join(work, 'ckpt_rigid', TAG), os.path.join(universal, TAG))
    oracle = trained(args, env, work, 'universal', RESUME_DP, DEEPSPEED_ADAM,
                     ['--load_dir', universal, '--load_tag', TAG, '--universal'])
    ds_e2e.print_losses(f'losses DP={RESUME_DP} universal (rigid save)', oracle)

    # 3. The plain resume at DP=2 under the preload, with either config.
    for name, config in (('resume_elastic', ELASTIC), ('resume_rigid_config', DEEPSPEED_ADAM)):
        got = trained(args, env, work, name, RESUME_DP, config,
                      ['--load_dir', os.path.join(work, 'ckpt')],
                      logs=os.path.join(work, 'logs_' + name))
        ds_e2e.print_losses(f'losses DP={RESUME_DP} {name}', got)
        if bits(got) != bits(oracle):
            ds_e2e.fail(f'{name}: losses differ from DeepSpeed\'s universal load')
    print(f'losses bit-identical to DeepSpeed\'s universal load at steps {SAVE_AT + 1}..{STEPS}, '
          'with the elastic and the rigid config')

    view = os.path.join(tag_dir, '.ucp', 'views', f'tp1-pp1-dp{RESUME_DP}')
    resharded = os.path.join(work, 'reshard')
    subprocess.run([args.ucp, 'reshard', tag_dir, '--to', f'dp={RESUME_DP}', '--out', resharded],
                   check=True, stdout=subprocess.DEVNULL)
    served = [OPTIM.format(r) for r in range(RESUME_DP)]
    for name in served + ['mp_rank_00_model_states.pt']:
        with open(os.path.join(view, 'served.' + name), 'rb') as a, \
                open(os.path.join(resharded, TAG, name), 'rb') as b:
            if a.read() != b.read():
                ds_e2e.fail(f'served {name} differs from `ucp reshard`\'s')
    probe = subprocess.run([sys.executable, '-c', FORM_PROBE, os.path.join(tag_dir, OPTIM.format(0))]
                           + [os.path.join(view, 'served.' + n) for n in served],
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        ds_e2e.fail(f'the form probe exited {probe.returncode}:\n{probe.stderr[-2000:]}')
    saved_form, *forms = json.loads(probe.stdout.strip().splitlines()[-1])
    # DeepSpeed's Adam on CPU counts in its states and leaves its param groups' step at 0,
    # which DeepSpeed saves: carried as saved.
    if not all(form['elastic'] and form['exp_avg'] == form['fp32'] and
               form['step'] == saved_form['step'] is not None for form in forms):
        ds_e2e.fail(f'served optimizer files are not elastic at DP={RESUME_DP}: {forms}')
    print(f'served files equal `ucp reshard --to dp={RESUME_DP}` and are elastic: {forms}')

    # DP=9 pads each group (2*9 does not divide it): the last rank's states leave the padding
    # out, and the ranks' states laid end to end are the saved ones.
    padded = os.path.join(work, 'reshard_dp9')
    subprocess.run([args.ucp, 'reshard', tag_dir, '--to', 'dp=9', '--out', padded], check=True,
                   stdout=subprocess.DEVNULL)
    probe = subprocess.run(
        [sys.executable, '-c', CONCAT_PROBE, str(SAVE_DP), tag_dir, os.path.join(padded, TAG)],
        env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        ds_e2e.fail(f'`ucp reshard --to dp=9` of the elastic tag:\n{probe.stderr[-2000:]}')
    print(probe.stdout.strip().splitlines()[-1])

    export = subprocess.run([args.ucp, 'export', tag_dir, '--format', 'deepspeed-universal',
                             '--out', os.path.join(work, 'export')], capture_output=True, text=True)
    if export.returncode == 0 or 'base_optimizer_state: an elastic checkpoint' not in export.stderr:
        ds_e2e.fail(f'`ucp export` of the elastic tag exited {export.returncode}:\n{export.stderr}')
    print('ucp export refuses it: ' + export.stderr.strip().splitlines()[-1])

    status, output, _ = train(args, env, work, 'refusal', RESUME_DP, ELASTIC,
                              ['--load_dir', os.path.join(work, 'ckpt')])
    if status == 0 or ds_e2e.DP_REFUSAL not in output:
        ds_e2e.fail(f'without the preload DeepSpeed exited {status}, expected its DP refusal:\n'
                    f'{output[-3000:]}')
    print('without the preload DeepSpeed refuses the resume at DP=2')
    return 0


if __name__ == '__main__':
    sys.exit(main())

#!/usr/bin/python3
"""Checks gen_ds_zero.py against real DeepSpeed saves: for each fixture model and configuration it
generates the same tag and requires every file to have the fixture's name, size, zip member list
(names and sizes) and byte-identical data.pkl (only the tensor bytes, seeded random, differ).
With DS_SRC set (a DeepSpeed v0.14.5 source folder), DeepSpeed's ds_to_universal.py must also
convert the generated z2_fp32_odd tag into the same files as the fixture's global_step5_universal.
Usage: check_gen.py [FIXTURES_DIR]  (default ../../../../shared/fixtures/deepspeed)
"""
import os
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
# (fixture config, gen_ds_zero.py flags)
CASES = [
    ('z2_fp32', ['--preset', 'tiny']),
    ('z2_fp32_odd', ['--preset', 'odd']),
    ('z2_bf16', ['--preset', 'tiny', '--dtype', 'bf16']),
    ('z1_fp32', ['--preset', 'tiny', '--stage', '1']),
    ('z1_fp32_odd', ['--preset', 'odd', '--stage', '1']),
    ('z1_bf16', ['--preset', 'tiny', '--stage', '1', '--dtype', 'bf16']),
]


def members(archive):
    """[(name, size)] with data.pkl's content in place of its size."""
    with zipfile.ZipFile(archive) as z:
        return [(i.filename, z.read(i) if i.filename.endswith('/data.pkl') else i.file_size)
                for i in z.infolist()]


def files_under(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)


def compare(generated, fixture):
    """Differences between two folders of torch.save files, as messages."""
    problems = []
    names = files_under(fixture)
    if files_under(generated) != names:
        return [f'files {files_under(generated)} != {names}']
    for name in names:
        a, b = os.path.join(generated, name), os.path.join(fixture, name)
        if os.path.getsize(a) != os.path.getsize(b):
            problems.append(f'{name}: size {os.path.getsize(a)} != {os.path.getsize(b)}')
        ma, mb = members(a), members(b)
        if [n for n, _ in ma] != [n for n, _ in mb]:
            problems.append(f'{name}: members {[n for n, _ in ma]} != {[n for n, _ in mb]}')
            continue
        for (member, va), (_, vb) in zip(ma, mb):
            if va != vb:
                problems.append(f'{name}: {member} differs')
    return problems


def ds_to_universal(tag, out):
    """Runs DeepSpeed's converter when DS_SRC names a DeepSpeed source folder; False when it doesn't."""
    ds_src = os.environ.get('DS_SRC')
    if not ds_src:
        return False
    tools = os.path.join(HERE, '..', '..', '..', '..', 'shared', 'tools', 'deepspeed-cpu')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ds_src, tools]), DS_ACCELERATOR='cpu')
    subprocess.run([sys.executable, os.path.join(ds_src, 'deepspeed', 'checkpoint', 'ds_to_universal.py'),
                    '--input_folder', tag, '--output_folder', out, '--inject_missing_state'], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return True


def main():
    fixtures = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, '..', '..', '..', '..', 'shared',
                                                                   'fixtures', 'deepspeed')
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for config, flags in CASES:
            out = os.path.join(tmp, config)
            subprocess.run([sys.executable, os.path.join(HERE, 'gen_ds_zero.py'), out] + flags, check=True,
                           stdout=subprocess.DEVNULL)
            problems = compare(os.path.join(out, 'global_step5'), os.path.join(fixtures, config, 'dp4',
                                                                                 'global_step5'))
            if not problems and config == 'z2_fp32_odd':
                universal = os.path.join(out, 'global_step5_universal')
                if ds_to_universal(os.path.join(out, 'global_step5'), universal):
                    problems = [f'ds_to_universal: {p}' for p in compare(
                        universal, os.path.join(fixtures, config, 'dp4', 'global_step5_universal'))]
                    config += ' (+ ds_to_universal of it)'
            failed += bool(problems)
            print(f'check_gen: {config}: ' + ('; '.join(problems) if problems else
                                             'same files, sizes, zip members and data.pkl bytes as DeepSpeed'))
    sys.exit(1 if failed else 0)


if __name__ == '__main__':
    main()

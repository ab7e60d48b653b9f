#!/usr/bin/env python3
"""launch.py's contract (../shared/tools/deepspeed-cpu/launch.py: NPROC copies of a script with
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT set; the
first nonzero exit status, the other ranks killed then), with the ranks forked from one process
that has imported what the script imports once, rather than each rank importing it.

Why: a tiny Hugging Face model's DeepSpeed run on this project's 2-core machines is mostly
imports (12.2 s of rank 0's 15.3 s in a 4-rank AutoEP save, profiled), and the DeepSpeed tests are
most of CI's time.

Only for runs without LD_PRELOAD: ucp's library starts in the process that loads it, and a
preloaded rank must be a process of its own, as the trainer's would be (ds_e2e.run_launcher
keeps launch.py for those). A rank forked here runs the script as `python script args` would:
sys.argv, sys.path[0] and __main__ are the script's.
Usage: fork_launch.py NPROC PORT script.py [args...]
"""
import ast
import importlib
import os
import runpy
import signal
import sys

# Imported at set-up by every DeepSpeed 0.19 ZeRO run, whatever its script imports: the engine's
# optimizer check imports the Muon optimizer, which imports torch's inductor (3.3 s of rank 0's
# 15.3 s in that profile).
ENGINE_IMPORTS = ('deepspeed.runtime.zero.muon.muon_optimizer',)


def script_imports(path, seen=None):
    """What `path` imports anywhere in its code (inside functions too: transformers' models are
    imported where the model is made), as (module, names from it), and the same of each module
    of its folder that it imports."""
    seen = set() if seen is None else seen
    if path in seen or not os.path.isfile(path):
        return []
    seen.add(path)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    here = os.path.dirname(os.path.abspath(path))
    for module, _ in list(found):
        found += script_imports(os.path.join(here, module.replace('.', '/') + '.py'), seen)
    return found


def preimport(script, rest):
    """Imports what the script (and a script named among its arguments: with_ds_config.py's)
    imports, from where the script would, so that the forked ranks find it imported; a module
    or name this interpreter lacks is left to the script, which fails on it as it would have."""
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    modules = []
    for path in [script] + [arg for arg in rest if arg.endswith('.py')]:
        modules += script_imports(path)
    for module, names in modules + [(name, ()) for name in ENGINE_IMPORTS]:
        try:
            imported = importlib.import_module(module)
            for name in names:
                getattr(imported, name, None)  # transformers imports a model's module lazily
        except Exception:  # noqa: BLE001 - whatever failed here fails in the script, named there
            pass


def run_rank(rank, world, port, script, rest):
    """In the forked child: rank `rank`'s environment, then the script as __main__. Never
    returns: the script's exit, or an exception it raises, ends the child as it would end
    `python script` (the status, the traceback, the atexit handlers)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR=os.environ.get('MASTER_ADDR', '127.0.0.1'), MASTER_PORT=port)
    sys.argv = [script] + rest
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name='__main__')
    sys.exit(0)


def main():
    world, port, script, rest = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    preimport(script, rest)
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, world, port, script, rest)
        children.append(pid)
    status = 0
    while children:
        pid, wait_status = os.wait()
        children.remove(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            for other in children:
                os.kill(other, signal.SIGKILL)
    sys.exit(status)


if __name__ == '__main__':
    main()

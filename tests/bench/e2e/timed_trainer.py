#!/usr/bin/env python3
"""Runs a trainer script unchanged in this process and times its steps and its saves.

Usage: timed_trainer.py KIND TIMINGS_DIR SCRIPT [trainer args...]
KIND names where the trainer's optimizer step and checkpoint save are, wrapped with a clock:
  deepspeed  DeepSpeedEngine.step and DeepSpeedEngine.save_checkpoint (any DeepSpeed trainer)
  standin    Engine.train_step and Engine.save_checkpoint of the plain-PyTorch stand-in
             (demo/zero_trainer.py)
SCRIPT is imported as a module and its main() called with sys.argv = [SCRIPT, trainer args...],
so the trainer runs exactly as when launched directly. Each rank (RANK) writes
TIMINGS_DIR/rank<RANK>.json at exit: "iterations" (from one step's return to the next's: "seconds"
of wall time, "cpu" seconds of this process, all its threads, and "saved": whether a save happened
in between) and "saves" (the same "seconds" and "cpu" of each save call).
"""
import atexit
import functools
import importlib.util
import json
import os
import sys
import time


class Clock:

    def __init__(self):
        self.last_step = None
        self.last_cpu = None
        self.saved = False
        self.iterations = []
        self.saves = []

    def wrap_step(self, step):

        @functools.wraps(step)
        def timed(*args, **kwargs):
            result = step(*args, **kwargs)
            now, cpu = time.perf_counter(), time.process_time()
            if self.last_step is not None:
                self.iterations.append({'seconds': now - self.last_step, 'cpu': cpu - self.last_cpu,
                                        'saved': self.saved})
            self.last_step, self.last_cpu, self.saved = now, cpu, False
            return result

        return timed

    def wrap_save(self, save):

        @functools.wraps(save)
        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.process_time()
            result = save(*args, **kwargs)
            self.saves.append({'seconds': time.perf_counter() - start, 'cpu': time.process_time() - cpu})
            self.saved = True
            return result

        return timed


def load_script(path):
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():
    kind, timings_dir, script = sys.argv[1:4]
    sys.argv = [script] + sys.argv[4:]
    clock = Clock()
    module = load_script(script)
    if kind == 'deepspeed':
        from deepspeed.runtime.engine import DeepSpeedEngine
        owner, step = DeepSpeedEngine, 'step'
    elif kind == 'standin':
        owner, step = module.Engine, 'train_step'
    else:
        raise SystemExit(f'timed_trainer.py: unknown trainer kind {kind}')
    setattr(owner, step, clock.wrap_step(getattr(owner, step)))
    owner.save_checkpoint = clock.wrap_save(owner.save_checkpoint)

    def write():
        os.makedirs(timings_dir, exist_ok=True)
        with open(os.path.join(timings_dir, f'rank{os.environ.get("RANK", "0")}.json'), 'w') as f:
            json.dump({'iterations': clock.iterations, 'saves': clock.saves}, f)

    atexit.register(write)
    module.main()


if __name__ == '__main__':
    main()

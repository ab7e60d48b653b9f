"""The training loop of this folder's PipelineModule trainers (train_pipe_tied.py,
train_moe_pipe.py, train_moe_3d.py), run from ../shared/tools/deepspeed-cpu: its train.py gives
the data."""
import json

import deepspeed.comm as dist
import train as T  # the shared trainer's fixed global batches (the caller put it on sys.path)


def train(engine, args, micro, gas, world, save=None):
    """Loads args.load_dir if given, then trains through args.steps: each step this rank's DP
    slice of train.py's global batch in `gas` micro batches of `micro`; saves tag
    global_step<N> to args.save_dir at each step of args.save_at (`save(N)` where given), and
    before any step where the loaded step is one (what the load gave). Rank 0 prints
    `STEP n loss x` and writes {"losses": {step: loss}} to args.out."""
    def save_step(step):
        if save is not None:
            save(step)
        else:
            engine.save_checkpoint(args.save_dir, tag=f'global_step{step}')
    dp_rank = engine.grid.get_data_parallel_rank()
    rank = dist.get_rank()
    start = 0
    if args.load_dir:
        engine.load_checkpoint(args.load_dir)
        start = engine.global_steps
        if args.save_dir and start in args.save_at:
            save_step(start)
    losses = {}
    per = micro * gas
    for step in range(start + 1, args.steps + 1):
        x, y = T.global_batch(step, args.vocab, args.seq)
        xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        batches = iter([(xs[i * micro:(i + 1) * micro], ys[i * micro:(i + 1) * micro])
                        for i in range(gas)])
        losses[step] = float(engine.train_batch(data_iter=batches))
        if rank == 0:
            print(f'STEP {step} loss {losses[step]:.8f}', flush=True)
        if args.save_dir and step in args.save_at:
            save_step(step)
    if rank == 0 and args.out:
        with open(args.out, 'w') as f:
            json.dump({'args': vars(args), 'world': world, 'losses': losses}, f, indent=1)
    dist.barrier()

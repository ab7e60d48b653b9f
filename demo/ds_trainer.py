#!/usr/bin/env python3
"""The demo's training run on real DeepSpeed (ZeRO-2, fp32, CPU with gloo).

Same model, data, options and output as zero_trainer.py (its stand-in), but the engine, the
checkpoints and the refusal to resume at another data-parallel size are DeepSpeed's own. It knows
nothing about ucp. DeepSpeed must be importable: demo/run.sh runs it with the project's virtual
environment (the release pinned in tools/requirements.txt on torch 2.x, DS_ACCELERATOR=cpu). On
CPU the optional shared-memory comm op (it would compile C++) is marked incompatible and the
optimizer is torch.optim.Adam. torch 2.x's gloo has every collective DeepSpeed uses; under torch
1.x (DeepSpeed v0.14.5 on Debian's torch 1.13) it also works around that gloo at run time, without
touching DeepSpeed: DeepSpeed's *_into_tensor collectives are replaced by its list-based
fallbacks, and the missing reduce_scatter is emulated with one all_reduce.

Launch one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (launch.py).
"""
import json

import torch
import torch.distributed as tdist

import deepspeed
import deepspeed.comm as dist
import deepspeed.comm.comm as dscomm
import deepspeed.ops

from tinygpt import TinyGPT, argument_parser, global_batch


def emulate_reduce_scatter():
    """gloo in torch 1.13 has no reduce_scatter: all_reduce the concatenation, keep our chunk."""

    class _Done:

        def wait(self, *args, **kwargs):
            return True

        def is_completed(self):
            return True

    def reduce_scatter(output, input_list, op=tdist.ReduceOp.SUM, group=None, async_op=False):
        flat = torch.cat([t.reshape(-1) for t in input_list])
        tdist.all_reduce(flat, op=op, group=group)
        start = sum(t.numel() for t in input_list[:tdist.get_rank(group)])
        output.copy_(flat[start:start + output.numel()].view_as(output))
        return _Done() if async_op else None

    tdist.reduce_scatter = reduce_scatter


def main():
    args = argument_parser(__doc__.split("\n")[0]).parse_args()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    old_gloo = int(torch.__version__.split(".", 1)[0]) < 2
    if old_gloo:
        emulate_reduce_scatter()
    deepspeed.init_distributed(dist_backend="gloo")
    if old_gloo:
        dscomm.cdb.all_gather_function = None
        dscomm.cdb.reduce_scatter_function = None
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.global_bs % world == 0, f"--global_bs {args.global_bs} is not divisible by {world}"
    micro = args.global_bs // world
    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.d, args.nlayer, args.nhead, args.seq)
    config = {
        "train_batch_size": args.global_bs,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0,
                       "torch_adam": True, "adam_w_mode": False},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": False},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)

    if args.load_dir:
        load_path, _ = engine.load_checkpoint(args.load_dir, tag=args.load_tag)
        if rank == 0:
            print(f"LOADED {load_path} global_steps={engine.global_steps} at {world} ranks",
                  flush=True)
        if args.dump_state:
            opt = engine.optimizer
            fp32 = opt.single_partition_of_fp32_groups[0]
            state = opt.optimizer.state[fp32]
            torch.save({
                "fp32_partition": fp32.detach().clone(),
                "exp_avg": state["exp_avg"].clone(),
                "exp_avg_sq": state["exp_avg_sq"].clone(),
                "step": state["step"].clone(),
                "flat_params": opt.bit16_groups_flat[0].clone(),
                "global_steps": engine.global_steps,
            }, args.dump_state.format(rank=rank))

    losses = {}
    for step in range(engine.global_steps + 1, args.steps + 1):
        x, y = global_batch(step, args.global_bs, args.vocab, args.seq)
        mine = slice(rank * micro, (rank + 1) * micro)
        loss = engine(x[mine], y[mine])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses[step] = (mean / world).item()
        if rank == 0:
            print(f"STEP {step} loss {losses[step]:.8f}", flush=True)
        if args.save_dir and step in args.save_at:
            engine.save_checkpoint(args.save_dir, tag=f"global_step{step}",
                                   client_state={"my_step": step})
            if rank == 0:
                print(f"SAVED {args.save_dir}/global_step{step}", flush=True)

    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"trainer": "DeepSpeed " + deepspeed.__version__, "world": world,
                       "losses": losses}, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()

"""`python -m megatron_mecefo.preflight`: is this node fit to start the job? Checked first.

    python -m megatron_mecefo.preflight --nproc-per-node 8 --world-size 32 -- <mecefo-train args>

`launch/slurm/pretrain.sbatch` runs it once per node (inside the container, if any), so that a
mistake costs seconds, not an allocation of GPUs waiting on a rendezvous that cannot form:
- the run config validates (`mecefo-train --dry-run`), with the job's world size: a fixed
  `training.global_batch_size` must divide over the job's DP size;
- the devices the config needs are there: `parallel.backend` nccl (or auto) needs one visible GPU
  per rank of the node; only `parallel.backend=gloo` trains without GPUs;
- every GPU of the node passes the health check (`failover/liveness/gpu_health.py`).
Each problem is one `error: ...` line (config errors from node 0 only: every node would print the
same). Exit codes (errors.ExitCode): 0 fit, 2 CONFIG_ERROR (config, or no/too few GPUs for it),
3 DATA_ERROR (a data file missing: checked here even where a plain dry run would not),
4 DISTRIBUTED_ERROR (a world that does not divide into TP x PP, an unhealthy GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import sys

from megatron_mecefo.errors import ExitCode, MecefoError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_mecefo.preflight", description=__doc__)
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks on this node")
    p.add_argument("--world-size", type=int, required=True, help="ranks in the job")
    p.add_argument("--node", type=int, default=int(os.environ.get("SLURM_PROCID", 0)))
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then mecefo-train args")
    args = p.parse_args(argv)
    if args.trainer_args and args.trainer_args[0] == "--":
        args.trainer_args = args.trainer_args[1:]
    return args


def check_config(args: argparse.Namespace):
    """(config, None) or (None, (exit code, message)) after a full dry run at the job's size."""
    from megatron_mecefo import train
    from megatron_mecefo.config.batch import resolve_global_batch
    from megatron_mecefo.config.cli import load_run_config, parse_args
    from megatron_mecefo.data.pipeline import check_paths

    os.environ["WORLD_SIZE"] = str(args.world_size)  # the dry run resolves the global batch
    try:
        trainer = parse_args([*args.trainer_args, "--dry-run"])
        check_paths(load_run_config(trainer).data)  # a dry run alone skips data not there yet
        with contextlib.redirect_stdout(io.StringIO()):  # the resolved YAML is not wanted here
            train.run(trainer)
        cfg = resolve_global_batch(load_run_config(trainer), args.world_size)
    except MecefoError as exc:
        return None, (int(exc.exit_code), str(exc))
    return cfg, None


def check_devices(cfg, nproc: int) -> tuple[int, str] | None:
    """None when this node has what the config needs, else (exit code, message)."""
    from megatron_mecefo.failover.liveness import gpu_health as health

    backend = cfg.parallel.backend
    if backend == "gloo":
        return None
    import torch

    visible = torch.cuda.device_count()
    where = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}"
    if visible == 0:
        return int(ExitCode.CONFIG_ERROR), (
            f"no GPU visible ({where}); parallel.backend={backend} trains over NCCL, one GPU per "
            "rank: submit to GPU nodes (sbatch --gpus-per-node=N) or set parallel.backend=gloo "
            "to train on CPUs"
        )
    if visible < nproc:
        return int(ExitCode.CONFIG_ERROR), (
            f"{visible} GPU(s) visible ({where}) for {nproc} ranks per node "
            "(MECEFO_NPROC_PER_NODE): each rank needs its own GPU"
        )
    for local_rank in range(nproc):
        bad = health.check_gpu(health.device_id(local_rank))
        if bad is not None:
            return int(ExitCode.DISTRIBUTED_ERROR), f"GPU of local rank {local_rank}: {bad}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    who = f"node {args.node} ({socket.gethostname()})"
    cfg, problem = check_config(args)
    if problem is None:
        problem = check_devices(cfg, args.nproc_per_node)
    elif args.node != 0:
        return problem[0]  # node 0 prints the config error once
    if problem is not None:
        print(f"error: preflight on {who}: {problem[1]}", file=sys.stderr, flush=True)
        return problem[0]
    print(f"preflight on {who}: ok ({args.nproc_per_node} ranks, {cfg.parallel.backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A fixed global batch whatever the node count: `training.global_batch_size` -> micro-batches.

A run config that sets `training.global_batch_size` keeps the same optimisation trajectory on 1 or
4 nodes: at start-up, once the world size is known, `num_microbatches` becomes
`global_batch_size / (micro_batch_size x DP size)`; a layout that does not divide it is a
`ConfigError` naming the numbers. Pure (no torch); `mecefo-train` applies it before anything is
built (its dry run too, with the world size of the launch when WORLD_SIZE is set).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.mcore.config import check_layout


def dp_size(cfg: Any, world_size: int) -> int:
    """Data-parallel size of `world_size` ranks under the config's TP x PP layout.

    Raises:
        DistributedSetupError: the world does not divide into TP x PP (exit 4, a layout the job
            cannot run: launch/README.md).
    """
    p = cfg.parallel
    check_layout(world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def resolve_global_batch(cfg: Any, world_size: int) -> Any:
    """`cfg` with `training.num_microbatches` derived from `training.global_batch_size` for
    `world_size` ranks (unchanged when no global batch size is set)."""
    t = cfg.training
    if t.global_batch_size is None:
        return cfg
    dp = dp_size(cfg, world_size)
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        fits = sorted(
            {d for d in range(1, dp + 1) if t.global_batch_size % (t.micro_batch_size * d) == 0}
        )
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"micro_batch_size x DP size = {t.micro_batch_size} x {dp} = {per_step} "
            f"({world_size} ranks); change the global or micro batch size, or use a DP size "
            f"in {fits}"
        )
    micro = t.global_batch_size // per_step
    return dataclasses.replace(cfg, training=dataclasses.replace(t, num_microbatches=micro))


def world_size_from_env(cfg: Any, environ: Mapping[str, str] = os.environ) -> int:
    """WORLD_SIZE as set by torchrun / mecefo-launch (or the preflight), else MECEFO_DRY_RUN_WORLD
    (launch/local/run.sh's dry run: the world it is about to launch); neither (a single process, a
    dry run on a login node): one replica, TP x PP ranks."""
    raw = environ.get("WORLD_SIZE") or environ.get("MECEFO_DRY_RUN_WORLD")
    if raw is None:
        p = cfg.parallel
        return p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={raw!r} is not an integer") from None

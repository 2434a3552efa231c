"""Which state a starting job may load: every rank resolves the same `StateIdentity` before
recovery, from the run directory's `identity.json` and `checkpoint.resume` (DESIGN.md section 9).

`auto` continues the run directory's identity, `never` starts a new run, a checkpoint folder
starts a new line branching from that checkpoint's line at its step. How the ranks agree on one
proposal is passed in (`share_over_store` under failover, else
`mcore.collectives.share_over_default_group`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from megatron_mecefo.checkpoint import layout
from megatron_mecefo.control import keys
from megatron_mecefo.training.identity import (
    StateIdentity,
    config_hash,
    read_file,
    trajectory_config,
)


def resolve(
    cfg: Any,
    *,
    dp_size: int,
    share: Callable[[str], str] = lambda proposal: proposal,
    resume: str | None = None,
) -> StateIdentity:
    """This job's identity; every rank calls this, in order, before recovery.

    `resume` (default `cfg.checkpoint.resume`): `auto` continues the run directory's identity
    (a new run if it has none), `never` starts a new run, a checkpoint folder starts a new line
    branching from that checkpoint's line at its step. `share(proposal)` returns the proposal
    every rank agrees on (the first one made: store compare-set or a broadcast from rank 0).
    """
    resume = cfg.checkpoint.resume if resume is None else resume
    config = trajectory_config(cfg, dp_size)
    digest = config_hash(cfg, dp_size)
    saved = read_file(cfg.run_dir)
    if resume == "never" or saved is None and resume == "auto":
        proposal = StateIdentity.fresh(digest, config)
    else:
        base = (
            StateIdentity(saved["run_id"], digest, tuple(saved["lineage"]), config)
            if saved
            else None
        )
        if resume == "auto":
            proposal = base
        else:  # a branch; a folder that is not a checkpoint fails in the recovery order
            base = base or StateIdentity.fresh(digest, config)
            marker = layout.read_marker(resume)
            parent = tuple((marker or {}).get("identity", {}).get("lineage", ()))
            proposal = base.branch(parent, int((marker or {}).get("next_step", 0)))
    agreed = json.loads(share(json.dumps(proposal.to_dict())))
    return dataclasses.replace(StateIdentity.from_dict(agreed), config=config)


def share_over_store(store) -> Callable[[str], str]:
    """First proposal wins, for every trainer of the launch (restarted ones included)."""
    return lambda proposal: store.compare_set(keys.IDENTITY, "", proposal).decode()

"""Timeout profiles of the launcher side (coordinator and node agents), as environment defaults.

The flags' own defaults (`local`) are tuned for one machine with a few cores: fast detection,
tiny models. A cluster (`cluster`) has large models whose steps, checkpoints, compiles and
first NCCL set-ups take minutes, and busy head nodes: its figures follow NVIDIA's resiliency
extension (NVRx): in-process restart soft/hard timeouts 60/90 s with a 30 s heartbeat timeout,
ft_launcher's 5 s check interval and safety factor 5 on measured step times, Megatron's section
timeouts (setup 900 s, step 120 s, out-of-section 180 s), plus a restart backoff. The trainer side
of the same profile is the `failover: cluster` preset (configs/failover/cluster.yaml).

    eval "$(python -m megatron_mecefo.config.timeouts cluster)"   # export the profile's defaults

`launch/slurm/pretrain.sbatch` exports the cluster profile (unless MECEFO_TIMEOUT_PROFILE=local);
a test checks that its block equals `PROFILES["cluster"]`. A variable already set always wins.
"""

from __future__ import annotations

import sys

PROFILES: dict[str, dict[str, str]] = {
    "local": {},
    "cluster": {
        # soft: silence after which a rank whose agent sees it stopped or gone is dead
        # (a process exit is seen at once anyway); NVRx heartbeat_timeout 30 s
        "MECEFO_HEARTBEAT_TIMEOUT_S": "30",
        # hard: a silent rank its agent still sees running (starved, swapping); NVRx hard 90 s
        "MECEFO_HEARTBEAT_HARD_TIMEOUT_S": "90",
        # an agent silent this long means its node is lost (its ranks go to a standby)
        "MECEFO_AGENT_TIMEOUT_S": "60",
        # hang = no step progress for max(floor, factor x step time); Megatron's out-of-section
        # 180 s, NVRx's safety factor 5
        "MECEFO_HANG_TIMEOUT_FLOOR_S": "180",
        "MECEFO_HANG_TIMEOUT_FACTOR": "5",
        # simultaneous failures (a node's 8 ranks) land in one decision
        "MECEFO_GRACE_S": "2",
        # every rank registers within this (imports, CUDA init); Megatron setup section 900 s
        "MECEFO_START_TIMEOUT_S": "900",
        # restart a dead rank after 5 s, doubling on each quick death up to 5 minutes
        "MECEFO_RESTART_DELAY_S": "5",
        "MECEFO_RESTART_BACKOFF": "2",
        "MECEFO_RESTART_BACKOFF_MAX_S": "300",
        "MECEFO_RESTART_BACKOFF_RESET_S": "1800",
        # the batch script's wait for the coordinator to listen
        "MECEFO_COORDINATOR_WAIT_S": "300",
    },
}


def exports(profile: str) -> str:
    """Shell lines exporting `profile`'s defaults without overriding variables already set."""
    if profile not in PROFILES:
        raise KeyError(f"unknown timeout profile {profile!r} (known: {', '.join(PROFILES)})")
    return "".join(f'export {k}="${{{k}:-{v}}}"\n' for k, v in PROFILES[profile].items())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in PROFILES:
        print(
            f"usage: python -m megatron_mecefo.config.timeouts {{{'|'.join(PROFILES)}}}",
            file=sys.stderr,
        )
        return 2
    print(exports(args[0]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

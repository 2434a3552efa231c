"""The chaos soak: random fault schedules (`schedule`), run against real jobs (`run`), judged by
the failover invariants (`checks`). Test tooling: nothing in `megatron_mecefo` imports it."""

"""The degraded-mode benchmarks' rank: one real training step of a world-1 job running a scenario's
task list as its plan, timed, and its activation memory in either mode.

Imported by the `degraded_*` benchmark modules of `degraded.py`, which puts `tools/bench` and the
repository on `sys.path`."""

from __future__ import annotations

from bench_common import fastest_of_rounds, sync, timed_train_step


class EngineRank:
    """One rank's real training step: `Engine.train_step` (megatron schedule, DDP main_grad
    accumulation, megatron AdamW) on a world-1 job, running a scenario's task list as its plan."""

    def __init__(self, name: str, args, ctx, hooked: bool = True, overrides: tuple = ()):
        from bench_engine import build_bench_engine

        overrides = [f"mecefo.enabled={str(hooked).lower()}", *args.set, *overrides]
        if args.num_layers:
            overrides.append(f"model.num_layers={args.num_layers}")
        self.engine = build_bench_engine(
            ctx,
            name,
            demo_dir=args.demo_dir,
            micro_batch_size=args.mbs,
            num_microbatches=args.microbatches,
            max_steps=100000,
            overrides=overrides,
        )
        self.model = self.engine.model
        self.controller = self.engine.controller
        self.m = args.microbatches
        self.model_cfg = self.engine.cfg.model

    def step(self, degraded_flags: list, step: int = 0) -> float:
        """One optimizer step running these micro-batch modes (False: exact, True: degraded with
        the configured techniques, a DegradedTechniques: degraded with it); returns seconds."""
        from megatron_mecefo.plan.step_plan import MicroBatchTask

        def task(i: int, flag) -> MicroBatchTask:
            # micro-batches beyond M are another replica's, as in a takeover
            techniques = None if isinstance(flag, bool) else flag
            return MicroBatchTask(i // self.m, i % self.m, bool(flag), techniques)

        tasks = [task(i, flag) for i, flag in enumerate(degraded_flags)]
        replicas = -(-len(tasks) // self.m)
        return timed_train_step(
            self.engine, tasks, step, num_replicas=replicas, microbatches_per_replica=self.m
        )

    def peak_activation_bytes(self, degraded) -> int:
        """CPU: bytes autograd saves for one micro-batch; GPU: peak allocation above weights."""
        import torch

        from megatron_mecefo.mecefo.memory import saved_bytes_per_layer

        batch = self.engine.train_sampler.get(0, 0, 0)
        dev = self.engine.ctx.device
        args = (batch["tokens"].to(dev), batch["position_ids"].to(dev))
        techniques = None if isinstance(degraded, bool) else degraded
        self.controller.set_degraded(bool(degraded), techniques)
        try:
            if torch.cuda.is_available():
                sync()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                out = self.model(*args, None, labels=batch["labels"].to(dev))
                sync()
                peak = torch.cuda.max_memory_allocated() - base
                del out
                return int(peak)
            layers = list(self.model.decoder.layers)
            with saved_bytes_per_layer(layers) as saved:
                self.model(*args, None, labels=batch["labels"].to(dev))
            return sum(saved.values())
        finally:
            self.controller.set_degraded(False)


def timed_round_robin(rank: EngineRank, scenarios: dict, reps: int) -> dict:
    """Fastest of `reps` steps of `rank` per scenario (label -> micro-batch flags), interleaved
    round by round after a warm-up step of each (and the V refresh of bucket 0)."""
    return fastest_of_rounds(lambda flags, step: rank.step(flags, step=step), scenarios, reps)


def timed(rank: EngineRank, flags: list[bool], reps: int) -> float:
    """Fastest of `reps` steps after a warm-up step: on a shared CPU, interference only ever
    adds time."""
    return timed_round_robin(rank, {"": flags}, reps)[""]


def result_head(name: str, model_cfg, args, ctx) -> dict:
    """The fields a model's result starts with, in the takeover and skip-layer benchmarks."""
    return {
        "model": name,
        "config": vars(model_cfg),
        "device": str(ctx.device),
        "mbs": args.mbs,
        "microbatches": args.microbatches,
    }

"""Failure injection with real signals: a trainer kills, stops or breaks itself at a step.

`--inject KIND:RANK:STEP[:DOWN_STEPS]` (RANK is the global rank; STEP may be `rejoin`: the rank
fails when it is about to send or receive state for a rejoining replica) and `--failures FILE`
(the scenario schema of `sim/scenario.py`; a `dp_rank` there means every TP rank of that replica)
both become `InjectionSpec`s. Each fires once per job, at the start of its step, in whichever
incarnation of the rank reaches that step first. The `Injector` is a loop hook (`before_step`),
added only when a job has injections; the failover trainer calls its `at_rejoin` just before a
state transfer. Kinds:

  kill       SIGKILL itself (the agent restarts it after DOWN_STEPS steps, or its restart delay)
  hang       SIGSTOP itself: no heartbeats, no progress (the coordinator evicts it, the agent
             SIGKILLs and restarts it)
  exception  raise in the training step (the process exits 1; the agent restarts it)
  stall      the step never finishes but heartbeats go on (detected by the hang timeout)
  starve     not a failure: a C call holds the interpreter lock for STARVE_S seconds (as a
             native extension may), so the heartbeat thread is silent while the process lives;
             the rank must be judged slow, not dead
  nan        a silent numerical fault: the rank's outputs turn NaN (`training/anomaly.py`).
             `nan:RANK:STEP` poisons one attempt of STEP (transient); `nan:RANK:STEP:persistent`
             every attempt from STEP on (a faulty device); `nan:RANK:STEP:data` the micro-batches
             of RANK's replica at STEP, on whichever rank computes them (bad data)
  spike      the same three modes, but the micro-batches' losses (and so their gradients) are
             multiplied by `training/anomaly.SPIKE` instead: a loss spike, finite
  slow       a straggler: `slow:RANK:FACTOR:FROM` makes RANK compute FACTOR times slower from step
             FROM to the end: after its last backward, before it joins the reductions, it
             spends (FACTOR - 1) x its compute time so far (a busy loop on CPU, a sleep on GPU)
  bitflip    silent data corruption: at the start of STEP (after the previous update) flip one
             bit of one parameter on RANK (`BITFLIP_BIT` of its first element); caught by the
             state fingerprint in the commit vote. `bitflip:RANK:STEP:update` flips it inside
             STEP's update instead (after the optimizer, before the rank notes what its update
             produced): a fault in the computation, not at rest
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time

from megatron_mecefo.control import keys
from megatron_mecefo.errors import ConfigError
from megatron_mecefo.training.hooks import TrainHook

KINDS = ("kill", "hang", "exception", "stall", "starve", "nan", "spike", "slow", "bitflip")
BITFLIP_BIT = 20
"""The flipped bit of a 32-bit parameter (a mantissa bit: the value moves, it stays finite)."""
NAN_MODES = ("persistent", "data")
NUMERICAL = ("nan", "spike")
"""Kinds that poison a rank's outputs (`NAN_MODES` apply to them)."""
STARVE_S = 8
AT_REJOIN = -1
"""`InjectionSpec.step` of a failure during a rejoin's state transfer."""
_SCENARIO_KINDS = {"kill": "kill", "hang": "hang", "crash": "exception"}


class InjectedFailure(RuntimeError):
    """Raised by an `exception` injection."""


@dataclasses.dataclass(frozen=True)
class InjectionSpec:
    kind: str
    rank: int
    """Global rank."""
    step: int
    """Step at whose start it fires, or AT_REJOIN."""
    down_steps: int | None = None
    """Steps until the agent restarts the rank (None: its restart delay)."""
    mode: str | None = None
    """`nan`/`spike`: None (one attempt), `persistent` or `data` (`NAN_MODES`); `bitflip`: None
    (at rest, before STEP) or `update` (inside STEP's update)."""
    factor: float | None = None
    """`slow` only: how many times slower the rank computes."""


def parse_inject(text: str) -> InjectionSpec:
    """`KIND:RANK:STEP[:DOWN_STEPS]` -> spec; a malformed value is a one-line ConfigError."""
    parts = text.split(":")
    usage = (
        f"--inject {text!r}: expected KIND:RANK:STEP[:DOWN_STEPS] with KIND in {KINDS}, "
        f"nan|spike:RANK:STEP[:{'|'.join(NAN_MODES)}], bitflip:RANK:STEP[:update] or "
        "slow:RANK:FACTOR:FROM"
    )
    if len(parts) not in (3, 4) or parts[0] not in KINDS:
        raise ConfigError(usage)
    if parts[0] == "slow":
        return _parse_slow(parts, usage)
    mode = None
    if parts[0] in NUMERICAL and len(parts) == 4:
        if parts[3] not in NAN_MODES:
            raise ConfigError(usage)
        mode = parts.pop()
    elif parts[0] == "bitflip" and len(parts) == 4 and parts[3] == "update":
        mode = parts.pop()
    if not all(p.isdigit() for p in parts[1:] if p != "rejoin"):  # int() would take " 1", "+1"
        raise ConfigError(f"{usage}; RANK, STEP and DOWN_STEPS are plain numbers")
    try:
        step = parts[2]
        nums = [int(parts[1]), AT_REJOIN if step == "rejoin" else int(step)]
        nums += [int(p) for p in parts[3:]]
    except ValueError:
        raise ConfigError(usage) from None
    if nums[0] < 0 or nums[1] < AT_REJOIN or (len(nums) == 3 and nums[2] < 1):
        raise ConfigError(f"{usage}; RANK and STEP must be >= 0 and DOWN_STEPS >= 1")
    if parts[0] in (*NUMERICAL, "bitflip") and nums[1] == AT_REJOIN:
        raise ConfigError(f"{usage}; a {parts[0]} injection needs a step number")
    down = nums[2] if len(nums) == 3 else None
    return InjectionSpec(parts[0], nums[0], nums[1], down, mode)


def _parse_slow(parts: list[str], usage: str) -> InjectionSpec:
    try:
        if len(parts) != 4 or not (parts[1].isdigit() and parts[3].isdigit()):
            raise ValueError
        factor = float(parts[2])
    except ValueError:
        raise ConfigError(usage) from None
    if not 1 < factor < 100:
        raise ConfigError(f"{usage}; FACTOR must be > 1 and < 100")
    return InjectionSpec("slow", int(parts[1]), int(parts[3]), factor=factor)


def from_scenario(path: str, tp_size: int) -> list[InjectionSpec]:
    """The injections of a `configs/failures/*.yaml` scenario, one spec per TP rank."""
    from megatron_mecefo.sim.scenario import load_scenario

    specs = []
    for inj in load_scenario(path).injections:
        if inj.kind not in _SCENARIO_KINDS:
            raise ConfigError(
                f"{path}: injection kind {inj.kind!r} cannot be injected into a real run "
                f"(supported: {', '.join(_SCENARIO_KINDS)})"
            )
        down = None if inj.rejoin_at is None else inj.rejoin_at - inj.step
        for t in range(tp_size):
            specs.append(
                InjectionSpec(_SCENARIO_KINDS[inj.kind], inj.dp_rank * tp_size + t, inj.step, down)
            )
    return specs


def check_ranks(specs: list[InjectionSpec], world_size: int) -> None:
    for s in specs:
        if s.rank >= world_size:
            raise ConfigError(
                f"--inject {s.kind}:{s.rank}:{s.step} targets rank {s.rank}, but the job has "
                f"{world_size} ranks (0..{world_size - 1})"
            )


def specs_of(inject: list[str] | None, failures: str | None, cfg, world_size: int | None):
    """Every injection of a command line, checked against the job: a malformed spec, a rank the
    job does not have (`world_size`, when known) or a step it never reaches is a ConfigError."""
    specs = [parse_inject(s) for s in inject or []]
    if failures:
        specs += from_scenario(failures, cfg.parallel.tensor_model_parallel_size)
    if world_size is not None:
        check_ranks(specs, world_size)
    check_steps(specs, cfg.training.max_steps)
    return specs


def check_steps(specs: list[InjectionSpec], max_steps: int) -> None:
    """An injection at a step the job never reaches would silently never fire."""
    for s in specs:
        if s.step >= max_steps:
            raise ConfigError(
                f"--inject {s.kind}:{s.rank}:{s.step} is at step {s.step}, but the job runs "
                f"steps 0..{max_steps - 1} (training.max_steps={max_steps})"
            )


class Injector(TrainHook):
    """Fires this rank's injections (each once per job, claimed through the store), and marks
    the bad data of every `nan|spike:...:data` injection on every rank (data is bad wherever it
    goes)."""

    def __init__(self, specs, store, rank: int, incarnation: int, replica_size: int = 1):
        self.specs = [s for s in specs if s.rank == rank and s.mode != "data"]
        self.data = [s for s in specs if s.mode == "data"]
        self.store = store
        self.rank = rank
        self.incarnation = incarnation
        self.replica_size = replica_size
        self._engine = None
        self._fired: set[InjectionSpec] = set()

    @staticmethod
    def wanted(specs, rank: int) -> bool:
        """Does `rank` need an injector for `specs`?"""
        return any(s.rank == rank or s.mode == "data" for s in specs)

    def before_step(self, engine, step: int) -> None:
        for spec in self.data:
            if spec.step == step:
                key = (step, spec.rank // self.replica_size)
                engine.anomaly.poison_data[key] = _poison_value(spec)
        self._engine = engine
        self.maybe_fire(step)

    def at_rejoin(self) -> None:
        self.maybe_fire(AT_REJOIN)

    def maybe_fire(self, step: int) -> None:
        """Fire the injection of `step` (a step number or AT_REJOIN), once per job."""
        for spec in self.specs:
            if spec.step != step:
                continue
            if spec in self._fired:  # a redo of the step in this process (nan)
                continue
            mine = str(self.incarnation)
            if (
                self.store.compare_set(keys.inject_claim(self.rank, step), "", mine).decode()
                != mine
            ):
                continue  # an earlier incarnation already fired it
            self._fired.add(spec)
            self._fire(spec, step)

    def _fire(self, spec: InjectionSpec, step: int) -> None:
        if spec.down_steps is not None:
            job_step = keys.get_int(self.store, keys.JOB_STEP, 0)
            back = max(step, job_step) + spec.down_steps
            self.store.set(keys.downtime(self.rank, self.incarnation), str(back))
        self.store.set(keys.injected(self.rank, self.incarnation), f"{spec.kind}:{time.time()}")
        when = "during a rejoin" if step == AT_REJOIN else f"at step {step}"
        print(f"[inject] rank {self.rank}: {spec.kind} {when}", flush=True)
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.kind == "exception":
            raise InjectedFailure(f"injected exception on rank {self.rank} at step {step}")
        elif spec.kind == "stall":
            while True:
                time.sleep(3600)
        elif spec.kind in NUMERICAL:
            guard = self._engine.anomaly
            guard.poison_value = _poison_value(spec)
            if spec.mode == "persistent":
                guard.poison_from = step
            else:
                guard.poison_attempts = 1
        elif spec.kind == "bitflip" and spec.mode == "update":
            engine = self._engine

            def flip_once() -> None:
                engine.after_update.remove(flip_once)
                flip_bit(engine)

            engine.after_update.append(flip_once)
        elif spec.kind == "bitflip":
            flip_bit(self._engine)
        elif spec.kind == "slow":
            self._engine.slow_factor = spec.factor
        elif spec.kind == "starve":
            import ctypes

            ctypes.PyDLL(None).sleep(STARVE_S)  # PyDLL: the GIL is held through the call


def _poison_value(spec: InjectionSpec) -> float:
    from megatron_mecefo.training.anomaly import SPIKE

    return SPIKE if spec.kind == "spike" else math.nan


def flip_bit(engine) -> None:
    """Flip `BITFLIP_BIT` of the first element of the model's first parameter, in place."""
    import torch

    param = next(p for p in engine.ddp.module.parameters() if p.numel())
    flat = param.data.view(-1)
    ints = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    ints[0] ^= 1 << min(BITFLIP_BIT, 8 * flat.element_size() - 2)

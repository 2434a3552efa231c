"""Collectives that give up when the membership moves on.

A collective on a generation's group that errors, or that is still running when the coordinator
publishes a generation without one of its members, is abandoned and its reason recorded; the step
then fails the commit vote instead of hanging. Collectives run on staging copies, so an abandoned
one never writes into live buffers later.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

_WAIT_SLICE = timedelta(milliseconds=20)

Lost = Callable[[], "str | None"]
"""() -> why the membership was lost (a newer generation dropped a member), or None."""

_SOURCE_PREFIX = re.compile(r"^\[[^\]\s]+\.(?:cc|cpp|h):\d+\]\s*")
_GLOO_BANNER = " This is typically caused by"
"""Where gloo's advice to a crashed peer's survivor starts (`... GLHF! ` and an emoji)."""


def brief_error(exc: BaseException) -> str:
    """A collective's error in a few words for a failover line: its first line, without the
    library's source location (`[.../pair.cc:553] `) and gloo's banner after the first sentence
    (`Connection closed by peer [127.0.0.1]:23938.`)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return _SOURCE_PREFIX.sub("", text).split(_GLOO_BANNER, 1)[0].strip()


class _ThreadWork:
    """`is_completed`/`wait` over a helper thread that waits on real work."""

    def __init__(self, done: threading.Event, errors: list[BaseException]):
        self._done, self._errors = done, errors

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        if self._errors:
            raise self._errors[0]


def wait_work(work, what: str, *, backend: str, lost: Lost, p2p: bool = False) -> str | None:
    """Poll an async collective; the reason it failed or was abandoned, or None if done.

    Gloo's send/recv work never reports `is_completed()`; with `p2p` a helper thread waits on it
    and we poll the thread instead.
    """
    if p2p:
        done = threading.Event()
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors.append(exc)
            done.set()

        threading.Thread(target=waiter, name="mecefo-p2p-wait", daemon=True).start()
        work = _ThreadWork(done, errors)
    if backend == "gloo" and not p2p:
        return _wait_gloo(work, what, lost)
    delay, last_check = 0.0, time.monotonic()
    while not work.is_completed():
        time.sleep(delay)
        delay = min(2 * delay or 5e-5, 1e-3)
        now = time.monotonic()
        if now - last_check > 0.02:
            last_check = now
            why = lost()
            if why is not None:
                return f"{what} abandoned: {why}"
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
        return f"{what} failed: {brief_error(exc)}"
    return None


def _wait_gloo(work, what: str, lost: Lost) -> str | None:
    """Gloo work honours `wait(timeout)` without breaking the collective: block in slices (woken
    the moment it completes), checking the membership between slices."""
    while True:
        try:
            work.wait(_WAIT_SLICE)
            return None
        except RuntimeError:
            if work.is_completed():  # finished meanwhile, or failed: ask it which
                try:
                    work.wait()
                    return None
                except RuntimeError as exc:
                    return f"{what} failed: {brief_error(exc)}"
        why = lost()
        if why is not None:
            return f"{what} abandoned: {why}"


class AbortableCollectives:
    """The live membership's collectives (`training.membership.Collectives`).

    Two things keep an abandoned gloo collective from lingering (its group's transport thread
    can spin on a dead peer's unread data until the collective times out, pytorch/gloo#246):
    - none is issued on a generation already lost (every member leaves that group anyway);
    - `timeout()` bounds each one (`CollectiveBound`); None means the group's own timeout.
    """

    def __init__(
        self,
        backend: str,
        lost: Lost,
        on_reduce: Callable[[], None],
        timeout: Callable[[], timedelta | None] = lambda: None,
    ):
        self.backend = backend
        self.lost = lost
        self.on_reduce = on_reduce
        self.timeout = timeout
        self.failed: str | None = None

    def reset(self) -> None:
        self.failed = None

    def _bounded(self, opts):
        """`opts` with this collective's timeout (`timeout()`), if it has one."""
        timeout = self.timeout()
        if timeout is not None:
            opts.timeout = timeout
        return opts

    def _skip(self, what: str) -> bool:
        why = self.lost()
        if why is None:
            return False
        self.failed = self.failed or f"{what} not issued: {why}"
        return True

    def all_reduce(self, tensor: torch.Tensor, group) -> bool:
        # issued even after a failure in this step (every member must run the same sequence of
        # collectives on the group, or a later one would pair with a different one elsewhere),
        # but not once a newer generation dropped a member: then nobody uses this group again
        self.on_reduce()
        if self._skip("all-reduce"):
            return False
        stage = tensor.clone()  # an abandoned collective may still write into its buffer later
        opts = self._bounded(dist.AllreduceOptions())
        opts.reduceOp = dist.ReduceOp.SUM
        error = wait_work(
            group.allreduce([stage], opts), "all-reduce", backend=self.backend, lost=self.lost
        )
        if error is not None:
            self.failed = self.failed or error
            return False
        tensor.copy_(stage)
        return True

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group) -> bool:
        # issued after a failure too, like all_reduce: the members' sequences must stay aligned
        if self._skip("all-gather"):
            return False
        stage = torch.empty_like(out)
        opts = self._bounded(c10d.AllgatherOptions())
        error = wait_work(
            group._allgather_base(stage, tensor.contiguous(), opts),
            "all-gather",
            backend=self.backend,
            lost=self.lost,
        )
        if error is not None:
            self.failed = self.failed or error
            return False
        out.copy_(stage)
        return True


class CollectiveBound:
    """The bound on one gloo collective of a generation's group: max(floor, factor x the slowest
    committed step so far), the coordinator's hang rule (`DetectorConfig`). A reduction that
    waits longer has a member that the coordinator declares hung anyway. None until a step was
    timed (the first step's compiles and set-up keep the group's own timeout), and for NCCL,
    whose superseded groups are aborted instead (`groups.retire_group`)."""

    def __init__(self, backend: str, floor_s: float, factor: float):
        self.enabled = backend == "gloo"
        self.floor_s, self.factor = floor_s, factor
        self.slowest_s = 0.0

    def step_took(self, seconds: float) -> None:
        self.slowest_s = max(self.slowest_s, seconds)

    def __call__(self) -> timedelta | None:
        if not self.enabled or self.slowest_s <= 0:
            return None
        return timedelta(seconds=max(self.floor_s, self.factor * self.slowest_s))

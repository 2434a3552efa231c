"""Invariant checks of a finished failover job, read from its run directory and from /proc.

Each check returns a list of violations (one line each, empty when it holds); none raises on a
malformed file (that is a violation too). Used by `tools/chaos/run.py` after every chaos schedule:
every step logged once, every (step, replica, micro-batch) committed once, replicas bitwise equal,
summary.json agreeing with the events and metrics, and no process or shared memory left behind.
Pure reading: it never signals or deletes anything (`kill_processes` is the one exception).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

from megatron_mecefo.metrics.summary import check_summary as product_check_summary
from megatron_mecefo.training.run_dir import committed_attempts, is_committed_row

TAG_ENV = "MECEFO_CHAOS_TAG"
"""Environment variable carrying a job's unique marker; every process of the job inherits it."""


def read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    """Rows of a JSON-lines file, and a violation per line that does not parse."""
    rows, bad = [], []
    if not path.exists():
        return rows, bad
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad.append(f"{path.name}:{n}: not JSON: {line[:80]!r}")
    return rows, bad


def check_metrics(run_dir: Path, max_steps: int, *, complete: bool = True) -> list[str]:
    """metrics.jsonl logs steps 0..max_steps-1, each exactly once (`complete=False`: a job that
    ended early; only no step twice and none out of range)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return ["metrics.jsonl is missing"]
    rows, out = read_jsonl(path)
    counts = Counter(r.get("step") for r in rows)
    dup = sorted(s for s, c in counts.items() if c > 1)
    missing = sorted(set(range(max_steps)) - set(counts))
    extra = sorted(s for s in counts if s not in range(max_steps))
    if dup:
        out.append(f"metrics: step(s) logged more than once: {_short(dup)}")
    if missing and complete:
        out.append(f"metrics: step(s) never logged: {_short(missing)}")
    if extra:
        out.append(f"metrics: step(s) outside 0..{max_steps - 1}: {_short(extra)}")
    return out


def committed_tasks(run_dir: Path, *, rolled_back: bool = False) -> tuple[Counter, list[str]]:
    """Count of every committed (step, source replica, micro-batch) in audit/tasks_rank*.jsonl.

    `rolled_back`: the job recovered in place after losing every replica (a `recovery` event),
    so it may redo steps it had committed before; in a rank's log, rows of an earlier
    incarnation with a step at or after the step its next incarnation starts from are dropped
    (the recovery discarded them). Without a rollback every row counts.

    Sample-granular takeover logs slices, [replica, micro, degraded, start, stop], with the row's
    `micro_batch_size`: a micro-batch counts c when each of its samples was committed c times
    (whole or in slices); uneven coverage is a problem line and counts as its most-covered
    sample."""
    counts: Counter = Counter()
    problems: list[str] = []
    per_sample: dict[tuple, Counter] = {}  # micro-batches with a slice: sample -> commits
    sizes: dict[tuple, int] = {}  # their micro-batch size
    files = sorted((Path(run_dir) / "audit").glob("tasks_rank*.jsonl"))
    attempts = committed_attempts(run_dir)  # rows are logged before the vote
    for path in files:
        rows, bad = read_jsonl(path)
        rows = [row for row in rows if is_committed_row(row, attempts)]
        problems += bad
        kept: list[dict] = []
        for row in rows:
            if rolled_back and kept and row.get("inc") != kept[-1].get("inc"):
                kept = [k for k in kept if k["step"] < row["step"]]
            kept.append(row)
        for row in kept:
            for task in row.get("tasks", []):
                key = (row["step"], task[0], task[1])
                if len(task) >= 5:  # a slice
                    per_sample.setdefault(key, Counter()).update(range(task[3], task[4]))
                    sizes[key] = int(row.get("micro_batch_size", task[4]))
                else:
                    counts[key] += 1
    for key, slices in per_sample.items():
        covered = [counts[key] + slices[j] for j in range(max(sizes[key], max(slices) + 1))]
        if min(covered) != max(covered):
            problems.append(f"audit: samples of {key} committed unevenly: {covered}")
        counts[key] = max(covered)
    return counts, problems


def went_back(events: list[dict]) -> bool:
    """The job went back to saved state: a `recovery` (every replica lost) or a `rollback`
    (every holder of an optimizer shard lost); the steps after it were redone
    (`committed_tasks(rolled_back=True)` counts them once from there)."""
    return any(e.get("type") in ("recovery", "rollback") for e in events)


def check_audit(
    run_dir: Path,
    max_steps: int,
    num_replicas: int,
    num_microbatches: int,
    *,
    rolled_back: bool = False,
    complete: bool = True,
    gaps: list[str] | None = None,
) -> list[str]:
    """Every (step, replica, micro-batch) of the job committed exactly once (`complete=False`:
    a job that ended early; only none twice and none unexpected).

    A rank logs its tasks before it votes, and metrics.jsonl names the (generation, attempt) that
    committed each step, so a rank killed after the verdict leaves no gap. Runs from before
    that logged after the update: there, a missing entry is a gap, not a violation, when
    metrics.jsonl shows that step with the full global batch (n x M micro-batches reduced), no
    attempt, and a failure within two steps; each gap is described in `gaps`."""
    if not (Path(run_dir) / "audit").is_dir():
        return ["audit/ is missing (run with failover.audit=true)"]
    counts, out = committed_tasks(run_dir, rolled_back=rolled_back)
    want = {
        (s, r, m)
        for s in range(max_steps)
        for r in range(num_replicas)
        for m in range(num_microbatches)
    }
    missing = sorted(want - set(counts))
    explained = _unlogged_commits(run_dir, missing, num_replicas * num_microbatches)
    if explained and gaps is not None:
        gaps += [f"audit gap: {_short(keys)} {why}" for why, keys in explained.items()]
    missing = [k for k in missing if not any(k in keys for keys in explained.values())]
    twice = sorted(k for k, c in counts.items() if c > 1)
    extra = sorted(set(counts) - want)
    if missing and complete:
        out.append(f"audit: {len(missing)} micro-batch(es) never committed: {_short(missing)}")
    if twice:
        out.append(f"audit: {len(twice)} micro-batch(es) committed more than once: {_short(twice)}")
    if extra:
        out.append(f"audit: {len(extra)} unexpected (step, replica, micro): {_short(extra)}")
    return out


def _unlogged_commits(run_dir: Path, missing: list, full: int) -> dict[str, list]:
    """The missing entries committed by the evidence of metrics and events, by explanation."""
    if not missing:
        return {}
    metrics, _ = read_jsonl(Path(run_dir) / "metrics.jsonl")
    events, _ = read_jsonl(Path(run_dir) / "events.jsonl")
    # a step whose row names its attempt was audited before the vote: nothing to excuse
    reduced = {m.get("step"): m.get("global_microbatches") for m in metrics if "attempt" not in m}
    failures = [e for e in events if e.get("type") == "failure"]
    out: dict[str, list] = {}
    for key in missing:
        step = key[0]
        after = [f for f in failures if step <= f.get("step", -1) <= step + 2]
        if reduced.get(step) == full and after:
            why = (
                f"committed (metrics: {full} of {full} micro-batches at step {step}) but never "
                f"logged: rank(s) {after[0].get('ranks')} failed at step {after[0].get('step')}"
            )
            out.setdefault(why, []).append(key)
    return out


def state_digests(run_dir: Path) -> tuple[dict[int, dict], list[str]]:
    out, bad = {}, []
    for path in sorted((Path(run_dir) / "audit").glob("state_rank*.json")):
        try:
            out[int(path.stem.removeprefix("state_rank"))] = json.loads(path.read_text())
        except (ValueError, json.JSONDecodeError):
            bad.append(f"{path.name}: unreadable")
    return out, bad


def check_digests(
    run_dir: Path, max_steps: int, *, replica_size: int = 1, required=(), num_shards: int = 0
) -> list[str]:
    """Each rank's final model/optimizer digests are equal across replicas, position by position
    (ranks r and r' hold the same (stage, TP rank) position iff r % replica_size ==
    r' % replica_size; replica_size = TP x PP), all at step `max_steps`; every rank in `required`
    (ranks of replicas that never failed) has one. Distributed optimizer (`num_shards` > 0,
    one shard per replica): at each position the ranks holding a shard agree on its digest, and
    every shard 0..num_shards-1 is held by a rank that wrote one."""
    digests, out = state_digests(run_dir)
    if not digests:
        return out + ["audit: no rank wrote a final state digest"]
    lacking = sorted(set(required) - set(digests))
    if lacking:
        out.append(f"audit: rank(s) {lacking} never failed but wrote no final state digest")
    late = {r: d.get("next_step") for r, d in digests.items() if d.get("next_step") != max_steps}
    if late:
        out.append(f"audit: final digests not at step {max_steps}: {late}")
    for position in range(replica_size):
        group = {r: d for r, d in digests.items() if r % replica_size == position}
        for part in ("model", "optimizer"):
            values = {d.get(part) for d in group.values()}
            if len(values) > 1:
                by = {r: str(d.get(part))[:12] for r, d in sorted(group.items())}
                out.append(f"audit: replicas' {part} states differ (position {position}): {by}")
        if num_shards:
            out += _check_shards(group, position, num_shards)
    return out


def _check_shards(group: dict[int, dict], position: int, num_shards: int) -> list[str]:
    """One position's ranks: the holders of each optimizer shard agree, and each is held."""
    out = []
    holders: dict[int, dict[int, str]] = {}
    for rank, d in sorted(group.items()):
        for shard, value in (d.get("shards") or {}).items():
            holders.setdefault(int(shard), {})[rank] = value
    for shard in range(num_shards):
        held = holders.get(shard, {})
        if not held and group:
            out.append(f"audit: optimizer shard {shard} (position {position}) held by no rank")
        elif len(set(held.values())) > 1:
            by = {r: str(v)[:12] for r, v in held.items()}
            out.append(
                f"audit: holders of optimizer shard {shard} differ (position {position}): {by}"
            )
    return out


def check_summary(run_dir: Path) -> list[str]:
    """summary.json agrees with events.jsonl and metrics.jsonl (`metrics.summary.check_summary`)."""
    return [f"summary: {v}" for v in product_check_summary(Path(run_dir))]


def check_exits(codes: dict[int, int | None], acceptable: dict[int, str]) -> list[str]:
    """Each surviving agent's exit code is acceptable for the schedule (`codes`: node -> code;
    None: it never exited)."""
    out = []
    for node, code in sorted(codes.items()):
        if code is None:
            out.append(f"exit: node {node}'s agent did not exit")
        elif code not in acceptable:
            out.append(
                f"exit: node {node}'s agent exited {_code_name(code)}; acceptable: "
                f"{', '.join(_code_name(c) for c in sorted(acceptable))}"
            )
    return out


def check_abort_reason(run_dir: Path, codes: dict[int, int | None]) -> list[str]:
    """An exit 8 must come with an `abort` event that says every replica was lost."""
    if 8 not in codes.values():
        return []
    events, _ = read_jsonl(Path(run_dir) / "events.jsonl")
    reasons = [e.get("detail", "") for e in events if e.get("type") == "abort"]
    if any("every replica" in r for r in reasons):
        return []
    return [f"exit: JOB_ABORTED (8) without an every-replica-lost abort event: {reasons}"]


@dataclasses.dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    cmdline: str


def tagged_processes(tag: str, proc_root: str = "/proc") -> list[Proc]:
    """Live processes whose environment holds TAG_ENV=tag (zombies have none: not listed)."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"{entry.path}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"{entry.path}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        found.append(Proc(int(entry.name), ppid, cmd))
    return found


def check_leftovers(procs: list[Proc]) -> list[str]:
    return [f"leftover process pid {p.pid} (parent {p.ppid}): {p.cmdline[:160]}" for p in procs]


def check_shm(folder: Path | None) -> list[str]:
    """The run's shared-memory snapshot folder is gone (after a finished job)."""
    if folder is None or not Path(folder).exists():
        return []
    files = [str(p.relative_to(folder)) for p in sorted(Path(folder).rglob("*"))][:6]
    return [f"leftover shared memory: {folder} ({files})"]


def kill_processes(procs: list[Proc]) -> None:
    """SIGKILL each listed process (by pid: they were found by their job's tag)."""
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _code_name(code: int) -> str:
    from megatron_mecefo.errors import ExitCode

    if code < 0:
        return f"{code} (signal {-code})"
    try:
        return f"{code} ({ExitCode(code).name})"
    except ValueError:
        return str(code)


def _short(items: list[Any], n: int = 8) -> str:
    head = ", ".join(map(str, items[:n]))
    return head + (f", ... ({len(items)} in all)" if len(items) > n else "")

"""The section of BENCHMARKS.md on the peers side by side (`tools/bench/peers.py`)."""

from __future__ import annotations

from typing import Any

from report_context import tool_section
from report_markdown import _f, _table


@tool_section("peers")
def section_peers(ctx: Any, doc: dict) -> list[str]:
    """The same job and fault schedule on every system (`docs/peers.md` says how each is set
    up and what each column means)."""
    s = doc.get("schedule") or {}
    out = [
        f"The same job on every system: the demo GPTModel, {s.get('replicas', '?')} data-parallel "
        f"replicas, {s.get('steps', '?')} steps; replica {s.get('kill_replica', '?')} SIGKILLed "
        f"at steps {s.get('kill_steps', '?')}, back {s.get('down_s', '?')} s later; "
        f"{_group_text(s)}. Goodput: samples in the final model per wall second; kill -> "
        "commit: from each kill to the next committed step (the group kill last); max dev: the "
        "largest |loss - torchrun's| at a step; group: the group kill's kill -> commit, the "
        "steps redone after it and the samples dropped from its step on (*: replica 1 was "
        "still down at that step, and its group was killed as the job went past it). "
        "`docs/peers.md` reads the table.",
        "",
    ]
    rows = []
    for name, c in (doc.get("columns") or {}).items():
        heal = [h for h in c.get("kill_to_next_commit_s") or [] if h is not None]
        mb = c.get("heal_bytes")
        rows.append(
            [
                name,
                _f(c.get("step_s") and 1000 * c["step_s"], ".1f"),
                _f(c.get("step_vs_torchrun"), ".2f"),
                _f(c.get("wall_s"), ".1f"),
                _f(c.get("goodput_samples_per_s"), ".1f"),
                ", ".join(f"{h:.2f}" for h in heal) or "n/a",
                str(c.get("steps_redone", "-")),
                str(c.get("samples_dropped", "-")),
                _f(mb and mb / 1e6, ".2f"),
                _f(c.get("val_loss"), ".4f"),
                _f(c.get("max_loss_dev"), ".4f"),
                _f(c.get("group_kill_to_commit_s"), ".2f")
                + ("*" if c.get("group_kill_held") is False else ""),
                str(_dash(c.get("group_steps_redone"))),
                str(_dash(c.get("group_samples_dropped"))),
            ]
        )
    out += _table(
        [
            "system",
            "step ms",
            "vs torchrun",
            "wall s",
            "goodput (samples/s)",
            "kill -> commit s",
            "redone",
            "dropped",
            "heal MB",
            "val loss",
            "max dev",
            "group: kill -> commit s",
            "group: redone",
            "group: dropped",
        ],
        rows,
    )
    return out + [""]


def _group_text(s: dict) -> str:
    step = s.get("group_kill_step")
    if step is None:
        return "no group kill"
    return f"at step {step} its whole group (launcher and trainer) SIGKILLed and launched anew"


def _dash(value):
    return "-" if value is None else value

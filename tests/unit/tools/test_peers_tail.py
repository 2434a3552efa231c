"""How the peers benchmark reads a run's metrics as they appear (`tools/bench/peers_group.py`,
`tail`): rows a run keeps across a recovery are history, not steps run again; a step run again
is."""

from __future__ import annotations

import json
import os

from tools.bench.peers_group import tail as _tail


def _row(step: int, took: float) -> str:
    return json.dumps({"step": step, "loss": 6.0 - step, "step_time_s": took}) + "\n"


def test_a_replaced_file_adds_only_the_rows_run_again(tmp_path):
    path, out, known = tmp_path / "metrics.jsonl", [], set()
    path.write_text(_row(0, 0.1) + _row(1, 0.1) + _row(2, 0.1))
    pos = _tail(path, (0, 0), 1.0, out, known)
    assert [r["step"] for r in out] == [0, 1, 2]
    # in-job recovery rewrites the file atomically (a new inode): rows 0-1 kept, step 2 redone
    tmp = tmp_path / "metrics.tmp"
    tmp.write_text(_row(0, 0.1) + _row(1, 0.1) + _row(2, 0.3) + _row(3, 0.1))
    os.replace(tmp, path)
    pos = _tail(path, pos, 2.0, out, known)
    assert [(r["step"], r["seen"]) for r in out] == [
        (0, 1.0),
        (1, 1.0),
        (2, 1.0),
        (2, 2.0),
        (3, 2.0),
    ]
    # rewritten in place (recovery keeps the rows before its state), caught half done: the
    # rows kept are read again, none is added twice
    kept = _row(0, 0.1) + _row(1, 0.1)
    with open(path, "r+") as fh:
        fh.truncate(0)
        fh.write(kept[: len(kept) - 5])  # the poll sees a partial last line
    pos = _tail(path, pos, 2.4, out, known)
    with open(path, "a") as fh:
        fh.write(kept[len(kept) - 5 :])
    pos = _tail(path, pos, 2.5, out, known)
    assert len(out) == 5
    with open(path, "a") as fh:
        fh.write(_row(1, 0.2))
    _tail(path, pos, 3.0, out, known)
    assert [(r["step"], r["seen"]) for r in out][-1] == (1, 3.0) and len(out) == 6

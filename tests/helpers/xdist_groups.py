"""One pytest-xdist worker per module reference run (`tests/conftest.py`).

A module-scoped fixture that trains a reference run (10-20 s each in CI) is built once per worker
that runs one of its tests: the clean-clone CI built six of them twice (about 65 s of work). The
tests of a module that use one of them get an `xdist_group`, so `--dist loadgroup` sends them to
one worker, which builds it once. `tests/unit/test_xdist_groups.py` runs a small suite on two
workers and fails if the grouping does not hold (pytest 9.2 silently broke it: pytest-xdist issue
1386).
"""

from __future__ import annotations

import pytest

SHARED_REFERENCES = ("failure_free", "reference", "rejoin_after_e0", "single", "straight")


def group_shared_references(items, names=SHARED_REFERENCES) -> None:
    """Mark each test that uses a module-scoped fixture named in `names` with an `xdist_group`
    per (module, fixture); a test that has a group already keeps it."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        used = sorted(n for n in names if n in defs and defs[n][-1].scope == "module")
        if used and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}::{used[0]}"))

"""The package's import rules (docs/failover.md, "The pieces"): imports point down a declared layer
order, never in a circle, and failover's mechanisms keep to their own homes. Read from the source
with `ast` (function-level imports count too: they tie modules together just the same)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_mecefo"

LAYERS: list[tuple[str, ...]] = [
    # foundations: errors, the config loader, every subsystem's config dataclass
    ("errors", "config.loader", "config.timeouts", "config.batch", "*.config", "plan.techniques"),
    # the store protocol, megatron's adapter, kernels, simulator, metrics: no training logic
    ("control", "mcore", "kernels", "sim", "metrics"),
    ("data", "mecefo", "plan", "optim"),
    ("training",),  # the engine, the loop, the membership, the state and its identity
    ("checkpoint", "snapshot", "testing"),  # hooks on the training loop
    ("training.session", "precheck"),  # one set-up path, and the check before it
    ("failover",),
    ("train", "warm_spare", "preflight"),  # entry points
]
"""Lowest first. A module may import its own layer or a lower one (`*.config`: any subsystem's
config module). The run config and the trainer's command line compose every sub-config, so they
sit outside the order (`EXEMPT`)."""
EXEMPT = ("config.run", "config.cli")

FAILOVER_HOMES = ("liveness", "authority", "trainer", "node")
"""Subpackages of `failover/`: `liveness` is below the other three, which never import each other
(the authority, the trainers and the agents meet only in the store)."""


def _modules() -> tuple[dict[str, Path], set[str]]:
    """Module name -> file, and the names that are packages (their `__init__`)."""
    out, packages = {}, set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            packages.add(".".join(parts))
        out[".".join(parts)] = path
    return out, packages


def _imports(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if not name.startswith("megatron_mecefo."):
                continue
            name = name.removeprefix("megatron_mecefo.")
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports. A package's `__init__` only re-exports: importing from
    it counts as importing what it re-exports, and it is not a node itself."""
    mods, packages = _modules()
    raw = {m: _imports(p, set(mods)) - {m} for m, p in mods.items() if m}

    def through(targets: set[str], seen: frozenset = frozenset()) -> set[str]:
        out = set()
        for t in targets:
            if t in packages and t not in seen:
                out |= through(raw.get(t, set()), seen | {t})
            elif t not in packages:
                out.add(t)
        return out

    return {m: through(t) - {m} for m, t in raw.items() if m not in packages}


def layer_of(module: str) -> int | None:
    """The layer of the longest matching entry (None: exempt, or a package's `__init__`)."""
    if module in EXEMPT:
        return None
    best, best_len = None, -1
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if entry.startswith("*."):
                hit = module.endswith(entry[1:]) or module == entry[2:]
            else:
                hit = module == entry or module.startswith(entry + ".")
            if hit and len(entry) > best_len:
                best, best_len = i, len(entry)
    return best


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for src, targets in sorted(edges.items()):
        low = layer_of(src)
        for dst in sorted(targets):
            high = layer_of(dst)
            if low is not None and high is not None and high > low:
                out.append(f"{src} (layer {low}) imports {dst} (layer {high})")
    return out


def crossed_homes(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for src, targets in sorted(edges.items()):
        if not src.startswith("failover."):
            continue
        home = src.split(".")[1]
        for dst in sorted(targets):
            other = dst.split(".")[1] if dst.startswith("failover.") else None
            crossing = other in FAILOVER_HOMES and other not in (home, "liveness")
            if home in FAILOVER_HOMES and crossing:
                out.append(f"{src} imports {dst}")
    return out


def test_every_module_has_a_layer():
    unplaced = [m for m in graph() if layer_of(m) is None and m not in EXEMPT and "." in m]
    assert unplaced == []


def test_no_import_runs_upward():
    assert upward_imports(graph()) == []


def test_failover_mechanisms_keep_to_their_homes():
    assert crossed_homes(graph()) == []


def test_no_import_cycle():
    edges = graph()
    try:
        list(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {exc.args[1]}")


def test_the_rules_catch_what_they_forbid():
    """Each rule fails on a planted violation."""
    edges = graph()
    edges["control.keys"] = edges["control.keys"] | {"failover.trainer.manager"}
    assert upward_imports(edges) == [
        "control.keys (layer 1) imports failover.trainer.manager (layer 6)"
    ]
    edges["failover.node.agent"] = edges["failover.node.agent"] | {"failover.trainer.plane"}
    edges["failover.liveness.detector"] |= {"failover.authority.coordinator"}
    assert len(crossed_homes(edges)) == 2
    edges["training.engine"] = edges["training.engine"] | {"training.loop"}
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(edges).static_order())

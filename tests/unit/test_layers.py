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
    ("errors",),
    # the store protocol, megatron's adapter, kernels, metrics, the pure planner: no training logic
    ("control", "mcore", "kernels", "metrics", "plan"),
    ("data", "mecefo", "optim"),  # data pipeline, degraded-mode compute, the optimizer
    # the loader and `RunConfig`, which composes the configs of the folders below (each beside its
    # code) and holds those of the folders above (config/training.py, checkpoint, snapshot, ...)
    ("config",),
    ("training", "sim"),  # the engine, loop, membership, state, identity; the simulator
    ("checkpoint", "snapshot", "testing"),  # hooks on the training loop
    ("precheck",),  # the checks before a run starts
    ("failover", "session"),  # a `RunControl` each: failover's, and the session that runs one
    ("train", "warm_spare", "preflight", "job_outcome"),  # entry points
]
"""Lowest first, by folder (or top-level module) of the package: a module may import its own folder,
another folder of its layer, or a lower layer; no exemption. Two folders never import each other."""

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


def folder_of(module: str) -> str:
    return module.split(".")[0]


def layer_of(module: str) -> int | None:
    """The layer of the module's folder (None: a folder no layer names)."""
    folder = folder_of(module)
    return next((i for i, entries in enumerate(LAYERS) if folder in entries), None)


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


def mutual_folders(edges: dict[str, set[str]]) -> list[str]:
    """Folders that import each other (a cycle between folders, even where modules do not)."""
    pairs = {(folder_of(s), folder_of(d)) for s, ds in edges.items() for d in ds}
    return sorted(f"{a} <-> {b}" for a, b in pairs if a < b and (b, a) in pairs)


def test_every_module_has_a_layer():
    unplaced = [m for m in graph() if layer_of(m) is None]
    assert unplaced == []


def test_no_two_folders_import_each_other():
    assert mutual_folders(graph()) == []


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
    edges["config.run"] = edges["config.run"] | {"training.engine"}
    assert upward_imports(edges) == [
        "config.run (layer 3) imports training.engine (layer 4)",
        "control.keys (layer 1) imports failover.trainer.manager (layer 7)",
    ]
    edges = graph()  # mecefo <-> plan, as before DegradedTechniques had one home
    edges["plan.from_config"] = edges["plan.from_config"] | {"mecefo.config"}
    assert mutual_folders(edges) == ["mecefo <-> plan"]
    edges = graph()
    edges["failover.node.agent"] = edges["failover.node.agent"] | {"failover.trainer.plane"}
    edges["failover.liveness.detector"] |= {"failover.authority.coordinator"}
    assert len(crossed_homes(edges)) == 2
    edges["training.engine"] = edges["training.engine"] | {"training.loop"}
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(edges).static_order())

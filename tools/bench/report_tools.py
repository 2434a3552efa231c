"""The benchmark report's tools: what each runs (`TOOLS`), running them with a manifest entry
(run id, SHA-256 of the JSON written, machine), and reading their JSONs back defensively."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIM = ("-m", "megatron_mecefo.sim.cli")
STRATEGIES = "ckpt,snapshot,mecefo:neighbor,mecefo:spread,mecefo:hybrid"
SNAPSHOT_RELAUNCH_S = 300
"""Restart from the in-memory snapshot at cluster scale: a job relaunch (scheduling, process
start, communicator set-up) is assumed to take 5 minutes; the 4.8 s measured end to end on the
2-core CPU (the simulator's default) has no cluster relaunch in it."""
# MeCeFO paper, throughput drop at high failure frequency (model size -> %).
PAPER_MECEFO_DROP_PCT = {"350M": 1.07, "1B": 2.98, "7B": 4.18}
# MeCeFO paper, C4 perplexity increase of the 350M model (failure frequency -> %).
PAPER_MECEFO_PPL_PCT = {"low": 0.05, "mid": 0.75, "high": 1.6}
# SPARe paper, TTT/T0 at 600k GPUs: N -> (Rep+CKPT, SPARe+CKPT).
PAPER_SPARE = {200: (6.07, 2.92), 600: (4.27, 2.49), 1000: (3.88, 2.34)}
PNG_SIZE_IN, PNG_DPI = (8.0, 4.5), 100  # every plot is 800 x 450 pixels
REPORT_KEY = "__report__"
"""Manifest key of the latest report run: {"run_id", "started", "quick", "tools"}."""
HYBRID_TARGET = 1.15
"""DESIGN.md's target for the slowest rank under `hybrid` (step time vs a normal rank)."""


@dataclass(frozen=True)
class Tool:
    """One benchmark run: a script under tools/bench or a `mecefo-sim` subcommand."""

    name: str
    """Stem of its JSON file and key in the manifest."""
    title: str
    script: str
    """Path relative to the repo root, or `mecefo-sim`."""
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    stdout_json: bool = False
    """The tool prints its JSON on stdout (mecefo-sim has no --out)."""

    def argv(self, quick: bool, out: Path) -> list[str]:
        rest = list(self.quick_args if quick else self.args)
        if self.stdout_json:
            return [sys.executable, *SIM, *rest]
        return [sys.executable, str(ROOT / self.script), *rest, "--out", str(out)]

    def help_argv(self) -> list[str]:
        if self.stdout_json:
            return [sys.executable, *SIM, self.args[0], "--help"]
        return [sys.executable, str(ROOT / self.script), "--help"]

    def display(self, quick: bool, out: Path) -> str:
        """The command as a user types it from the repo root."""
        rest = list(self.quick_args if quick else self.args)
        if self.stdout_json:
            return " ".join(["mecefo-sim", *rest, ">", _rel(out)])
        return " ".join(["python", self.script, *rest, "--out", _rel(out)])


def _sim(
    name: str,
    title: str,
    scenario: str,
    gpus: int,
    per_group: int,
    strategies: str = STRATEGIES,
    extra: tuple[str, ...] = (),
    steps: int = 2000,
) -> Tool:
    args = ("simulate", "--json", "--scenario", f"configs/failures/{scenario}.yaml", "--gpus")
    args += (str(gpus), "--gpus-per-group", str(per_group), "--steps", str(steps))
    args += ("--strategies", strategies, "--snapshot-restart-s", str(SNAPSHOT_RELAUNCH_S), *extra)
    return Tool(name, title, "mecefo-sim", args, args, stdout_json=True)


LAYOUT_STRATEGIES = STRATEGIES + ",mecefo:hybrid:sample,mecefo:stage"
"""The 405B layout's runs also show stage-granular takeover, modelled (docs/sim.md)."""
SPARE_STRATEGIES = STRATEGIES + ",mecefo:spread:sample,mecefo:hybrid:sample"
"""Spare-node runs also show sample-granular takeover (b = 4 samples per micro-batch, M = 8)."""


TOOLS = (
    Tool(
        "step_time", "step time", "tools/bench/step_time.py", (), ("--warmup", "1", "--steps", "3")
    ),
    Tool(
        "degraded",
        "degraded-mode step time",
        "tools/bench/degraded.py",
        (),
        ("--models", "tiny", "--reps", "2", "--replicas", "4", "8"),
    ),
    Tool("failover", "failover latencies", "tools/bench/failover.py", (), ("--quick",)),
    # recovery.py's two halves run separately so that one failing does not lose the other
    Tool(
        "recovery",
        "snapshot and restore",
        "tools/bench/recovery.py",
        ("--no-e2e",),
        ("--quick", "--no-e2e"),
    ),
    Tool(
        "recovery_e2e",
        "end-to-end recovery jobs",
        "tools/bench/recovery.py",
        ("--models",),  # no models: only the end-to-end jobs (and the encode rates)
        ("--models", "--encode-mb", "16"),
    ),
    Tool("convergence", "loss gap", "tools/bench/convergence.py", (), ("--quick",)),
    Tool(
        "sim_reproduce",
        "SPARe paper table",
        "mecefo-sim",
        ("reproduce", "--json"),
        ("reproduce", "--json", "--seeds", "1"),
        stdout_json=True,
    ),
    _sim("sim_mecefo_high_64", "mecefo_high, 64 GPUs (8 DP groups of 8)", "mecefo_high", 64, 8),
    _sim("sim_mecefo_high_512", "mecefo_high, 512 GPUs (64 DP groups of 8)", "mecefo_high", 512, 8),
    _sim(
        "sim_llama3_16k",
        "llama3_405b rates, 16,384 GPUs (2048 DP groups of 8)",
        "llama3_405b",
        16384,
        8,
        SPARE_STRATEGIES,  # the no-spares baseline of the two spare runs below
    ),
    _sim(
        "sim_llama3_16k_spares",
        "llama3_405b rates, 16,384 GPUs, 4 spare nodes (replacement: the simulator's measured "
        "default)",
        "llama3_405b",
        16384,
        8,
        SPARE_STRATEGIES,
        ("--spare-nodes", "4"),
    ),
    _sim(
        "sim_llama3_16k_spares_120",
        "llama3_405b rates, 16,384 GPUs, 4 spare nodes, 120 s replacement",
        "llama3_405b",
        16384,
        8,
        SPARE_STRATEGIES,
        ("--spare-nodes", "4", "--replace-s", "120"),
    ),
    _sim(
        "sim_llama3_405b_layout",
        "llama3_405b rates, 16,384 GPUs as Llama 3 405B trains (128 replicas of TP 8 x PP 16)",
        "llama3_405b",
        16384,
        128,
        LAYOUT_STRATEGIES,
        ("--run-config", "configs/run/llama-405b-2048n.yaml"),
    ),
    _sim(
        "sim_llama3_405b_layout_spares",
        "llama3_405b rates, TP 8 x PP 16 replicas, 4 spare nodes (replacement from the state size)",
        "llama3_405b",
        16384,
        128,
        LAYOUT_STRATEGIES,
        ("--run-config", "configs/run/llama-405b-2048n.yaml", "--spare-nodes", "4"),
    ),
    Tool(
        "node_loss",
        "node loss, 1 standby node",
        "tools/bench/node_loss.py",
        ("--rounds", "3"),
        ("--rounds", "1"),
    ),
    Tool(
        "node_loss_nospare",
        "node loss, no standby (baseline)",
        "tools/bench/node_loss.py",
        ("--standby", "0", "--rounds", "2"),
        ("--standby", "0", "--rounds", "1"),
    ),
    Tool(
        "control_plane",
        "control plane under a 16k-rank load (synthetic clients)",
        "tools/bench/control_plane.py",
        (),  # 1k, 4k and 16k ranks, modes a and b
        ("--ranks", "16384"),
    ),
    Tool(
        "control_plane_real",
        "control plane, real jobs with one SIGKILL",
        "tools/bench/control_plane.py",
        ("--real-nproc", "8", "16", "32"),
        ("--real-nproc", "8"),
    ),
    Tool(
        "granularity",
        "takeover granularity per rank",
        "tools/bench/granularity.py",
        (),  # tiny and small, 5 rounds
        ("--models", "small", "--reps", "3"),
    ),
    Tool(
        "pipeline",
        "covering pipeline step time (PP 2)",
        "tools/bench/pipeline.py",
        ("--models", "tiny", "small"),
        ("--models", "small", "--reps", "3"),
    ),
    Tool(
        "sharded_optimizer",
        "distributed optimizer vs replicated",
        "tools/bench/sharded_optimizer.py",
        ("--repeats", "2"),  # tiny and small, DP 1 2 4, step time at DP 4, both failovers
        ("--quick",),  # step time at DP 2 and 25 steps
    ),
    Tool(
        "etcd_store",
        "the etcd store against the tcp store",
        "tools/bench/etcd_store.py",
        (),  # two A/B pairs of 120 steps, 3 elections per TTL
        ("--quick",),
    ),
    Tool(
        "peers",
        "side by side with the peers",
        "tools/bench/peers.py",
        (),  # 400 steps, kills at 50, 175, 300
        ("--quick",),
    ),
    Tool(
        "anomaly_cost",
        "silent-fault checks' cost",
        "tools/bench/anomaly_cost.py",
        (),
        ("--models", "tiny", "--reps", "3"),
    ),
    Tool(
        "spike_threshold",
        "spike statistics of failure-free runs",
        "tools/bench/spike_threshold.py",
        (),  # 3 runs of 1000 steps
        ("--runs", "tiny:8:2:1234", "--steps", "200"),
    ),
    Tool(
        "straggler",
        "a straggler's step time",
        "tools/bench/straggler.py",
        (),
        ("--model", "tiny", "--steps", "50"),
    ),
    Tool(
        "rerun_peer",
        "one NaN beside megatron-core's RerunStateMachine",
        "tools/bench/rerun_peer.py",
        (),  # about 1 min: 5 real processes and 3 mecefo-launch jobs
        (),
    ),
)
SIM_DROP_TOOLS = [t for t in TOOLS if t.name.startswith("sim_") and t.name != "sim_reproduce"]


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ------------------------------------------------------------------------------------ machine
def machine_info() -> dict:
    """CPU model and cores, torch version and GPU of this machine (torch is not imported)."""
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    gpu = None
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        names = [x.strip() for x in proc.stdout.splitlines() if x.strip()]
        gpu = f"{len(names)} x {names[0]}" if proc.returncode == 0 and names else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch_version,
        "python": platform.python_version(),
        "gpu": gpu,
        "host": platform.node(),
    }


def describe_machine(m: dict | None) -> str:
    if not m:
        return "unknown machine (JSON from an earlier run without a manifest entry)"
    gpu = m.get("gpu") or "no GPU"
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}, {gpu}"


# ------------------------------------------------------------------------------------ running
def check_tool(tool: Tool) -> str | None:
    """Why the tool cannot run here (None when its `--help` works)."""
    if not tool.stdout_json and not (ROOT / tool.script).is_file():
        return f"{tool.script} does not exist"
    try:
        proc = subprocess.run(
            tool.help_argv(), cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return "`--help` did not answer in 120 s"
    if proc.returncode != 0:
        return f"`--help` failed (exit {proc.returncode}): {_last_line(proc.stderr)}"
    return None


def _last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1][:300] if lines else "(no output)"


def json_digest(path: Path) -> str | None:
    """SHA-256 of a tool's JSON as written (None when missing)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def new_run_id(now: dt.datetime | None = None) -> str:
    """An id for one report run: its start time and host."""
    now = now or dt.datetime.now()
    return f"{now.strftime('%Y%m%dT%H%M%S')}-{platform.node() or 'host'}"


def run_tool(
    tool: Tool,
    out_dir: Path,
    quick: bool,
    timeout_s: float,
    progress=None,
    run_id: str | None = None,
) -> dict:
    """Run one tool as a subprocess (its own session, killed whole on timeout); its manifest entry.

    `progress(elapsed_s, last_log_line)` is called about once a second while it runs.
    """
    out, log = out_dir / f"{tool.name}.json", out_dir / f"{tool.name}.log"
    entry = {
        "tool": tool.name,
        "command": tool.display(quick, out),
        "quick": quick,
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "json": _rel(out),
        "log": _rel(log),
        "wall_s": 0.0,
        "run_id": run_id,
    }
    reason = check_tool(tool)
    if reason:
        return {**entry, "status": "missing", "reason": reason}
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
    start, load_start = time.monotonic(), os.getloadavg()[0]
    with open(log, "w") as log_fh, open(out if tool.stdout_json else os.devnull, "w") as out_fh:
        proc = subprocess.Popen(
            tool.argv(quick, out),
            cwd=ROOT,
            env=env,
            stdout=out_fh if tool.stdout_json else log_fh,
            stderr=log_fh if tool.stdout_json else subprocess.STDOUT,
            start_new_session=True,  # so a timeout kills its worker processes too
        )
        while True:
            try:
                rc = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - start
                if elapsed > timeout_s:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = None
                    break
                if progress:
                    progress(elapsed, _tail(log))
    entry["wall_s"] = time.monotonic() - start
    entry["loadavg_1m"] = [load_start, os.getloadavg()[0]]  # how shared the machine was
    if rc is None:
        why = f"killed after {timeout_s:.0f} s (last output: {_tail(log)})"
        return {**entry, "status": "timeout", "reason": why}
    if rc != 0:
        return {**entry, "status": "failed", "reason": f"exit {rc}: {_tail(log)}"}
    data, why = load_json(out)
    if data is None:
        return {**entry, "status": "failed", "reason": f"exit 0 but {why}"}
    return {**entry, "status": "ok", "reason": None, "json_sha256": json_digest(out)}


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 4096))
            return _last_line(fh.read().decode(errors="replace").replace("\r", "\n"))
    except OSError:
        return ""


def run_tools(
    tools, out_dir: Path, quick: bool, timeout_s: float, run_id: str | None = None
) -> dict:
    """Run the tools one after another under a progress bar; their manifest entries by name."""
    from tqdm import tqdm

    entries = {}
    bar = tqdm(tools, unit="tool", dynamic_ncols=True)
    for tool in bar:
        bar.set_description(tool.name)

        def progress(elapsed, line, bar=bar):
            bar.set_postfix_str(f"{elapsed:.0f} s | {line[:50]}")

        entry = run_tool(tool, out_dir, quick, timeout_s, progress, run_id=run_id)
        entries[tool.name] = entry
        why = f": {entry['reason']}" if entry["reason"] else ""
        tqdm.write(f"{tool.name}: {entry['status']} in {entry['wall_s']:.1f} s{why}")
    return entries


def load_json(path: Path) -> tuple[dict | None, str]:
    """(data, "") or (None, why not)."""
    if not path.is_file():
        return None, f"no JSON at {_rel(path)}"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"unreadable JSON at {_rel(path)} ({exc})"
    if not isinstance(data, dict):
        return None, f"JSON at {_rel(path)} is not an object"
    return data, ""


def _tool(name: str) -> Tool:
    return next(t for t in TOOLS if t.name == name)


def _mtime(path: Path) -> str:
    try:
        stamp = dt.datetime.fromtimestamp(path.stat().st_mtime)
        return f"JSON dated {stamp.isoformat(timespec='seconds')}"
    except OSError:
        return "date unknown"

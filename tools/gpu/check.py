#!/usr/bin/env python3
"""Everything one lent GPU can show, in one bounded call: writes gpu_check.json and gpu_check.md.

    bash tools/gpu/check.sh                  # on the device (carry tools/gpu/wheels); $OUT is used
    bash tools/gpu/check.sh --dry-run        # here, no GPU: the plan, the wheels, the JSON's shape
    python tools/gpu/check.py --only kernels --out /tmp/k   # one part

The environment (GPU, driver, torch, CUDA, Triton, megatron-core from the carried wheels that
check.sh installs), then each part of `parts.PARTS` as a child process in its own process group,
bounded by the part's time and by what is left of the 9-minute budget, killed with its group on
timeout: skipped with one line when it cannot run (no CUDA, a missing import, no time left),
failed when it exits non-zero. The JSON is rewritten after every part, so a call cut short still
leaves what finished. Children's output: `<out>/logs/`; their own JSON: `<out>/parts/`.
Standard library only (the dry mode imports neither torch nor megatron).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE) not in sys.path:  # run as a script it is sys.path[0] already
    sys.path.append(str(HERE))
from parts import BUDGET_S, ENV_BOUND_S, PARTS, Part, total_bound_s  # noqa: E402
from probe import ENV_KEYS, install_info, static_env, wheels_info  # noqa: E402

DRY_ENV = "MECEFO_GPU_DRY"
WHEELS_ENV = "MECEFO_GPU_WHEELS"
SCHEMA = 1
_child: list[subprocess.Popen] = []


class _Parser(argparse.ArgumentParser):
    """Usage errors are one `error:` line and exit 2, no traceback."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(
        prog="tools/gpu/check.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", help="output folder (default: $OUT, else bench_out/gpu_check)")
    p.add_argument("--dry-run", action="store_true", help=f"the plan only, no GPU (or {DRY_ENV}=1)")
    p.add_argument(
        "--wheels", help=f"carried wheels (default ${WHEELS_ENV}, else tools/gpu/wheels)"
    )
    p.add_argument("--only", nargs="+", choices=[x.name for x in PARTS], help="run these parts")
    p.add_argument("--budget", type=int, default=BUDGET_S, help=f"seconds, at most {BUDGET_S}")
    p.add_argument("--python", default=sys.executable, help="interpreter of the parts")
    p.add_argument("--parse-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 60 <= args.budget <= BUDGET_S:
        p.error(f"--budget must be in [60, {BUDGET_S}] seconds, got {args.budget}")
    args.dry_run = args.dry_run or os.environ.get(DRY_ENV, "") not in ("", "0")
    args.out = Path(args.out or os.environ.get("OUT") or ROOT / "bench_out" / "gpu_check")
    args.wheels = Path(args.wheels or os.environ.get(WHEELS_ENV) or HERE / "wheels")
    return args


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


# ------------------------------------------------------------------------------------ the parts
def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group if it still runs, SIGKILL whatever is left of it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # strays of a finished child too
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_bounded(argv: list[str], timeout_s: float, log: Path) -> tuple[int | None, float, str]:
    """(exit code or None on timeout, seconds, last lines of output) of one child."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MECEFO_HEALTH_CHECK_TIMEOUT_S="15")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        _child[:] = [proc]
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc)
            _child.clear()
    tail = log.read_text(errors="replace").strip().splitlines()[-40:]
    return rc, time.perf_counter() - t0, "\n".join(tail)


def _why(rc: int | None, timeout_s: float, tail: str) -> tuple[str, str]:
    """(status, one-line reason) of a child that did not succeed."""
    if rc is None:
        return "skipped", f"timed out after {timeout_s:.0f} s (its group killed)"
    err = re.findall(r"^(?:\w+\.)*(?:\w*Error|\w*Exception|error:).*$", tail, re.MULTILINE)
    line = (err or tail.splitlines() or ["(no output)"])[-1][:300]
    if "ModuleNotFoundError" in line or "ImportError" in line:
        return "skipped", f"import error: {line}"
    return "failed", f"exit {rc}: {line}"


def _command(python: str, argv: tuple[str, ...], json_path: Path) -> list[str]:
    return [python, *(a.replace("{json}", str(json_path)) for a in argv)]


def plan_part(part: Part, rec: dict) -> dict:
    """Dry mode: the scripts exist and know every flag the command passes."""
    for script in part.scripts:
        path = ROOT / script
        if not path.is_file():
            return rec | {"status": "skipped", "reason": f"{script} is missing"}
        text = path.read_text()
        flags = {a for _, argv in part.runs if argv[0] == script for a in argv if a[:2] == "--"}
        unknown = sorted(f for f in flags if f'"{f}"' not in text)
        if unknown:
            return rec | {"status": "skipped", "reason": f"{script} has no {', '.join(unknown)}"}
    return rec | {"status": "planned"}


def run_part(part: Part, args, have: dict, deadline: float) -> dict:
    """Run one part on the device (dry: plan it); its record in the JSON's `parts`."""
    tags = [part.name + (label and "-" + label) for label, _ in part.runs]
    cmds = [
        _command(args.python, argv, args.out / "parts" / f"{tag}.json")
        for tag, (_, argv) in zip(tags, part.runs)
    ]
    rec = {
        "name": part.name,
        "title": part.title,
        "status": "planned",
        "seconds": 0.0,
        "bound_s": part.bound_s,
        "reason": None,
        "commands": [" ".join(c) for c in cmds],
        "result": None,
        "figure": None,
    }
    if args.dry_run:
        return plan_part(part, rec)
    missing = [have[n] for n in part.needs if have.get(n)]
    if missing:
        return rec | {"status": "skipped", "reason": "; ".join(missing)}
    start, tried = time.perf_counter(), {}
    for (label, _), tag, cmd in zip(part.runs, tags, cmds):
        left = min(part.bound_s - (time.perf_counter() - start), deadline - time.monotonic())
        if left < 10:
            tried[label] = {"status": "skipped", "reason": "no time left in the budget"}
            break
        say(f"{tag}: running (bound {left:.0f} s): {' '.join(cmd[1:])}")
        tried[label] = entry = run_one(cmd, left, args.out / "logs" / f"{tag}.log")
        if entry["status"] != "ok" and part.stop_on_failure:
            break
    rec["seconds"] = round(time.perf_counter() - start, 1)
    if len(part.runs) == 1:
        only = next(iter(tried.values()))
        rec |= {"status": only["status"], "reason": only["reason"], "result": only.get("result")}
    else:  # presets in growing size: the largest that ran its steps
        fits = [k for k, v in tried.items() if v["status"] == "ok"]
        told = any(v["status"] in ("ok", "does not fit") for v in tried.values())
        rec |= {
            "status": "ok" if told else "failed",
            "reason": None if told else "; ".join(f"{k}: {v['reason']}" for k, v in tried.items()),
            "result": {
                "tried": {k: _brief(v) for k, v in tried.items()},
                "largest_fit": fits[-1] if fits else None,
            },
        }
    if rec["result"] is not None:
        try:
            rec["figure"] = part.summary(rec["result"])
        except Exception as exc:  # noqa: BLE001 - the JSON still has it all
            rec["figure"] = f"(no summary: {type(exc).__name__}: {exc})"
    return rec


def run_one(cmd: list[str], bound_s: float, log: Path) -> dict:
    """One bounded child: ok with its JSON, does not fit (CUDA OOM), skipped or failed."""
    rc, secs, tail = run_bounded(cmd, bound_s, log)
    out = Path(cmd[cmd.index("--out") + 1])
    entry = {"status": "ok", "seconds": round(secs, 1), "reason": None}
    if out.is_file():  # a check that fails still writes its figures
        entry["result"] = json.loads(out.read_text())
    if rc == 0 and out.is_file():
        return entry
    if "OutOfMemoryError" in tail or "CUDA out of memory" in tail:
        return entry | {"status": "does not fit", "reason": "CUDA out of memory"}
    status, reason = _why(rc, bound_s, tail) if rc != 0 else ("failed", f"exit 0, no {out.name}")
    return entry | {"status": status, "reason": reason}


def _brief(entry: dict) -> dict:
    """A preset's try without its whole JSON: status, and its step time where it ran."""
    rows = (entry.get("result") or {}).get("rows") or [{}]
    keep = ("step_time_s", "tokens_per_s", "mfu", "params_m")
    return {k: v for k, v in entry.items() if k != "result"} | {
        k: rows[0][k] for k in keep if k in rows[0]
    }


# ----------------------------------------------------------------------------------- the call
def device_env(args, deadline: float) -> tuple[dict, dict]:
    """(environment, why each need of the parts is missing or None) from a bounded child that
    imports torch."""
    log, out = args.out / "logs" / "environment.log", args.out / "parts" / "environment.json"
    cmd = _command(args.python, ("tools/gpu/probe.py", "env", "--out", "{json}"), out)
    if args.dry_run:
        say(f"environment: planned (bound {ENV_BOUND_S} s): {' '.join(cmd[1:])}")
        return static_env(), {}
    say(f"environment: probing (bound {ENV_BOUND_S} s)")
    bound = min(ENV_BOUND_S, deadline - time.monotonic())
    rc, _, tail = run_bounded(cmd, bound, log)
    env = static_env()
    if rc == 0 and out.is_file():
        env |= json.loads(out.read_text())
    else:
        env["probe_error"] = _why(rc, bound, tail)[1]
    return env, _missing(env)


def _missing(env: dict) -> dict[str, str | None]:
    """Why each need of the parts is missing (None: it is there)."""
    probe = env.get("probe_error")
    cuda = env.get("torch_error") or probe or f"torch {env['torch']} sees no GPU"
    mcore = env.get("megatron_error") or probe or "megatron-core is not installed"
    triton = env.get("triton_error") or "triton is not installed"
    return {
        "cuda": None if env.get("cuda_available") else f"no CUDA: {cuda}",
        "megatron": None if env.get("megatron_core") and not env.get("megatron_error") else mcore,
        "triton": None if env.get("triton") and not env.get("triton_error") else triton,
        "nvidia-smi": None if env.get("driver") else "no answer from nvidia-smi",
    }


def gpu_processes() -> list[str] | None:
    """Compute processes still on the GPU (None without nvidia-smi): nothing of ours may stay."""
    from probe import smi

    out = smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader")
    return None if out is None else [line for line in out.splitlines() if line.strip()]


def markdown(doc: dict) -> str:
    env = doc["environment"]
    inst, wh = env["install"], env["wheels"]
    lines = [
        f"# GPU check ({doc['mode']}): {env['gpu_name'] or 'no GPU'}",
        "",
        f"driver {env['driver']}, torch {env['torch']} (CUDA {env['cuda']}), Triton "
        f"{env['triton']}, megatron-core {env['megatron_core']}, Python {env['python']}; wheels "
        f"{'present' if wh['present'] else 'absent'} ({wh['mib']} MiB in {wh['dir']}), install "
        f"{inst['status']}; {doc['seconds']:.0f} s of at most {doc['total_bound_s']} s",
        "",
        "| part | status | s (bound) | figure or reason |",
        "|---|---|---|---|",
    ]
    for p in doc["parts"]:
        what = p["figure"] or p["reason"] or " ; ".join(p["commands"])
        lines.append(
            f"| {p['name']} | {p['status']} | {p['seconds']:.0f} ({p['bound_s']}) | "
            f"{what.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def write(doc: dict, args) -> None:
    (args.out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str))
    (args.out / "gpu_check.md").write_text(markdown(doc))


def _on_term(signum, _frame):
    raise SystemExit(128 + signum)  # the finally below kills the running child's group


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parse_only:
        return 0
    wheels, install = wheels_info(args.wheels), install_info(args.dry_run)
    # the budget started with check.sh; keep 5 s to write the files
    t0, deadline = time.perf_counter(), time.monotonic() + args.budget - install["seconds"] - 5
    for sub in ("logs", "parts"):
        (args.out / sub).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_term)
    mode = "dry-run" if args.dry_run else "device"
    say(f"{mode}: out {args.out}, budget {args.budget} s, plan at most {total_bound_s()} s")
    say(
        f"wheels: {'present' if wheels['present'] else 'absent'} in {wheels['dir']} "
        f"({len(wheels['files'])} files, {wheels['mib']} MiB); install: {install['status']}"
        f"{' (' + install['reason'] + ')' if install['reason'] else ''}"
    )
    doc = {
        "schema": SCHEMA,
        "mode": mode,
        "budget_s": args.budget,
        "total_bound_s": total_bound_s(),
        "seconds": 0.0,
        "environment": {},
        "parts": [],
        "gpu_processes_after": None,
    }
    failed = False
    try:
        env, have = device_env(args, deadline)
        doc["environment"] = {k: env.get(k) for k in ENV_KEYS} | env
        doc["environment"] |= {"wheels": wheels, "install": install}
        say(
            f"environment: GPU {env['gpu_name']}, driver {env['driver']}, torch {env['torch']}, "
            f"CUDA {env['cuda']}, Triton {env['triton']}, megatron-core {env['megatron_core']}"
        )
        for part in PARTS:
            if args.only and part.name not in args.only:
                continue
            rec = run_part(part, args, have, deadline)
            failed |= rec["status"] == "failed"
            took = "" if args.dry_run else f" in {rec['seconds']:.0f} s"
            what = rec["figure"] or rec["reason"] or " ; ".join(rec["commands"])
            say(f"{part.name}: {rec['status']}{took} (bound {part.bound_s} s): {what}")
            doc["parts"].append(rec)
            doc["seconds"] = round(time.perf_counter() - t0, 1)
            write(doc, args)
    finally:
        for proc in list(_child):
            _kill_group(proc)
        if not args.dry_run:
            doc["gpu_processes_after"] = gpu_processes()
        doc["seconds"] = round(time.perf_counter() - t0, 1)
        if doc["environment"]:
            write(doc, args)
    say(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md in {doc['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

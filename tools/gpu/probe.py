#!/usr/bin/env python3
"""The environment and health probes of the GPU check (`tools/gpu/check.py`).

    python tools/gpu/probe.py env --out env.json       # torch, CUDA, Triton, megatron.core, GPU
    python tools/gpu/probe.py health --out health.json # gpu_health.check_gpu vs the real nvidia-smi

`static_env` (no torch import: package metadata, nvidia-smi, /dev/shm), `wheels_info` (the carried
wheels folder) and `install_info` (check.sh's install) are what the dry mode reports too; the two
probes import torch and run as bounded child processes of check.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from parts import INSTALL_BOUND_S

ENV_KEYS = (
    "python",
    "platform",
    "gpu_name",
    "gpu_memory_mib",
    "driver",
    "torch",
    "cuda",
    "cuda_available",
    "triton",
    "megatron_core",
    "megatron_error",
    "sentencepiece",
    "shm_free_gib",
    "wheels",
    "install",
)
"""Keys of the JSON's `environment`, in every mode (None where not known)."""
INSTALL_ENV = "MECEFO_GPU_INSTALL"
"""Set by check.sh: `status|seconds|reason` of its pip install of the carried wheels."""


def wheels_info(folder: Path) -> dict:
    """What the carried wheels folder holds (absent is a state, not an error)."""
    files = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    mib = sum(f.stat().st_size for f in files) / 2**20
    mcore = next((f.name for f in files if f.name.startswith("megatron_core-")), None)
    return {
        "dir": str(folder),
        "present": bool(files),
        "files": [f.name for f in files],
        "mib": round(mib, 2),
        "under_64_mib": mib < 64,
        "megatron_core_wheel": mcore,
    }


def install_info(dry: bool) -> dict:
    """check.sh's install outcome, from the environment it passes on."""
    if dry:
        return {"status": "planned", "seconds": 0.0, "bound_s": INSTALL_BOUND_S, "reason": None}
    raw = os.environ.get(INSTALL_ENV)
    if raw is None:
        return {
            "status": "skipped",
            "seconds": 0.0,
            "bound_s": INSTALL_BOUND_S,
            "reason": "not run through tools/gpu/check.sh",
        }
    status, _, rest = raw.partition("|")
    seconds, _, reason = rest.partition("|")
    return {
        "status": status,
        "seconds": float(seconds or 0),
        "bound_s": INSTALL_BOUND_S,
        "reason": reason or None,
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def smi(*query: str, timeout: float = 15) -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        res = subprocess.run([smi, *query], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    return res.stdout.strip() if res.returncode == 0 else f"error: exit {res.returncode}"


def static_env() -> dict:
    """The environment without importing torch: package metadata, nvidia-smi, /dev/shm."""
    env = dict.fromkeys(ENV_KEYS)
    env |= {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "megatron_core": _version("megatron-core"),
        "sentencepiece": _version("sentencepiece"),
    }
    gpu = smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits")
    if gpu and not gpu.startswith("error"):
        name, driver, mem = (v.strip() for v in gpu.splitlines()[0].split(","))
        env |= {"gpu_name": name, "driver": driver, "gpu_memory_mib": int(float(mem))}
    if Path("/dev/shm").is_dir():
        env["shm_free_gib"] = round(shutil.disk_usage("/dev/shm").free / 2**30, 1)
    return env


def probe_env() -> dict:
    """In the child: what torch, CUDA, Triton and megatron.core say when imported."""
    env = static_env()
    try:
        import torch

        env |= {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
        }
        if env["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            env |= {
                "gpu_name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "multiprocessors": props.multi_processor_count,
            }
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        env["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        env |= {"triton": None, "triton_error": f"{type(exc).__name__}: {exc}"}
    try:
        import megatron.core  # noqa: F401

        env["megatron_core"] = _version("megatron-core") or "importable"
    except Exception as exc:  # noqa: BLE001
        env |= {"megatron_core": None, "megatron_error": f"{type(exc).__name__}: {exc}"}
    return env


def probe_health() -> dict:
    """In the child: `check_gpu` against the real nvidia-smi, and the fields it read."""
    from megatron_mecefo.failover.liveness.gpu_health import (
        SMI_FIELDS,
        check_gpu,
        device_id,
        gpus_present,
    )

    gpu = device_id(0)
    t0 = time.perf_counter()
    reason = check_gpu(gpu)
    return {
        "gpu": gpu,
        "reason": reason,
        "healthy": reason is None,
        "gpus_present": gpus_present(),
        "check_s": round(time.perf_counter() - t0, 3),
        "all_gpus_reason": check_gpu(None),
        "fields": list(SMI_FIELDS),
        "smi": smi(f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader") or "absent",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["env", "health"])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = probe_env() if args.what == "env" else probe_health()
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

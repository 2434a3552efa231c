"""Is this node's GPU fit to (re)start a rank on?

Used by the node agent before it restarts a dead rank (a rank that died of a GPU fault must not be
restarted onto the same faulty GPU again and again) and by `megatron_mecefo.preflight` before a
job starts. Two checks, both optional by nature:
- `nvidia-smi` (when present): the GPU answers, and has no uncorrected volatile ECC errors, no
  pending page retirement / row remapping and no failed row remapping;
- a site's own command (`MECEFO_HEALTH_CHECK_CMD`, e.g. a DCGM diagnostic), run with the GPU id
  appended; a non-zero exit means unhealthy.
Without nvidia-smi and without a site command nothing can be told: healthy. Never raises.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

HEALTH_CMD_ENV = "MECEFO_HEALTH_CHECK_CMD"
HEALTH_TIMEOUT_ENV = "MECEFO_HEALTH_CHECK_TIMEOUT_S"

SMI_FIELDS = (
    "index",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "remapped_rows.failure",
)


def device_id(local_rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """The id nvidia-smi knows the rank's GPU by: its entry in CUDA_VISIBLE_DEVICES (an index or a
    UUID) when that is set, else the local rank itself."""
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and local_rank < len(visible):
        return visible[local_rank]
    return str(local_rank)


def parse_smi(csv_text: str) -> str | None:
    """Reason a GPU is unhealthy from `nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,
    nounits` output, or None. "[N/A]"/"N/A" fields (not supported on this GPU) are ignored."""
    problems = []
    for line in csv_text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(SMI_FIELDS):
            return f"unexpected nvidia-smi output: {line!r}"
        fields = dict(zip(SMI_FIELDS, values))
        gpu = fields["index"]
        if _count(fields["ecc.errors.uncorrected.volatile.total"]) > 0:
            problems.append(f"GPU {gpu}: uncorrected ECC errors")
        if fields["retired_pages.pending"].lower() == "yes":
            problems.append(f"GPU {gpu}: page retirement pending (reset needed)")
        if fields["remapped_rows.pending"].lower() == "yes":
            problems.append(f"GPU {gpu}: row remapping pending (reset needed)")
        if fields["remapped_rows.failure"].lower() == "yes":
            problems.append(f"GPU {gpu}: row remapping failed")
    return "; ".join(problems) or None


def gpus_present() -> bool:
    """Whether this machine has NVIDIA GPU device files (no GPU: nothing to check)."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()


def _count(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0  # N/A, [N/A], Not Supported


def check_gpu(gpu: str | None = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """None if GPU `gpu` (all GPUs when None) looks healthy or cannot be checked, else why not."""
    timeout_s = float(environ.get(HEALTH_TIMEOUT_ENV, 60))
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is not None and gpus_present():
        cmd = [smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
        if gpu is not None:
            cmd += ["-i", gpu]
        out = _run(cmd, timeout_s, environ)
        if not out.startswith("ok:"):
            return f"nvidia-smi: {out}"
        reason = parse_smi(out[3:])
        if reason:
            return reason
    site = environ.get(HEALTH_CMD_ENV, "").strip()
    if site:
        out = _run([*shlex.split(site), *([gpu] if gpu is not None else [])], timeout_s, environ)
        if not out.startswith("ok:"):
            return f"{HEALTH_CMD_ENV} ({site}): {out}"
    return None


def _run(cmd: list[str], timeout_s: float, environ: Mapping[str, str]) -> str:
    """'ok:' + stdout, or a one-line reason."""
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(environ)
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout_s:.0f} s (a hung GPU or driver)"
    except OSError as exc:
        return f"cannot run: {exc}"
    if res.returncode != 0:
        last = (res.stderr or res.stdout).strip().splitlines()
        return f"exit {res.returncode}: {last[-1] if last else '(no output)'}"
    return "ok:" + res.stdout

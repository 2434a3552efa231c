"""One NaN handled by megatron-core's `RerunStateMachine` and by megatron-mecefo's rerun on a
peer (`docs/anomalies.md`, "Beside megatron-core's `RerunStateMachine`").

    python tools/bench/rerun_peer.py                   # both systems, about 1 min on 2 cores
    python tools/bench/rerun_peer.py --only megatron   # the state machine alone
    python tools/bench/rerun_peer.py --quick           # its verdicts only, one process, ~25 s

megatron-core 0.16.1's machine (`VALIDATE_RESULTS`, a `RerunDataIterator`, megatron's RNG tracker
in `state_save_func`) drives a Megatron-LM-style loop here around the demo `tiny` model on 1 rank:
`should_run_forward_backward`, `validate_result(loss, torch.isnan, tolerance=0.0)`,
`should_checkpoint_and_exit`. Every micro-batch loss of step `--step` is multiplied by NaN:
transient (first evaluation, first process, `fatal=False`), persistent (every evaluation in the
first process; `fatal=True` there, the only way to a checkpoint and exit 16; the fresh process,
"another GPU", loads it and reruns with `fatal=False`), data (the NaN in both). Real processes
(`--child`), epoch stamps. megatron-mecefo: `mecefo-launch`, 2 replicas, `--inject
nan:1:S[:persistent|:data]`, from events.jsonl. Then the verdicts with `fatal` True or False
throughout, in one process. Prints a table and writes JSON. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    ROOT,
    bench_parser,
    demo_job_args,
    ensure_demo,
    machine,
    read_jsonl,
    write_json,
)

KINDS = ("transient", "persistent", "data")
INJECT = {"transient": "nan:1:{}", "persistent": "nan:1:{}:persistent", "data": "nan:1:{}:data"}
MICRO_BATCH_SIZE, NUM_MICROBATCHES = 8, 2
OTHER_GPU = 1
"""`torch.cuda.current_device()` in the restarted process: the machine will not judge on the
device it suspects (the CPU layer stubs it to 0), so the restart plays another GPU."""
SETTINGS = {"as timed": None, "fatal=True": True, "fatal=False": False}
"""`fatal` of `validate_result`: as the timed runs (see the module docstring), or one value
throughout: True is Megatron-LM's NaN check, False its spiky-loss check."""
VERDICT = {
    "first_rerun_not_reproducible": "transient",
    "second_rerun_not_reproducible": "persistent",
    "second_rerun_reproducible": "correct result",
}
"""The machine's last record of a fault (`RerunValidationStatus`) -> its diagnosis."""


def parse_args(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--step", type=int, default=5, help="the faulty step S (>= 5)")
    p.add_argument("--steps", type=int, default=12, help="steps of each mecefo-launch job")
    p.add_argument("--job-timeout-s", type=float, default=90.0, help="per mecefo-launch job")
    p.add_argument("--only", choices=("megatron", "mecefo"))
    p.add_argument("--quick", action="store_true", help="verdicts in one process, no timing")
    p.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
        help="the `fatal` settings whose verdicts are recorded",
    )  # fmt: skip
    p.add_argument("--demo-dir", default=".cache/demo_data")
    p.add_argument("--out", default="bench_out/rerun_peer.json")
    p.add_argument(
        "--child", nargs=4, metavar=("PHASE", "KIND", "CKPT", "RECORD"), help=argparse.SUPPRESS
    )
    return p.parse_args(argv)


# ------------------------------------------------------------------- megatron-core's machine
class StepBatches:
    """The demo data as (step, micro-batch index, batch), from `next_step` on. Within a process
    the `RerunDataIterator` around it replays a step; the restart resumes at the checkpoint's
    next step. (Restoring the position in `state_restore_func` as well made the step after an
    in-place rerun read the rerun step's data again.)"""

    def __init__(self, sampler, next_step: int = 0):
        self.sampler, self.next_step, self.index = sampler, next_step, 0

    def __next__(self):
        item = (self.next_step, self.index, self.sampler.get(self.next_step, 0, self.index))
        self.index += 1
        if self.index == NUM_MICROBATCHES:
            self.next_step, self.index = self.next_step + 1, 0
        return item


class Loop:
    """One process's training loop under the state machine, with the NaN put in and the times
    of what happens (epoch seconds: comparable across the processes)."""

    def __init__(self, engine, kind: str, phase: str, fault_step: int, fatal: bool, ckpt: str):
        from megatron.core import rerun_state_machine as rsm
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.engine, self.kind, self.phase, self.fatal = engine, kind, phase, fatal
        self.fault_step, self.ckpt, self.evaluations = fault_step, Path(ckpt), 0
        self.batches = StepBatches(engine.train_sampler)
        self.data = rsm.RerunDataIterator(self.batches)
        tracker = get_cuda_rng_tracker()
        rsm.destroy_rerun_state_machine()
        rsm.initialize_rerun_state_machine(
            state_save_func=lambda: {k: v.clone() for k, v in tracker.get_states().items()},
            state_restore_func=lambda s: tracker.set_states({k: v.clone() for k, v in s.items()}),
            mode=rsm.RerunMode.VALIDATE_RESULTS,
        )
        self.rsm = rsm.get_rerun_state_machine()
        self.verdicts: list[tuple[str, float]] = []
        log = self.rsm._log_validation_error_to_file  # the machine's own record of each verdict

        def record(status, result, message):
            self.verdicts.append((str(getattr(status, "value", status)), time.time()))
            log(status=status, result=result, message=message)

        self.rsm._log_validation_error_to_file = record
        self.marks: dict = {"step_start": {}, "step_end": {}, "loss": {}}

    def poisoned(self, step: int) -> bool:
        if step != self.fault_step:
            return False
        if self.kind == "data":
            return True
        if self.phase != "first":
            return False
        return self.kind == "persistent" or (self.kind == "transient" and self.evaluations == 1)

    def forward_step(self, data_iterator, model):
        import torch

        step, index, batch = next(data_iterator)
        if step == self.fault_step and index == 0:
            self.evaluations += 1
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        if self.poisoned(step):
            output = output * float("nan")  # per-token losses: through the backward as well
        mask = batch["loss_mask"].reshape(-1).float()

        def loss_func(output_tensor):
            loss = (output_tensor.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)
            flagged = self.rsm.rerun_requested
            self.rsm.validate_result(
                result=loss,
                rejection_func=torch.isnan,
                message="loss is NaN",
                tolerance=0.0,
                fatal=self.fatal,
            )
            if not flagged and self.rsm.rerun_requested:
                self.marks.setdefault("detected", time.time())
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    def step(self, step: int) -> tuple[int, bool]:
        """`step` as Megatron-LM's `train_step` runs it; (exit code asked for, updated)."""
        from megatron_mecefo.mcore import stack
        from megatron_mecefo.training.lr_schedule import lr_at

        e, tc = self.engine, self.engine.cfg.training
        self.marks["step_start"][step] = time.time()
        stack.set_lr(e.optimizer, lr_at(step, tc), tc.weight_decay)
        plan = e.default_plan()
        e.reducer.set_scales(plan.grad_scale, plan.attention_grad_scale)
        outputs = []
        while self.rsm.should_run_forward_backward(self.data):
            e.ddp.zero_grad_buffer()
            e.optimizer.zero_grad()
            outputs = stack.forward_backward(
                e.ddp, self.forward_step, self.data, num_microbatches=NUM_MICROBATCHES,
                seq_length=e.cfg.model.seq_length, micro_batch_size=MICRO_BATCH_SIZE,
            )  # fmt: skip
        save, stop, code = self.rsm.should_checkpoint_and_exit()
        if save:
            self.marks["ckpt_bytes"], self.marks["ckpt_save_s"] = self.save_checkpoint(step)
        if stop:
            return code, False
        loss = sum(float(o["loss"]) for o in outputs) / len(outputs)
        self.marks["loss"][step] = loss
        if updated := math.isfinite(loss):  # fp32 megatron would apply NaN: skip, as a scaler
            e.optimizer.step()
        self.marks["step_end"][step] = time.time()
        return 0, updated

    def save_checkpoint(self, step: int, folder: Path | None = None) -> tuple[int, float]:
        """Model, optimizer, RNG and next step (`mcore/checkpointing.py`) and the machine's state
        as Megatron-LM saves it, both with dist_checkpointing; (bytes, seconds)."""
        from megatron.core import dist_checkpointing

        from megatron_mecefo.mcore import checkpointing

        root = folder or self.ckpt
        t0 = time.perf_counter()
        for sub in ("model", "rerun"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        checkpointing.save(self.engine, str(root / "model"), step, async_save=False)
        sd = self.rsm.state_dict(self.data, "torch_dist", force=folder is not None)
        dist_checkpointing.save({"rerun_state_machine": sd}, str(root / "rerun"))
        seconds = time.perf_counter() - t0
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()), seconds

    def load_checkpoint(self) -> int:
        """The inverse, in the restarted process; returns the step to resume at."""
        from megatron.core import dist_checkpointing

        from megatron_mecefo.mcore import checkpointing

        next_step = checkpointing.load(self.engine, str(self.ckpt / "model"))
        like = {"rerun_state_machine": self.rsm.state_dict(self.data, "torch_dist", force=True)}
        loaded = dist_checkpointing.load(like, str(self.ckpt / "rerun"))
        self.rsm.load_state_dict(loaded["rerun_state_machine"])
        self.batches.next_step = next_step
        return next_step


def run_phase(ctx, kind, phase, fault_step, ckpt, demo_dir, fatal, warm_save=False) -> dict:
    """One process's part in this process; its record. "first": steps 0..S+1 until the machine
    asks to exit (`warm_save`: one save first, timed as `first_save_s`: a process's first
    dist_checkpointing save pays a one-off 1-2 s here); "second": load the checkpoint, rerun S
    on "another GPU", then S+1. Kind "none": failure-free."""
    import torch
    from bench_engine import build_bench_engine

    t0 = time.time()
    engine = build_bench_engine(
        ctx, "tiny", demo_dir=demo_dir, micro_batch_size=MICRO_BATCH_SIZE,
        num_microbatches=NUM_MICROBATCHES, max_steps=fault_step + 4,
    )  # fmt: skip
    engine.anomaly.enabled = False  # megatron-mecefo's own checks stay out of this
    loop = Loop(engine, kind, phase, fault_step, fatal, ckpt)
    rec = {"kind": kind, "phase": phase, "fatal": fatal, "built": time.time()}
    rec["build_s"] = rec["built"] - t0
    if warm_save:
        rec["first_save_s"] = loop.save_checkpoint(0, Path(f"{ckpt}-periodic"))[1]
    start, device = 0, torch.cuda.current_device
    if phase == "second":
        torch.cuda.current_device = lambda: OTHER_GPU
        start = loop.load_checkpoint()
        rec["loaded"] = time.time()
        rec["load_s"] = rec["loaded"] - rec["built"]
    code, updated = 0, {}
    try:
        for step in range(start, fault_step + 2):
            code, updated[step] = loop.step(step)
            if code:
                break
    finally:
        torch.cuda.current_device = device
    rec.update(loop.marks, exit_code=code, updated=updated, verdicts=loop.verdicts)
    rec["exit"] = time.time()
    return rec


def verdicts(demo_dir: str, fault_step: int, tmp: str, settings=SETTINGS) -> dict:
    """Each setting's and kind's outcome, both phases in this process (no timing): exit codes,
    the machine's records, whether the fault step updated the model, the losses of S and S+1
    (under "reference": a failure-free run's)."""
    from bench_common import init_torch

    from megatron_mecefo.mcore.parallel import destroy_parallel

    ctx, s = init_torch(1), fault_step
    try:
        ref = run_phase(ctx, "none", "first", s, f"{tmp}/none", demo_dir, False)["loss"]
        out: dict = {"reference": {"loss": [ref[s], ref[s + 1]]}}
        for label, fatal in settings.items():
            for kind in KINDS:
                ckpt, first_fatal = f"{tmp}/{kind}-{fatal}", kind != "transient"
                last = first = run_phase(
                    ctx, kind, "first", s, ckpt, demo_dir, first_fatal if fatal is None else fatal
                )
                row = {"first_exit": first["exit_code"], "first": _records(first)}
                if first["exit_code"] == 16:
                    last = run_phase(ctx, kind, "second", s, ckpt, demo_dir, bool(fatal))
                    row.update(second_exit=last["exit_code"], second=_records(last))
                row["verdict"] = diagnosis(row.get("second") or row["first"])
                row["updated"] = last["updated"].get(s)
                row["loss"] = [last["loss"].get(s), last["loss"].get(s + 1)]
                out.setdefault(label, {})[kind] = row
    finally:
        destroy_parallel()
    return out


def _records(rec: dict) -> list[str]:
    return [status for status, _ in rec["verdicts"]]


def diagnosis(records: list[str]) -> str:
    """The machine's diagnosis from its records of a fault (the last one decides)."""
    return VERDICT.get(records[-1], "no verdict") if records else "no verdict"


def child_main(args) -> int:
    """`--child first|second KIND CKPT RECORD`: one phase in this fresh process; its record
    (with when its imports were done) goes to RECORD, and it exits with the machine's code."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.rerun_state_machine  # noqa: F401
    import torch  # noqa: F401
    from bench_common import init_torch

    import megatron_mecefo.training.engine  # noqa: F401

    imported = time.time()
    phase, kind, ckpt, record = args.child
    fatal = kind != "transient" and phase == "first"
    rec = run_phase(
        init_torch(1), kind, phase, args.step, ckpt, args.demo_dir, fatal, phase == "first"
    )
    rec["imported"] = imported
    Path(record).write_text(json.dumps(rec))
    return rec["exit_code"]


def _child(args, kind: str, phase: str, tmp: Path) -> tuple[float, float, int, dict]:
    record = tmp / f"{kind}.{phase}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", str(args.step)]
    cmd += ["--child", phase, kind, str(tmp / kind), str(record)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    launched = time.time()
    proc = subprocess.run(
        [*cmd, "--demo-dir", args.demo_dir], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    ended = time.time()
    if not record.exists():
        sys.exit(f"error: {kind}, {phase} process ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return launched, ended, proc.returncode, json.loads(record.read_text())


def megatron_kind(args, kind: str, tmp: Path) -> dict:
    """One kind under the state machine in real processes; the times and verdicts."""
    s = str(args.step)
    _, first_ended, code, first = _child(args, kind, "first", tmp)
    starts, ends = first["step_start"], first["step_end"]
    row = {"system": "megatron-core", "kind": kind, "first_exit": code}
    row["normal_step_s"] = statistics.median(ends[str(k)] - starts[str(k)] for k in range(1, 5))
    row["verdicts"] = _records(first)
    t_start, t_detect = starts[s], first.get("detected")
    row["detection_s"] = t_detect and t_detect - t_start
    in_place = [t for v, t in first["verdicts"] if v.startswith("first_rerun")][0]
    row["in_place_rerun_s"] = in_place - t_detect
    row["first_save_s"] = first.get("first_save_s")
    judged, committed = in_place, ends.get(s)
    row.update(ranks_stopped=0, ckpt_bytes=0, loss=first["loss"].get(s))
    if code == 16:
        launched, _, code2, second = _child(args, kind, "second", tmp)
        row.update(ranks_stopped="all", ckpt_bytes=first["ckpt_bytes"], second_exit=code2)
        row["second_verdicts"] = _records(second)
        row["ckpt_save_s"] = first["ckpt_save_s"]
        row["exit_s"] = first_ended - first["exit"]  # the process's teardown
        row["process_start_s"] = second["imported"] - launched  # python, torch, megatron
        row["build_s"], row["load_s"] = second["build_s"], second["load_s"]
        judged = second["verdicts"][0][1] if second["verdicts"] else None
        row["rerun_s"] = judged and judged - second["loaded"]
        committed = second["step_end"].get(s)
        row["loss"] = second["loss"].get(s)
    row["judgement_s"] = judged and judged - t_detect
    row["resume_s"] = committed and judged and committed - judged
    row["total_s"] = committed and committed - t_start
    row["verdict"] = diagnosis(row.get("second_verdicts") or row["verdicts"])
    return row


# ---------------------------------------------------------------------------- megatron-mecefo
def run_launch(args, run_dir: Path, inject: str) -> dict:
    """The demo job under `mecefo-launch` (2 ranks) in its own session, killed whole after
    `--job-timeout-s`; its metrics and events."""
    from megatron_mecefo.failover.node.agent_cli import launch_command

    train = demo_job_args(args.steps, run_dir, args.demo_dir, "--inject", inject)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log, start = Path(f"{run_dir}.log"), time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            launch_command(train, nproc_per_node=2), cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=args.job_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"killed after {args.job_timeout_s:g} s"
    if code != 0:
        sys.exit(
            f"error: the mecefo-launch job ({inject}) failed ({code}):\n{log.read_text()[-3000:]}"
        )
    return {
        "wall_s": time.monotonic() - start,
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
        "events": read_jsonl(run_dir / "events.jsonl"),
    }


def mecefo_kind(args, kind: str, tmp: Path) -> dict:
    """One kind under `mecefo-launch` (2 replicas), timed from events.jsonl. It stamps no step
    start: the fault step's first attempt is taken to last a normal step (the vote ends each
    attempt and posts the anomaly). The step commits at the end of the redo that follows the
    classification (a transient's `classified` is posted after that commit)."""
    s, inject = args.step, INJECT[kind].format(args.step)
    res = run_launch(args, tmp / f"mecefo-{kind}", inject)
    steps = {m["step"]: m for m in res["metrics"]}
    normal = statistics.median(steps[k]["step_time_s"] for k in range(1, s))
    ev = [e for e in res["events"] if e["step"] == s]
    t_anomaly = min(e["time_s"] for e in ev if e["type"] == "anomaly")
    cls = next((e for e in ev if e["type"] == "classified"), None)
    if cls is None:
        sys.exit(f"error: {inject}: no classified event at step {s}: {ev}")
    committed = cls["time_s"]
    if kind != "transient":  # the last event before the committed redo, then that attempt
        redo = ("classified", "evicted", "step_redone", "regroup", "takeover")
        committed = max(e["time_s"] for e in ev if e["type"] in redo) + steps[s]["step_time_s"]
    return {
        "system": "megatron-mecefo", "kind": kind, "inject": inject, "normal_step_s": normal,
        "classified": cls.get("kind"), "verdict": cls.get("kind"), "detection_s": normal,
        "judgement_s": cls["time_s"] - t_anomaly, "resume_s": committed - cls["time_s"],
        "total_s": normal + committed - t_anomaly, "ckpt_bytes": 0,
        "ranks_stopped": sum(e["type"] == "evicted" for e in ev), "loss": steps[s]["loss"],
        "steps_logged": len(steps), "wall_s": res["wall_s"],
    }  # fmt: skip


# ------------------------------------------------------------------------------------- output
def _s(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(doc: dict) -> None:
    print("one NaN at one step; seconds from the fault step's start")
    print(f"{'kind':<11}{'system':<16}{'verdict':<15}  detect  judge resume  total stopped  bytes")
    for r in doc["rows"]:
        print(
            f"{r['kind']:<11}{r['system']:<16}{r['verdict']:<15}{_s(r['detection_s'], '.3f'):>8}"
            f"{_s(r['judgement_s']):>7}{_s(r['resume_s']):>7}{_s(r['total_s']):>7}"
            f"{str(r['ranks_stopped']):>8}{r['ckpt_bytes']:>10,}"
        )
        if r.get("second_exit") is not None:
            parts = ("in_place_rerun_s", "ckpt_save_s", "first_save_s", "exit_s",
                     "process_start_s", "build_s", "load_s", "rerun_s")  # fmt: skip
            print("   ", ", ".join(f"{k[:-2]} {_s(r[k])}" for k in parts))
    for label, kinds in (doc.get("verdicts") or {}).items():
        said = [
            f"{kind} exit {r['first_exit']}{' then ' if 'second_exit' in r else ''}"
            f"{r.get('second_exit', '')} ({r['verdict']}{', updated' if r['updated'] else ''})"
            for kind, r in kinds.items()
            if label != "reference"
        ]
        if said:
            print(f"  validate_result {label}: " + "; ".join(said))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    if args.step < 5:
        sys.exit("error: --step must be >= 5 (steps 1-4 give the normal step time)")
    ensure_demo(args.demo_dir)
    doc = {"machine": machine(), "args": vars(args), "rows": []}
    with tempfile.TemporaryDirectory(prefix="mecefo-rerun-peer-") as tmp:
        for kind in () if args.quick else KINDS:
            if args.only != "mecefo":
                print(f"[bench] megatron-core {kind} ...", file=sys.stderr, flush=True)
                doc["rows"].append(megatron_kind(args, kind, Path(tmp)))
            if args.only != "megatron":
                print(f"[bench] megatron-mecefo {kind} ...", file=sys.stderr, flush=True)
                doc["rows"].append(mecefo_kind(args, kind, Path(tmp)))
        if args.only != "mecefo":
            print("[bench] the machine's verdicts, one process ...", file=sys.stderr, flush=True)
            settings = {k: SETTINGS[k] for k in args.settings}
            doc["verdicts"] = verdicts(args.demo_dir, args.step, tmp, settings)
    print_table(doc)
    return write_json(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())

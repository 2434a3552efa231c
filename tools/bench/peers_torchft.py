"""One torchft replica group of the peers benchmark (`peers.py`): the demo job's GPTModel, data
order, seed, lr schedule and AdamW settings, trained under torchft's `Manager`, its DDP and
optimizer wrappers and `ProcessGroupGloo`. Run under `torchrun --nproc-per-node 1` (the group's
store) with `TORCHFT_LIGHTHOUSE` set; `--prepare-only` builds the data index once, before the
replicas start, so that they never race to write it.

Writes one JSONL row per step attempt to `OUT_DIR/rows_replica<R>.jsonl` (step, wall time, local
loss, committed, participants, participating, incarnation) and SIGKILLs itself at the start of
each `--kills` step (once: a marker file in `OUT_DIR/kills`); a restarted incarnation stays down
until the kill's time plus `--down-s`, as the other systems' replicas do. At `--group-kill` it
writes `OUT_DIR/group_kill` and waits for the benchmark to kill its torchrun with it; the fresh
torchrun the benchmark starts later passes `--incarnation-base` (its incarnation numbers go on
from the killed group's, and it does not wait for the other groups' first start again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common  # noqa: E402
from peers_group import GROUP_MARKER, hold_for_kill  # noqa: E402

STARTUP_WAIT_S = 300.0
"""Bound on waiting for every replica's first incarnation to be ready."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--demo-dir", required=True)
    p.add_argument("--kills", default="", help="STEP,STEP,... at which --kill-replica dies")
    p.add_argument("--kill-replica", type=int, default=1)
    p.add_argument("--down-s", type=float, default=2.0)
    p.add_argument("--group-kill", type=int, default=-1, help="step of the group kill (-1: none)")
    p.add_argument(
        "--incarnation-base",
        type=int,
        default=0,
        help="a relaunched group: its first incarnation's number (the killed group's count)",
    )
    p.add_argument("--prepare-only", action="store_true")
    p.add_argument("overrides", nargs="*", help="run-config key=value overrides")
    return p.parse_args(argv)


def load_cfg(args):
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig

    over = [f"data.demo_dir={args.demo_dir}", f"training.max_steps={args.steps}"]
    return load_config(RunConfig, bench_common.DEMO_CONFIG, [*over, *args.overrides])


def load_data(cfg, replicas: int):
    """The trainer's data for `replicas` replicas, built by this process alone."""
    from megatron_mecefo.training.engine import prepare_run_data

    return prepare_run_data(cfg, replicas, rank=0, barrier=lambda: None)


def masked_mean(model, batch):
    """The trainer's loss of one micro-batch: token mean of the per-token loss over loss_mask."""
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].reshape(-1)
    return (out.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)


def param_groups(model, weight_decay: float) -> list[dict]:
    """megatron's AdamW groups: no weight decay on biases and 1-D parameters (norms)."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (plain if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return [
        {"params": decay, "wd_mult": 1.0, "weight_decay": weight_decay},
        {"params": plain, "wd_mult": 0.0, "weight_decay": 0.0},
    ]


def wait_down(kill_dir: Path, replica: int, down_s: float) -> None:
    """A restarted incarnation stays down until its newest kill's time + `down_s`."""
    stamps = [float(f.read_text()) for f in kill_dir.glob(f"r{replica}_s*") if f.read_text()]
    if stamps:
        time.sleep(max(0.0, max(stamps) + down_s - time.time()))


def wait_ready(out_dir: Path, replica: int, replicas: int) -> None:
    """First incarnations only: every replica group has its Manager (so it heartbeats) before
    any asks for the first quorum, as with torchft's launchers that start groups together."""
    (out_dir / f"ready_{replica}").write_text("1")
    deadline = time.monotonic() + STARTUP_WAIT_S
    while len(list(out_dir.glob("ready_*"))) < replicas:
        if time.monotonic() > deadline:
            sys.exit(f"replica {replica}: the other replica groups never started")
        time.sleep(0.05)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    kill_dir = out_dir / "kills"
    kill_dir.mkdir(parents=True, exist_ok=True)
    incarnation = args.incarnation_base + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if incarnation:  # restarted or relaunched: every group has started before
        wait_down(kill_dir, args.replica, args.down_s)
        if (out_dir / "done").exists():
            return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    bench_common.init_torch(1)  # world-1 megatron state: the model is built as the trainer's
    cfg = load_cfg(args)
    data = load_data(cfg, args.replicas)
    if args.prepare_only:
        return 0
    train(cfg, data, args, out_dir, kill_dir, incarnation)
    return 0


def build(cfg, data, args):
    """The model, sampler, torchft `Manager`, DDP and optimizer wrappers of one replica group."""
    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from megatron_mecefo.data.sampler import MicroBatchSampler
    from megatron_mecefo.mcore.model import build_gpt_model
    from megatron_mecefo.mcore.parallel import seed_everything
    from megatron_mecefo.training.lr_schedule import lr_at

    tc = cfg.training
    seed_everything(tc.seed)
    model, _, _ = build_gpt_model(cfg.model, seed=tc.seed)
    sampler = MicroBatchSampler(
        data.train,
        micro_batch_size=tc.micro_batch_size,
        num_microbatches=tc.num_microbatches,
        num_replicas=args.replicas,
    )
    inner = torch.optim.AdamW(
        param_groups(model, tc.weight_decay),
        lr=tc.lr,
        betas=(tc.adam_beta1, tc.adam_beta2),
        eps=tc.adam_eps,
    )

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    # torchft's README: ProcessGroupGloo, Manager(min_replica_size=1); short collective timeouts
    # so that a dead peer fails the step in seconds; its default HTTP transport, counting what a
    # healing replica receives
    transport = counting_transport(timedelta(seconds=10))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        checkpoint_transport=transport,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timedelta(seconds=10),
        replica_id=f"peers_{args.replica}",
    )

    def before_update(opt, *_):  # after a heal's state load: this commit's lr, then the clip
        step = manager.current_step() - 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
            g["weight_decay"] = tc.weight_decay * g["wd_mult"]
        if tc.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_grad)

    inner.register_step_pre_hook(before_update)
    ddp = DistributedDataParallel(manager, model)
    return model, sampler, manager, ddp, OptimizerWrapper(manager, inner), transport


def counting_transport(timeout):
    """torchft's default checkpoint transport (`HTTPTransport`, as `Manager` builds it), whose
    `received` lists the bytes of each state dict a healing replica received: the size of its
    `torch.save` serialisation, which is what the transport sends (our rejoin `bytes` count the
    same way)."""
    import io

    import torch
    from torchft.checkpointing.http_transport import HTTPTransport

    class Counting(HTTPTransport):
        received: list[int] = []

        def recv_checkpoint(self, *args, **kwargs):
            state = super().recv_checkpoint(*args, **kwargs)
            buf = io.BytesIO()
            torch.save(state, buf)
            self.received.append(buf.tell())
            return state

    return Counting(timeout=timeout, num_chunks=0)


def train(cfg, data, args, out_dir: Path, kill_dir: Path, incarnation: int) -> None:
    """Steps until the job's last one, a row per attempt; then replica 0's validation loss."""
    tc = cfg.training
    model, sampler, manager, ddp, optimizer, transport = build(cfg, data, args)
    healed = 0
    if incarnation == 0:  # a relaunched group (incarnation_base > 0) does not wait again
        wait_ready(out_dir, args.replica, args.replicas)
    kills = {int(s) for s in args.kills.split(",") if s}
    rows = open(out_dir / f"rows_replica{args.replica}.jsonl", "a", buffering=1)
    done = out_dir / "done"  # the job reached its last step: a late incarnation must not retrain
    while (step := manager.current_step()) < args.steps and not done.exists():
        marker = kill_dir / f"r{args.replica}_s{step}"
        if args.replica == args.kill_replica and step in kills and not marker.exists():
            marker.write_text(str(time.time()))
            print(f"[peers] torchft replica {args.replica}: kill at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        group = out_dir / GROUP_MARKER
        if args.replica == args.kill_replica and step == args.group_kill and not group.exists():
            hold_for_kill(group, f"torchft replica {args.replica} step {step}")
        optimizer.zero_grad()  # starts the quorum (async, overlapping the forward)
        loss = 0.0
        for m in range(tc.num_microbatches):  # accumulate; all-reduce on the last backward only
            last = m == tc.num_microbatches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                part = masked_mean(ddp, sampler.get(step, args.replica, m))
                (part / tc.num_microbatches).backward()
            loss += float(part) / tc.num_microbatches
        optimizer.step()  # commits only if every participant's step succeeded
        row = {
            "step": step,
            "time": time.time(),
            "loss": loss,
            "committed": manager.current_step() > step,
            "participants": manager.num_participants(),
            "participating": manager.participating_rank() is not None,
            "samples": sampler.micro_batch_size * tc.num_microbatches,
            "incarnation": incarnation,
        }
        rows.write(json.dumps(row) + "\n")
        for size in transport.received[healed:]:  # a heal during this step's quorum
            rows.write(json.dumps({"heal_bytes": size, "time": time.time()}) + "\n")
        healed = len(transport.received)
    if manager.current_step() >= args.steps:
        done.write_text(str(manager.current_step()))
        if args.replica == 0:
            rows.write(json.dumps({"val_loss": validate(cfg, data, model), "time": time.time()}))
            rows.write("\n")
    rows.close()
    manager.shutdown(wait=False)


def validate(cfg, data, model) -> float:
    """The trainer's `evaluate()`: mean loss of the validation split's first micro-batches."""
    import torch

    from megatron_mecefo.data.sampler import MicroBatchSampler

    tc = cfg.training
    valid = MicroBatchSampler(
        data.valid,
        micro_batch_size=tc.micro_batch_size,
        num_microbatches=tc.eval_microbatches,
        num_replicas=1,
    )
    with torch.no_grad():
        vals = [float(masked_mean(model, valid.get(0, 0, i))) for i in range(tc.eval_microbatches)]
    return sum(vals) / len(vals)


if __name__ == "__main__":
    sys.exit(main())

"""Sample-granular takeover is exact (`mecefo.takeover_granularity: sample`).

- The loss of a slice is its token sum over the whole micro-batch's loss tokens, so the slices of
  a micro-batch add up to that micro-batch's token mean (pure check, a random mask).
- One spawned engine (megatron schedule, DDP buffers, AdamW, EOD-masked loss): a step whose
  micro-batches are cut into slices of different sizes gives the whole micro-batches' loss,
  reduced gradients and parameters (float tolerance).
- Real processes (`mecefo-launch`, 4 ranks, SIGKILL of rank 2 at step 5): `spread` at sample
  granularity follows the failure-free loss curve, commits every sample exactly once, loses none,
  and the replicas end bitwise identical.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.launch import launch

M = 2  # configs/run/demo_cpu.yaml


@pytest.mark.timeout(30)
def test_slice_losses_add_up_to_the_micro_batch_token_mean():
    from megatron_mecefo.training.engine import _masked_mean_loss

    gen = torch.Generator().manual_seed(0)
    per_token = torch.rand(6, 16, generator=gen)  # [samples, seq]: per-token losses
    mask = (torch.rand(6, 16, generator=gen) > 0.3).float()  # uneven loss tokens per sample
    whole, report = _masked_mean_loss(mask, 1.0, None, False, per_token)
    total = float(mask.sum())
    parts = [
        _masked_mean_loss(mask[a:b], 1.0, total, False, per_token[a:b])
        for a, b in [(0, 1), (1, 4), (4, 6)]
    ]
    assert sum(float(p[0]) for p in parts) == pytest.approx(float(whole), rel=1e-6)
    assert [int(p[1]["samples"]) for p in parts] == [1, 3, 2] and int(report["samples"]) == 6
    # the slice's own token mean (what a micro-batch-counting scale would use) is not its share
    own = _masked_mean_loss(mask[1:4], 1.0, None, False, per_token[1:4])[0]
    assert float(own) != pytest.approx(float(parts[1][0]), rel=1e-3)


def _engine_worker(rank, demo_dir, cuts, steps):
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig
    from megatron_mecefo.plan import MicroBatchTask, RankStepPlan
    from megatron_mecefo.training.engine import build_engine

    cfg = load_config(
        RunConfig,
        "configs/run/demo_cpu.yaml",
        [
            f"data.demo_dir={demo_dir}",
            "data.eod_mask_loss=true",  # samples with different numbers of loss tokens
            f"training.max_steps={steps}",
            f"training.num_microbatches={M}",
            "training.warmup_steps=1",
        ],
    )
    mbs = cfg.training.micro_batch_size
    engine = build_engine(cfg)
    tasks = []
    for i in range(M):
        bounds = [0, *cuts.get(i, ()), mbs]
        if len(bounds) == 2:
            tasks.append(MicroBatchTask(0, i))
        else:
            tasks += [MicroBatchTask(0, i, samples=s) for s in zip(bounds, bounds[1:])]
    plan = RankStepPlan(
        tasks=tuple(tasks), num_replicas=1, microbatches_per_replica=M, micro_batch_size=mbs
    )
    out = {"losses": [], "grads": None, "samples": []}
    for step in range(steps):
        res = engine.train_step(step, plan)
        out["losses"].append(res.loss)
        out["samples"].append((res.global_samples, res.global_microbatches))
        if step == 0:
            out["grads"] = {
                n: p.main_grad.detach().clone() for n, p in engine.ddp.module.named_parameters()
            }
    out["params"] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.close()
    return out


@pytest.mark.timeout(150)
def test_sliced_micro_batches_give_the_whole_micro_batches_step(demo_data_dir):
    steps = 3
    (whole,) = run_distributed(_engine_worker, 1, demo_data_dir, {}, steps, timeout_s=120)
    (sliced,) = run_distributed(
        _engine_worker, 1, demo_data_dir, {0: (1, 5), 1: (3,)}, steps, timeout_s=120
    )
    assert sliced["samples"] == whole["samples"] == [(2 * 8, 2)] * steps
    torch.testing.assert_close(
        torch.tensor(sliced["losses"]), torch.tensor(whole["losses"]), rtol=1e-5, atol=0
    )
    for name, g in whole["grads"].items():
        torch.testing.assert_close(sliced["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)
    # Adam normalises each gradient entry: where one is ~1e-9, summation order alone moves its
    # update by a few % of lr (3e-3), so parameters agree to ~1e-5 after 3 steps, not to 1e-7
    for name, p in whole["params"].items():
        torch.testing.assert_close(sliced["params"][name], p, rtol=1e-4, atol=5e-5, msg=name)


SAMPLE_SPREAD = ("mecefo.takeover_policy=spread", "mecefo.takeover_granularity=sample")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_spread_at_sample_granularity_equals_failure_free(tmp_path, demo_data_dir):
    steps, mbs, replicas = 40, 4, 4  # tests/helpers/launch.py runs micro-batches of 4
    ref = launch(tmp_path, demo_data_dir, steps=steps, overrides=SAMPLE_SPREAD, name="ref")
    assert ref.returncode == 0, ref.explain()
    assert ref.summary()["failover"]["failures"] == 0
    res = launch(
        tmp_path,
        demo_data_dir,
        steps=steps,
        inject=("kill:2:5:3",),
        overrides=SAMPLE_SPREAD,
        launch_args=("--warm-spares", "1"),  # the restarted rank rejoins before the end
    )
    assert res.returncode == 0, res.explain()
    assert [m["step"] for m in res.metrics()] == list(range(steps)), res.explain()
    fo = res.summary()["failover"]
    assert fo["samples_lost"] == 0 and fo["failures"] >= 1 and fo["rejoins"] >= 1, fo
    # 8 orphaned samples over 3 survivors: 3, 3, 2 as slices, logged with their sample ranges
    sliced_steps = {step for step, task in _task_rows(res) if len(task) == 5}
    assert sliced_steps and min(sliced_steps) >= 5, sliced_steps  # from the failure on
    seen = Counter(res.committed_samples())
    want = {
        (s, r, i, j)
        for s in range(steps)
        for r in range(replicas)
        for i in range(M)
        for j in range(mbs)
    }
    assert set(seen) == want, sorted(want ^ set(seen))[:10]
    assert max(seen.values()) == 1, [k for k, c in seen.items() if c > 1][:10]
    digests = res.state_digests()
    assert sorted(digests) == list(range(replicas))
    assert len({d["model"] for d in digests.values()}) == 1, digests
    assert len({d["optimizer"] for d in digests.values()}) == 1, digests
    # the same global batch with exact gradients: the failure-free curve up to reduction order
    # (a lost or doubled sample, or a slice weighted as a whole micro-batch, moves it by ~1e-2)
    want_loss, got = ref.losses(), res.losses()
    for step in range(steps):
        assert got[step] == pytest.approx(want_loss[step], rel=2e-5, abs=1e-6), step
    takeover = next(e for e in res.events() if e["type"] == "takeover")
    assert "dead [2]" in takeover["detail"], takeover


def _task_rows(res):
    return [(row["step"], task) for row in res.task_rows() for task in row["tasks"]]

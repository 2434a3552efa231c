"""Real megatron-core GPTModel training over gloo in spawned processes.

One spawned job per layout (startup dominates), each checking several properties:
- world 1 (M=4): the loss falls on the demo corpus over a few dozen steps;
- DP=2 (M=2 each): replicas hold bitwise-identical params, and the loss curve and final params equal
  the world-1 run with the same global batch (float tolerance: summation order differs);
- TP=2 (M=4): matches TP=1;
- PP=2 (M=4, 1F1B): every stage sees the world-1 losses, and the stages' parameters together are
  the world-1 parameters (the initialisation does not depend on the layout);
- the world-1 losses of the first steps equal recorded golden values.
"""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed

STEPS = 30
# Golden losses of the world-1 run (tiny model, demo corpus, seed 1234, 4 x 8 x 64 tokens per step),
# recorded on torch 2.13.0+cpu / megatron-core 0.16.1. A change here means the model, data, init,
# optimizer or schedule changed: update deliberately, never to make a test pass. Last update
# (issue 26): biases and 1-D parameters (norms) are no longer weight-decayed: megatron's
# `wd_mult` = 0 was never applied, because megatron's scheduler applies it and we set the LR
# ourselves (`mcore/stack.set_lr`). Before: the initialisation became layout-independent.
GOLDEN_LOSSES = [6.25384, 6.21025, 6.1354, 6.0153, 5.92464, 5.76643, 5.68868, 5.55253]


def _train_worker(rank, demo_dir, overrides, steps):
    import torch

    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig
    from megatron_mecefo.training.engine import build_engine

    cfg = load_config(
        RunConfig,
        "configs/run/demo_cpu.yaml",
        [
            f"data.demo_dir={demo_dir}",
            f"training.max_steps={steps}",
            "training.warmup_steps=5",
            "training.eval_microbatches=4",
            *overrides,
        ],
    )
    engine = build_engine(cfg)
    losses = [engine.train_step(step).loss for step in range(steps)]
    val = engine.evaluate()
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    if engine.ctx.tp_size > 1:  # gather TP shards along their partition dim into full tensors
        import torch.distributed as dist

        full = {}
        for n, p in engine.model.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(p) for _ in range(engine.ctx.tp_size)]
                dist.all_gather(parts, p.detach().contiguous(), group=engine.ctx.tp_group)
                if n.endswith("linear_fc1.weight"):  # each shard is [gate_i; up_i] (SwiGLU)
                    halves = [t.chunk(2, dim=0) for t in parts]
                    parts = [h[0] for h in halves] + [h[1] for h in halves]
                full[n] = torch.cat(parts, dim=p.partition_dim)
            else:
                full[n] = p.detach().clone()
        params = full
    if engine.ctx.pp_size > 1:  # a stage's layers by their index in the whole model
        from megatron_mecefo.mcore.model import _global_name

        offset = engine.model.decoder.layers[0].layer_number - 1
        params = {_global_name(n, offset): p for n, p in params.items()}
    engine.close()
    return {"losses": losses, "val": val, "params": params}


@pytest.fixture(scope="module")
def demo_dir(demo_data_dir):
    return demo_data_dir


@pytest.fixture(scope="module")
def single(demo_dir):
    return run_distributed(_train_worker, 1, demo_dir, ["training.num_microbatches=4"], STEPS)[0]


@pytest.mark.timeout(240)
def test_single_process_loss_falls(single):
    losses = single["losses"]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    assert single["val"] < losses[0]


@pytest.mark.timeout(240)
def test_golden_losses(single):
    import torch

    got = torch.tensor(single["losses"][: len(GOLDEN_LOSSES)])
    torch.testing.assert_close(got, torch.tensor(GOLDEN_LOSSES), rtol=0, atol=2e-3)


@pytest.mark.timeout(300)
def test_dp2_matches_single_and_replicas_identical(demo_dir, single):
    r0, r1 = run_distributed(_train_worker, 2, demo_dir, ["training.num_microbatches=2"], STEPS)
    for name, p in r0["params"].items():
        assert r1["params"][name].equal(p), f"replicas diverged at {name}"
    assert r0["losses"] == r1["losses"]
    import torch

    torch.testing.assert_close(
        torch.tensor(r0["losses"]), torch.tensor(single["losses"]), rtol=1e-4, atol=1e-4
    )
    for name, p in single["params"].items():
        torch.testing.assert_close(r0["params"][name], p, rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(300)
def test_tp2_matches_tp1(demo_dir, single):
    import torch

    r0, r1 = run_distributed(
        _train_worker,
        2,
        demo_dir,
        ["training.num_microbatches=4", "parallel.tensor_model_parallel_size=2"],
        STEPS,
    )
    assert r0["losses"] == r1["losses"]
    torch.testing.assert_close(
        torch.tensor(r0["losses"]), torch.tensor(single["losses"]), rtol=1e-4, atol=1e-4
    )
    for name, p in single["params"].items():
        torch.testing.assert_close(r0["params"][name], p, rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(240)
def test_pipeline_parallel_matches_one_stage(single, demo_dir):
    import torch

    overrides = ["training.num_microbatches=4", "parallel.pipeline_model_parallel_size=2"]
    stages = run_distributed(_train_worker, 2, demo_dir, overrides, STEPS)
    for stage in stages:  # the last stage's loss, broadcast to the first
        torch.testing.assert_close(
            torch.tensor(stage["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0
        )
        assert stage["val"] == pytest.approx(single["val"], rel=1e-5)
    first, last = stages[0]["params"], stages[1]["params"]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert set(first) | set(last) == set(single["params"]) and not set(first) & set(last)
    for name, p in {**first, **last}.items():
        torch.testing.assert_close(p, single["params"][name], rtol=1e-4, atol=1e-6, msg=name)

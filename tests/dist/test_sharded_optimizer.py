"""The distributed optimizer (`training.use_distributed_optimizer`) against megatron's replicated
one, in real processes over gloo: the same layout trains once with each (one job, two engines
on the same parallel state), and losses and parameters must agree bit for bit (the sharded
update repeats torch AdamW's arithmetic element for element; the norm is megatron's).
"""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed

STEPS = 6


def _full_params(engine):
    """This rank's parameters, TP shards gathered along their partition dim."""
    import torch
    import torch.distributed as dist

    out = {}
    for n, p in engine.model.named_parameters():
        if engine.ctx.tp_size > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(p) for _ in range(engine.ctx.tp_size)]
            dist.all_gather(parts, p.detach().contiguous(), group=engine.ctx.tp_group)
            out[n] = torch.cat(parts, dim=p.partition_dim)
        else:
            out[n] = p.detach().clone()
    return out


def _both_worker(rank, demo_dir, overrides, steps):
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig
    from megatron_mecefo.mcore.parallel import init_parallel
    from megatron_mecefo.training.engine import build_engine

    out = {}
    ctx = None
    for sharded in (False, True):
        cfg = load_config(
            RunConfig,
            "configs/run/demo_cpu.yaml",
            [
                f"data.demo_dir={demo_dir}",
                f"training.max_steps={steps}",
                "training.warmup_steps=2",
                f"training.use_distributed_optimizer={str(sharded).lower()}",
                *overrides,
            ],
        )
        ctx = ctx or init_parallel(cfg.parallel)
        engine = build_engine(cfg, ctx)
        results = [engine.train_step(step) for step in range(steps)]
        out[sharded] = {
            "losses": [r.loss for r in results],
            "norms": [r.grad_norm for r in results],
            "params": _full_params(engine),
        }
        if sharded:
            out["position"] = (engine.ctx.pp_rank, engine.ctx.tp_rank)
            opt = engine.optimizer
            out["held"] = sorted(opt.held)
            out["nbytes"] = opt.nbytes()
            out["numel"] = opt.layout.numel
            out["shard_lens"] = [opt.layout.shard_len(s) for s in range(opt.layout.num_shards)]
    engine.close()
    return out


def _assert_same(ranks):
    import torch

    for r in ranks:
        assert r[True]["losses"] == r[False]["losses"], (r[True]["losses"], r[False]["losses"])
        assert r[True]["norms"] == r[False]["norms"]
        for name, p in r[False]["params"].items():
            assert torch.equal(r[True]["params"][name], p), f"{name} differs"
    first = {}
    for r in ranks:  # the replicas of one (stage, TP rank) end with the same parameters
        ref = first.setdefault(r["position"], r[True]["params"])
        for name, p in r[True]["params"].items():
            assert torch.equal(ref[name], p), f"replicas differ at {name}"
    assert len(first) < len(ranks)


@pytest.mark.timeout(240)
def test_dp2_sharded_equals_replicated_and_holds_half(demo_data_dir):
    # a low clip so that every step clips (the coefficient's path is compared too)
    ranks = run_distributed(_both_worker, 2, demo_data_dir, ["training.clip_grad=0.05"], STEPS)
    _assert_same(ranks)
    assert min(ranks[0][False]["norms"]) > 0.05
    assert [r["held"] for r in ranks] == [[0], [1]]
    for rank, r in enumerate(ranks):  # 12 bytes (master + 2 moments) per element of its shard
        assert r["nbytes"] == 12 * r["shard_lens"][rank]
    assert sum(r["shard_lens"][i] for i, r in enumerate(ranks)) == ranks[0]["numel"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "overrides",
    [
        ["training.num_microbatches=1"],
        ["parallel.tensor_model_parallel_size=2"],
        ["parallel.pipeline_model_parallel_size=2", "training.num_microbatches=2"],
    ],
    ids=["dp4", "tp2xdp2", "pp2xdp2"],
)
def test_four_ranks_sharded_equals_replicated(demo_data_dir, overrides):
    ranks = run_distributed(_both_worker, 4, demo_data_dir, overrides, STEPS, timeout_s=280)
    _assert_same(ranks)
    dp = 4 if overrides[0].startswith("training") else 2
    assert {len(r["held"]) for r in ranks} == {1}
    assert len({tuple(r["held"]) for r in ranks}) == dp


def _decay_worker(rank, demo_dir, sharded):
    """One update from zero gradients: AdamW moves nothing but the decay."""

    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig
    from megatron_mecefo.mcore import stack
    from megatron_mecefo.training.engine import build_engine

    cfg = load_config(
        RunConfig,
        "configs/run/demo_cpu.yaml",
        [
            f"data.demo_dir={demo_dir}",
            "training.weight_decay=0.25",
            f"training.use_distributed_optimizer={str(sharded).lower()}",
        ],
    )
    engine = build_engine(cfg)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.ddp.zero_grad_buffer()
    stack.set_lr(engine.optimizer, 0.5, 0.25)
    engine.optimizer.step()
    after = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.close()
    return before, after


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_weight_decay_spares_norms_and_biases(demo_data_dir, sharded):
    import torch

    before, after = run_distributed(_decay_worker, 1, demo_data_dir, sharded)[0]
    decayed = kept = 0
    for name, p in before.items():
        if p.dim() == 1:  # norms and biases: wd_mult 0
            assert torch.equal(after[name], p), f"{name} was decayed"
            kept += 1
        else:
            torch.testing.assert_close(after[name], p * (1 - 0.5 * 0.25), rtol=1e-6, atol=0)
            decayed += 1
    assert kept and decayed

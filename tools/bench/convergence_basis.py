"""The convergence benchmark's basis study: the relative FFN weight-gradient error of each
low-rank basis after training, and the reduced-gradient error of each degraded set.

Imported by `convergence.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

from convergence_engine import build, train, union_plan
from convergence_summary import _stats


def basis_error(args, ctx) -> list[dict]:
    """Relative FFN weight-gradient error ||G - G V V^T|| / ||G|| per basis, after training."""
    import torch

    from megatron_mecefo.mecefo.lowrank import top_right_singular_vectors
    from megatron_mecefo.plan import MicroBatchTask, RankStepPlan

    run = train(args, ctx, None, "spread", ["mecefo.lowrank_basis=activation"], None)
    engine = run["engine"]
    print(f"  trained {args.steps} exact steps: val loss {run['val_loss']:.4f}", flush=True)
    layers = [layer for _, layer in engine.controller._layers]
    gen = torch.Generator().manual_seed(0)
    rows = []
    m = args.microbatches
    for batch_index in range(args.eval_microbatches // m):  # held out: the validation split
        engine.ddp.zero_grad_buffer()
        tasks = tuple(MicroBatchTask(0, batch_index * m + i) for i in range(m))
        plan = RankStepPlan(tasks=tasks, num_replicas=1, microbatches_per_replica=m)
        _accumulate_grads(engine, plan.tasks, sampler=engine.valid_sampler, step=0, loss_scale=1.0)
        for index, layer in enumerate(layers):
            hooks = layer.mecefo_hooks
            for label, weight, cache in (
                ("fc1", layer.mlp.linear_fc1.weight, hooks.v1_cache),
                ("fc2", layer.mlp.linear_fc2.weight, hooks.v2_cache),
            ):
                g = weight.main_grad.detach().double()
                n_in = g.shape[1]
                r = max(1, min(n_in, round(args.rank * n_in) if args.rank < 1 else int(args.rank)))
                bases = {
                    "weight_svd": top_right_singular_vectors(weight.detach(), r).double(),
                    "activation": top_right_singular_vectors(cache.stats.moment, r).double(),
                    "random": torch.linalg.qr(torch.randn(n_in, r, generator=gen).double())[0],
                    "best (SVD of G)": top_right_singular_vectors(g, r),
                }
                row = {"batch": batch_index, "layer": index, "linear": label, "rank": r}
                for name, v in bases.items():
                    row[name] = float((g - g @ v @ v.T).norm() / g.norm())
                rows.append(row)
    return rows


def _accumulate_grads(engine, tasks, *, sampler, step: int, loss_scale: float) -> None:
    """Forward/backward of `tasks` (each in its mode) into main_grad: no reduction, no update."""
    import functools

    from megatron_mecefo.mcore import stack

    fwd = functools.partial(engine._forward_step, sampler=sampler, step=step, loss_scale=loss_scale)
    saved = engine.tcfg.finalize_model_grads_func
    engine.tcfg.finalize_model_grads_func = None
    try:
        stack.forward_backward(
            engine.ddp,
            fwd,
            iter(tasks),
            num_microbatches=len(tasks),
            seq_length=engine.cfg.model.seq_length,
            micro_batch_size=engine.cfg.training.micro_batch_size,
        )
    finally:
        engine.tcfg.finalize_model_grads_func = saved
        engine.controller.set_degraded(False)


def grad_error(args, ctx) -> dict:
    """Relative squared error ||g_T - g||^2 / ||g||^2 of the group's reduced gradient g (all
    tasks exact) when the neighbour plan's degraded tasks use technique set T (with its masked
    averaging), on batches the training never saw; per set: mean and sd over batches."""
    from megatron_mecefo.plan import CostModel, candidate_techniques, make_step_plans

    run = train(args, ctx, None, "spread", [], None)
    engine = run["engine"]
    print(f"  trained {args.steps} exact steps: val loss {run['val_loss']:.4f}", flush=True)
    n, m = args.replicas, args.microbatches
    plans = make_step_plans(
        alive=[r for r in range(n) if r != 1],
        num_replicas=n,
        num_microbatches=m,
        policy="neighbor",
        cost=CostModel(),
    )
    tasks = union_plan(plans).tasks
    sets = candidate_techniques(engine.cfg.mecefo.techniques)
    errors = _set_errors(args, engine, tasks, sets)
    for spec in args.skip_layers:  # the sets with the attention skip, in a subset of the layers
        other = build(args, ctx, [f"mecefo.skip_attention_layers={spec}"])
        other.ddp.module.load_state_dict(engine.ddp.module.state_dict())  # the trained weights
        skipping = [t for t in sets if t.skip_attention_backward]
        for key, values in _set_errors(args, other, tasks, skipping).items():
            errors[f"{key}@{spec}"] = values
        del other
    share = sum(x.degraded for x in tasks) / (n * m)
    out = {"degraded_share": share, "val_loss": run["val_loss"], "sets": {}}
    for key, values in errors.items():
        out["sets"][key] = _stats(values)
        print(f"  {key:<24} relative squared gradient error {_stats(values)['mean']:.4f}")
    return out


def _set_errors(args, engine, tasks, sets) -> dict[str, list[float]]:
    """Per technique set, the relative squared gradient error on each unseen batch."""
    from megatron_mecefo.plan import MicroBatchTask

    n, m = args.replicas, args.microbatches
    exact = tuple(MicroBatchTask(t.source_dp_rank, t.micro_index) for t in tasks)
    errors: dict[str, list[float]] = {t.key: [] for t in sets}
    for k in range(args.grad_batches):
        step = args.steps + k  # past the trained steps: unseen data
        reference = _reduced_grad(engine, exact, n, m, step)
        for t in sets:
            plan_tasks = tuple(
                MicroBatchTask(x.source_dp_rank, x.micro_index, True, t) if x.degraded else x
                for x in tasks
            )
            computing = sum(not x.skips_attention for x in plan_tasks)
            masked = m / computing if t.skip_attention_backward and computing else None
            g = _reduced_grad(engine, plan_tasks, n, m, step, masked)
            errors[t.key].append(float((g - reference).pow(2).sum() / reference.pow(2).sum()))
    return errors


def _reduced_grad(engine, tasks, n, m, step, masked_scale=None):
    """The SUM-reduced gradient of `tasks` with the plan scaling (ordinary 1/n, masked
    parameters `masked_scale`), flattened; no optimizer step."""
    import torch

    from megatron_mecefo.plan import RankStepPlan

    engine.ddp.zero_grad_buffer()
    plan = RankStepPlan(tasks=tuple(tasks), num_replicas=n, microbatches_per_replica=m)
    sampler = engine._sampler_for(plan)  # serves all n replicas' micro-batches
    _accumulate_grads(engine, tasks, sampler=sampler, step=step, loss_scale=1.0 / m)
    parts = []
    for name, param in engine.ddp.module.named_parameters():
        scale = 1.0 / n
        if masked_scale is not None and engine.controller.is_masked_param(name):
            scale = masked_scale
        parts.append(param.main_grad.detach().double().flatten() * scale)
    return torch.cat(parts)


def summarize_basis(rows: list[dict]) -> dict:
    keys = ["weight_svd", "activation", "random", "best (SVD of G)"]
    out = {}
    for linear in ("fc1", "fc2", "all"):
        sel = [r for r in rows if linear == "all" or r["linear"] == linear]
        out[linear] = {k: sum(r[k] for r in sel) / len(sel) for k in keys}
    return out

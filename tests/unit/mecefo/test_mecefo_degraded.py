"""Degraded mode on the tiny megatron GPTModel (local spec, CPU): exactness, gradient placement,
saved activations, mode capture, V cache, and megatron DDP's main_grad."""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode
from megatron_mecefo.mecefo.memory import measure_saved_bytes

ALL_OFF = dict(skip_attention_backward=False, recompute_ffn=False, lowrank_ffn_grad=False)


def _loss(model, batch):
    tokens, pos, labels = batch
    return model(tokens, pos, attention_mask=None, labels=labels).float().mean()


def _fwd_bwd(model, batch):
    for p in model.parameters():
        p.grad = None
    loss = _loss(model, batch)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def _flat(grads, names):
    return torch.cat([grads[n].flatten() for n in names])


def test_exact_mode_is_bit_identical_to_unhooked(build_tiny, tiny_batch):
    ref_model, cfg = build_tiny()
    batch = tiny_batch(cfg)
    ref_loss, ref_grads = _fwd_bwd(ref_model, batch)
    model, _ = build_tiny()
    ctl = install_degraded_mode(model, MecefoConfig())
    assert not ctl.degraded
    for _ in range(2):  # also after a degraded micro-batch has run
        loss, grads = _fwd_bwd(model, batch)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
        ctl.set_degraded(True)
        _fwd_bwd(model, batch)
        ctl.set_degraded(False)


def test_all_techniques_off_degraded_equals_exact(build_tiny, tiny_batch):
    model, cfg = build_tiny()
    batch = tiny_batch(cfg)
    ctl = install_degraded_mode(model, MecefoConfig(**ALL_OFF))
    ref_loss, ref_grads = _fwd_bwd(model, batch)
    ctl.set_degraded(True)
    loss, grads = _fwd_bwd(model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    assert not any(ctl.is_masked_param(n) for n in grads)  # attention grads are computed


def test_degraded_skips_attention_grads_keeps_forward_value(build_tiny, tiny_batch):
    model, cfg = build_tiny()
    batch = tiny_batch(cfg)
    ctl = install_degraded_mode(model, MecefoConfig())
    exact_loss, _ = _fwd_bwd(model, batch)
    ctl.set_degraded(True)
    loss, grads = _fwd_bwd(model, batch)
    torch.testing.assert_close(loss, exact_loss)  # same forward math; only the backward changes
    masked = [n for n in grads if ctl.is_masked_param(n)]
    assert len(masked) == 3 * cfg.num_layers  # input norm, qkv, proj per layer
    for name, g in grads.items():
        if ctl.is_masked_param(name):
            assert g is None, name
        else:
            assert g is not None and g.abs().sum() > 0, name


def test_mode_is_captured_at_forward_time(build_tiny, tiny_batch):
    model, cfg = build_tiny()
    batch = tiny_batch(cfg)
    ctl = install_degraded_mode(model, MecefoConfig())
    ctl.set_degraded(True)
    loss = _loss(model, batch)
    ctl.set_degraded(False)  # the trainer switches before the next forward; this backward stays
    loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is None) == ctl.is_masked_param(name), name


@pytest.mark.parametrize("recompute", [True, False])
def test_saved_activation_bytes_drop(build_tiny, tiny_batch, recompute):
    model, cfg = build_tiny()
    batch = tiny_batch(cfg)
    ctl = install_degraded_mode(model, MecefoConfig(recompute_ffn=recompute))
    layers = list(model.decoder.layers)
    exact = measure_saved_bytes(layers, lambda: _loss(model, batch))
    ctl.set_degraded(True)
    degraded = measure_saved_bytes(layers, lambda: _loss(model, batch))
    tokens = batch[0].numel()
    r1, r2 = MecefoConfig().resolve_rank(cfg.hidden_size), MecefoConfig().resolve_rank(172)
    for i in range(cfg.num_layers):
        # degraded keeps only the FFN input [t, d] and the projections x V [t, r1], [t, r2] (fp32);
        # without recompute also the fc1 output [t, 2f] (the activation's input)
        fc1_out = 0 if recompute else 2 * cfg.ffn_hidden_size
        assert degraded[i] == 4 * tokens * (cfg.hidden_size + r1 + r2 + fc1_out)
        assert degraded[i] * (10 if recompute else 2) < exact[i]
    print(
        f"saved bytes per layer: exact {exact[0]}, degraded {degraded[0]} "
        f"({exact[0] / degraded[0]:.1f}x less)"
    )


def test_full_rank_reproduces_exact_ffn_gradients_on_the_model(build_tiny, tiny_batch):
    model, cfg = build_tiny()
    batch = tiny_batch(cfg)
    _, ref = _fwd_bwd(model, batch)
    ffn = [n for n in ref if ".mlp." in n]
    errors = {}
    for rank in (8, 16, 32, 64, 172):  # absolute r; fc1 (n = 64) clamps to 64 = n from r = 64
        model, _ = build_tiny()
        ctl = install_degraded_mode(
            model, MecefoConfig(skip_attention_backward=False, recompute_ffn=True, rank=rank)
        )
        ctl.set_degraded(True)
        _, grads = _fwd_bwd(model, batch)
        errors[rank] = (
            (_flat(grads, ffn) - _flat(ref, ffn)).norm() / _flat(ref, ffn).norm()
        ).item()
        other = [n for n in ref if n not in ffn]
        torch.testing.assert_close(_flat(grads, other), _flat(ref, other))  # exact elsewhere
        if rank == 172:  # r = n for both FFN linears
            for n in ffn:
                torch.testing.assert_close(grads[n], ref[n])
    values = list(errors.values())
    assert all(b < a for a, b in zip(values, values[1:])), errors
    print(f"relative FFN weight-grad error vs r on tiny (init weights): {errors}")


def test_default_degraded_mode_equals_its_definition(build_tiny, tiny_batch):
    """All three techniques at the default rank: every FFN weight gradient is the exact one
    (with the attention branch detached) projected on the cached basis, G_W V V^T; every other
    computed gradient is exact. The relative errors are printed, not bounded."""
    from tests.unit.mecefo.test_mecefo_math import _detach_attention_branch

    ref_model, cfg = build_tiny()
    for layer in ref_model.decoder.layers:
        _detach_attention_branch(layer)
    batch = tiny_batch(cfg, mbs=4)
    _, ref = _fwd_bwd(ref_model, batch)
    _, exact = _fwd_bwd(build_tiny()[0], batch)
    model, _ = build_tiny()
    ctl = install_degraded_mode(model, MecefoConfig())
    ctl.set_degraded(True)
    _, grads = _fwd_bwd(model, batch)
    ffn = [n for n in ref if ".mlp.linear_fc" in n]
    assert len(ffn) == 2 * cfg.num_layers
    for i in range(cfg.num_layers):
        v1, v2 = ctl.singular_vectors(i)
        for name, v in (
            (f"decoder.layers.{i}.mlp.linear_fc1.weight", v1),
            (f"decoder.layers.{i}.mlp.linear_fc2.weight", v2),
        ):
            assert v.shape == (ref[name].shape[1], MecefoConfig().resolve_rank(v.shape[0]))
            torch.testing.assert_close(grads[name], ref[name] @ v @ v.T, rtol=1e-4, atol=1e-8)
    unmasked = [n for n in ref if not ctl.is_masked_param(n)]
    for name in unmasked:
        if name not in ffn:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-7, msg=name)
    ffn_err = ((_flat(grads, ffn) - _flat(exact, ffn)).norm() / _flat(exact, ffn).norm()).item()
    all_err = (
        (_flat(grads, unmasked) - _flat(exact, unmasked)).norm() / _flat(exact, unmasked).norm()
    ).item()
    print(
        f"default r = d/8 vs exact: FFN weight-grad rel. error {ffn_err:.3f}, "
        f"all computed grads {all_err:.3f}"
    )


def test_singular_vectors_refresh_every_tau_and_are_deterministic(build_tiny, tiny_batch):
    model_a, cfg = build_tiny()
    model_b, _ = build_tiny()
    batch = tiny_batch(cfg)
    ctls = [install_degraded_mode(m, MecefoConfig(tau=3)) for m in (model_a, model_b)]
    for ctl in ctls:
        ctl.on_step_start(0)
        assert ctl.singular_vectors(0) == (None, None)  # lazy: nothing before degraded use
        ctl.set_degraded(True)
    for m in (model_a, model_b):
        _loss(m, batch)
    v_a, v_b = ctls[0].singular_vectors(1), ctls[1].singular_vectors(1)
    assert torch.equal(v_a[0], v_b[0]) and torch.equal(v_a[1], v_b[1])  # same W -> same V
    with torch.no_grad():
        model_a.decoder.layers[1].mlp.linear_fc1.weight.mul_(torch.linspace(0.5, 2.0, 64))
    for step, fresh in ((2, False), (3, True)):
        ctls[0].on_step_start(step)
        _loss(model_a, batch)
        assert (ctls[0].singular_vectors(1)[0] is not v_a[0]) == fresh
    ctls[0].clear_caches()
    assert ctls[0].singular_vectors(1) == (None, None)


def test_disabled_installs_nothing_and_refuses_degraded(build_tiny):
    model, _ = build_tiny()
    ctl = install_degraded_mode(model, MecefoConfig(enabled=False))
    assert all("forward" not in vars(layer) for layer in model.decoder.layers)
    ctl.set_degraded(False)
    with pytest.raises(ConfigError, match="mecefo.enabled=false"):
        ctl.set_degraded(True)
    assert not ctl.degraded


def test_masked_param_names_and_uninstall(build_tiny):
    model, _ = build_tiny()
    ctl = install_degraded_mode(model, MecefoConfig())
    with pytest.raises(ValueError, match="already installed"):
        install_degraded_mode(model, MecefoConfig())
    assert ctl.is_masked_param("module.module.decoder.layers.0.self_attention.linear_qkv.weight")
    assert ctl.is_masked_param("decoder.layers.3.input_layernorm.weight")
    assert ctl.is_masked_param(
        "module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )
    assert not ctl.is_masked_param("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")  # TE
    assert not ctl.is_masked_param("decoder.layers.0.pre_mlp_layernorm.weight")
    assert not ctl.is_masked_param("decoder.final_layernorm.weight")
    assert not ctl.is_masked_param("embedding.word_embeddings.weight")
    ctl.uninstall()
    assert all("forward" not in vars(layer) for layer in model.decoder.layers)
    install_degraded_mode(model, MecefoConfig())  # can be installed again


def test_megatron_ddp_main_grad_path(build_tiny, tiny_batch):
    """Under megatron DDP the low-rank FFN grads go straight into main_grad (no double count) and
    the attention grads stay zero; the result equals the plain-autograd degraded gradients."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ref_model, cfg = build_tiny()
    batch = tiny_batch(cfg)
    ref_ctl = install_degraded_mode(ref_model, MecefoConfig())
    ref_ctl.set_degraded(True)
    _, ref = _fwd_bwd(ref_model, batch)
    _, ref2 = _fwd_bwd(ref_model, tiny_batch(cfg, seed=1))

    model, _ = build_tiny()
    ddp = DistributedDataParallel(
        config=model.config, ddp_config=DistributedDataParallelConfig(), module=model
    )
    ctl = install_degraded_mode(ddp, MecefoConfig())
    ctl.set_degraded(True)
    ddp.zero_grad_buffer()
    _loss(ddp, batch).backward()
    _loss(ddp, tiny_batch(cfg, seed=1)).backward()  # gradient accumulation over 2 micro-batches
    for name, p in ddp.named_parameters():
        short = name.removeprefix("module.")
        if ctl.is_masked_param(name):
            assert p.main_grad.abs().sum() == 0, name
        else:
            torch.testing.assert_close(p.main_grad, ref[short] + ref2[short], msg=name)
        assert p.grad is None, name


def test_activation_basis_collects_exact_inputs_once_per_step(build_tiny, tiny_batch):
    """activation basis on the model: the first exact, grad-building micro-batch of each step feeds
    E[x x^T] of linear_fc1 (the normed FFN input) and linear_fc2 (the SwiGLU output); degraded and
    no-grad forwards do not; once ready, V is the moment's top eigenvectors."""
    model, cfg = build_tiny()
    tokens = 256  # = all tokens of one 4 x 64 micro-batch: no sub-sampling, easy to recompute
    ctl = install_degraded_mode(
        model, MecefoConfig(lowrank_basis="activation", activation_stats_tokens=tokens, tau=2)
    )
    layer = model.decoder.layers[1]
    seen = {}
    handles = [
        layer.mlp.linear_fc1.register_forward_pre_hook(lambda m, a: seen.setdefault("fc1", a[0])),
        layer.mlp.linear_fc2.register_forward_pre_hook(lambda m, a: seen.setdefault("fc2", a[0])),
    ]
    stats1 = layer.mecefo_hooks.v1_cache.stats
    stats2 = layer.mecefo_hooks.v2_cache.stats
    ctl.on_step_start(0)
    _loss(model, tiny_batch(cfg, mbs=4, seed=0))
    _loss(model, tiny_batch(cfg, mbs=4, seed=1))  # second micro-batch of the step: not collected
    for h in handles:
        h.remove()
    assert stats1.updates == stats2.updates == 1
    for stats, key in ((stats1, "fc1"), (stats2, "fc2")):
        x = seen[key].detach().reshape(-1, seen[key].shape[-1])
        torch.testing.assert_close(stats.moment, x.T @ x / x.shape[0])
    with torch.no_grad():  # evaluation
        ctl.on_step_start(1)
        _loss(model, tiny_batch(cfg, seed=2))
    ctl.set_degraded(True)  # degraded micro-batches do not run the FFN modules
    _loss(model, tiny_batch(cfg, seed=3))
    assert stats1.updates == stats2.updates == 1
    # 256 tokens >= d = 64 (fc1) and >= f = 172 (fc2): both ready, V = top eigenvectors
    assert ctl.basis_sources()[1] == ("activation", "activation")
    assert ctl.basis_sources()[0] == ("activation", "activation")
    v1, v2 = ctl.singular_vectors(1)
    for v, stats in ((v1, stats1), (v2, stats2)):
        evals, evecs = torch.linalg.eigh(stats.moment.double())
        top = evecs[:, -v.shape[1] :]
        assert evals[-v.shape[1] - 1] < evals[-v.shape[1]]  # distinct: the subspace is unique
        torch.testing.assert_close((v @ v.T).double(), top @ top.T, atol=1e-4, rtol=0)
    ctl.clear_caches()
    assert stats1.moment is None and ctl.basis_sources()[1] == (None, None)
    ctl.uninstall()
    assert not layer.mlp.linear_fc1._forward_pre_hooks


def test_weight_svd_basis_collects_nothing(build_tiny, tiny_batch):
    model, cfg = build_tiny()
    ctl = install_degraded_mode(model, MecefoConfig(lowrank_basis="weight_svd"))
    assert model.decoder.layers[0].mecefo_hooks.v1_cache.stats is None
    assert not model.decoder.layers[0].mlp.linear_fc1._forward_pre_hooks
    ctl.set_degraded(True)
    _loss(model, tiny_batch(cfg))
    assert ctl.basis_sources() == [("weight_svd", "weight_svd")] * cfg.num_layers


@pytest.mark.parametrize("modes", [(True, False), (False, True)])
def test_megatron_ddp_mixed_exact_and_degraded_microbatches(build_tiny, tiny_batch, modes):
    """A rank that runs exact and degraded micro-batches in one step (hybrid, or a covering rank
    whose taken-over micro-batches come first) accumulates both kinds of FFN weight gradient:
    the degraded one written straight into main_grad must not make megatron's DDP hook drop the
    exact one that follows (`grad_added_to_main_grad` stays set until the next step)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ref_model, cfg = build_tiny()
    ref_ctl = install_degraded_mode(ref_model, MecefoConfig())
    expected = {}
    for seed, degraded in enumerate(modes):
        ref_ctl.set_degraded(degraded)
        _, grads = _fwd_bwd(ref_model, tiny_batch(cfg, seed=seed))
        for n, g in grads.items():
            expected[n] = expected.get(n, 0) + (0 if g is None else g)
    model, _ = build_tiny()
    ddp = DistributedDataParallel(
        config=model.config, ddp_config=DistributedDataParallelConfig(), module=model
    )
    ctl = install_degraded_mode(ddp, MecefoConfig())
    ddp.zero_grad_buffer()
    for seed, degraded in enumerate(modes):
        ctl.set_degraded(degraded)
        _loss(ddp, tiny_batch(cfg, seed=seed)).backward()
    for name, p in ddp.named_parameters():
        torch.testing.assert_close(p.main_grad, expected[name.removeprefix("module.")], msg=name)


def test_activation_statistics_are_sampled_every_interval_steps_only(build_tiny, tiny_batch):
    """Failure-free ranks pay the sampling cost on 1 step in `activation_stats_interval`."""
    model, cfg = build_tiny()
    ctl = install_degraded_mode(
        model, MecefoConfig(lowrank_basis="activation", activation_stats_interval=3, tau=50)
    )
    stats = model.decoder.layers[0].mecefo_hooks.v1_cache.stats
    updates = []
    for step in range(7):
        ctl.on_step_start(step)
        _loss(model, tiny_batch(cfg, mbs=4, seed=step))
        updates.append(stats.updates)
    assert updates == [1, 1, 1, 2, 2, 2, 3]  # steps 0, 3 and 6

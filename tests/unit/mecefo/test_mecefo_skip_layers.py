"""Finer degradation: `mecefo.skip_attention_layers` skips attention backward in a subset of layers.

The config forms and their errors; gradient placement on the tiny model (skipped layers produce no
attention grads, the others the exact-mode ones given the layers above); and `is_masked_param`
marking exactly the skipped layers' attention-branch parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode
from tests.unit.mecefo.test_mecefo_degraded import _fwd_bwd
from tests.unit.mecefo.test_mecefo_math import _detach_attention_branch

DEMO_RUN = Path(__file__).resolve().parents[3] / "configs" / "run" / "demo_cpu.yaml"
ATTENTION = ("input_layernorm.weight", "self_attention.linear_qkv.weight")


def _attention_names(layer: int) -> list[str]:
    """The tiny local-spec model's attention-branch parameters of one layer."""
    prefix = f"decoder.layers.{layer}."
    return [prefix + s for s in (*ATTENTION, "self_attention.linear_proj.weight")]


@pytest.mark.parametrize(
    "spec, num_layers, expected",
    [
        ("all", 3, {0, 1, 2}),
        ("first:1", 3, {0}),
        ("first:3", 3, {0, 1, 2}),
        ("last:2", 3, {1, 2}),
        ("every:2", 5, {0, 2, 4}),
        ("every:1", 2, {0, 1}),
        ("2", 3, {2}),
        ("0, 2,5", 6, {0, 2, 5}),
        (" LAST:1 ", 4, {3}),
        ("last:75%", 8, {2, 3, 4, 5, 6, 7}),
        ("last:75%", 2, {0, 1}),  # ceil: a 2-layer model skips both
        ("last:75%", 4, {1, 2, 3}),
        ("first:50%", 8, {0, 1, 2, 3}),
        ("last:1%", 8, {7}),  # at least one layer
        ("last:100%", 3, {0, 1, 2}),
    ],
)
def test_skip_attention_layers_forms(spec, num_layers, expected):
    assert MecefoConfig(skip_attention_layers=spec).skip_layer_indices(num_layers) == expected


@pytest.mark.parametrize(
    "spec, match",
    [
        ("none", "skip_attention_backward=false"),
        ("last:0%", "share"),
        ("last:150%", "share"),
        ("every:50%", "first:K"),
        ("first:0", "first:K"),
        ("last:-1", "first:K"),
        ("middle:2", "first:K"),
        ("every:", "first:K"),
        ("1,,2", "comma list"),
        ("1,x", "comma list"),
        ("", "comma list"),
        ("-1", "comma list"),
        ("1,1", "listed twice"),
    ],
)
def test_skip_attention_layers_syntax_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        MecefoConfig(skip_attention_layers=spec)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("first:3", "K = 3 exceeds the model's 2 transformer layers; use `all`"),
        ("last:4", "K = 4 exceeds"),
        ("every:3", "K = 3 exceeds"),
        ("0,2", "layer index 2 out of range, the model has 2 transformer layers"),
    ],
)
def test_skip_attention_layers_out_of_range(spec, match):
    with pytest.raises(ValueError, match=match):
        MecefoConfig(skip_attention_layers=spec).skip_layer_indices(2)


def test_skip_attention_layers_from_the_run_config():
    from megatron_mecefo.config.loader import load_config
    from megatron_mecefo.config.run import RunConfig

    def load(value):
        return load_config(RunConfig, DEMO_RUN, [f"mecefo.skip_attention_layers={value}"]).mecefo

    assert MecefoConfig().skip_attention_layers == "last:75%"  # the measured default
    assert load("last:1").skip_attention_layers == "last:1"
    assert load("0,1").skip_layer_indices(2) == {0, 1}
    assert load("1").skip_attention_layers == "1"  # YAML reads an integer: taken as the index
    with pytest.raises(ConfigError, match=r"mecefo: .*'none'.*skip_attention_backward=false"):
        load("none")
    with pytest.raises(ConfigError, match=r"mecefo: .*expected 'all', 'first:K'"):
        load("some")


def test_install_refuses_a_layer_the_model_lacks(build_tiny):
    model, _ = build_tiny()
    with pytest.raises(ConfigError, match="layer index 2 out of range"):
        install_degraded_mode(model, MecefoConfig(skip_attention_layers="1,2"))
    assert all(not hasattr(layer, "mecefo_hooks") for layer in model.decoder.layers)


@pytest.mark.parametrize(
    "spec, num_layers, skipped",
    [("last:1", 2, {1}), ("first:1", 2, {0}), ("every:2", 3, {0, 2}), ("1", 3, {1})],
)
def test_masked_params_are_the_skipped_layers_attention_params(
    build_tiny, tiny_batch, spec, num_layers, skipped
):
    """is_masked_param marks exactly the attention-branch params that a degraded micro-batch
    leaves without a gradient: those of the skipped layers (with or without wrapper prefixes)."""
    model, cfg = build_tiny(num_layers=num_layers)
    ctl = install_degraded_mode(model, MecefoConfig(skip_attention_layers=spec))
    assert ctl.skip_layer_indices == skipped
    ctl.set_degraded(True)
    _, grads = _fwd_bwd(model, tiny_batch(cfg))
    expected = {n for i in sorted(skipped) for n in _attention_names(i)}
    assert {n for n, g in grads.items() if g is None} == expected
    for name in grads:
        assert ctl.is_masked_param(name) == (name in expected), name
        assert ctl.is_masked_param("module.module." + name) == (name in expected), name
    # the other layers' attention params are ordinary: every micro-batch computes their grads
    kept = [n for i in range(num_layers) if i not in skipped for n in _attention_names(i)]
    assert kept and not any(ctl.is_masked_param(n) for n in kept)
    with pytest.raises(ValueError, match="no hooked transformer layer"):
        ctl.is_masked_param(f"decoder.layers.{num_layers}.self_attention.linear_qkv.weight")
    assert not ctl.is_masked_param("decoder.final_layernorm.weight")


def test_skip_off_masks_nothing_whatever_the_layers(build_tiny):
    model, _ = build_tiny()
    ctl = install_degraded_mode(
        model, MecefoConfig(skip_attention_backward=False, skip_attention_layers="last:1")
    )
    assert ctl.skip_layer_indices == frozenset()
    assert not ctl.is_masked_param("decoder.layers.1.self_attention.linear_qkv.weight")


def test_first_layer_skipped_last_layer_attention_grads_are_exact(build_tiny, tiny_batch):
    """first:1 on 2 layers: nothing above layer 1's attention is approximated in the backward
    (its FFN's input grads are exact under low-rank), so its attention grads equal exact mode's;
    layer 0's attention gets none."""
    model, cfg = build_tiny()
    batch = tiny_batch(cfg, mbs=4)
    ctl = install_degraded_mode(model, MecefoConfig(skip_attention_layers="first:1"))
    _, exact = _fwd_bwd(model, batch)
    ctl.set_degraded(True)
    _, grads = _fwd_bwd(model, batch)
    for name in _attention_names(1):
        assert grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grads[name], exact[name], rtol=1e-4, atol=1e-7, msg=name)
    assert all(grads[n] is None for n in _attention_names(0))


def test_last_layer_skipped_first_layer_attention_grads_follow_the_skip(build_tiny, tiny_batch):
    """last:1 on 2 layers: layer 1's attention gets no grads; layer 0's attention grads are the
    exact ones of a model whose layer-1 attention branch is detached (the gradient reaching layer
    0 bypasses layer 1's attention), which differ from exact mode's."""
    ref_model, cfg = build_tiny()
    _detach_attention_branch(ref_model.decoder.layers[1])
    batch = tiny_batch(cfg, mbs=4)
    _, ref = _fwd_bwd(ref_model, batch)
    model, _ = build_tiny()
    ctl = install_degraded_mode(model, MecefoConfig(skip_attention_layers="last:1"))
    _, exact = _fwd_bwd(model, batch)
    ctl.set_degraded(True)
    _, grads = _fwd_bwd(model, batch)
    assert all(grads[n] is None for n in _attention_names(1))
    for name in _attention_names(0):
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-7, msg=name)
        assert (grads[name] - exact[name]).norm() > 1e-3 * exact[name].norm(), name


def test_every_layer_listed_equals_all_bit_for_bit(build_tiny, tiny_batch):
    """A list naming every layer is `all`: same degraded gradients, same masked params."""
    results = []
    for spec in ("all", "0,1"):
        model, cfg = build_tiny()
        ctl = install_degraded_mode(model, MecefoConfig(skip_attention_layers=spec))
        ctl.set_degraded(True)
        loss, grads = _fwd_bwd(model, tiny_batch(cfg))
        results.append((loss, grads, {n for n in grads if ctl.is_masked_param(n)}))
    (loss_a, grads_a, masked_a), (loss_b, grads_b, masked_b) = results
    assert torch.equal(loss_a, loss_b) and masked_a == masked_b and len(masked_a) == 6
    for name, g in grads_a.items():
        assert (g is None and grads_b[name] is None) or torch.equal(g, grads_b[name]), name


def test_only_skip_active_on_a_kept_layer_runs_its_original_forward(build_tiny, tiny_batch):
    """Skip the only active technique and the layer not in the set: degraded == exact for it, so
    it calls megatron's forward unchanged (bit-identical)."""
    model, cfg = build_tiny()
    flags = dict(skip_attention_backward=True, recompute_ffn=False, lowrank_ffn_grad=False)
    ctl = install_degraded_mode(model, MecefoConfig(**flags, skip_attention_layers="last:1"))
    hooks = [layer.mecefo_hooks for layer in model.decoder.layers]
    ctl.set_degraded(True)
    assert [h.is_noop for h in hooks] == [True, False]
    ref_model, _ = build_tiny()
    _detach_attention_branch(ref_model.decoder.layers[1])
    batch = tiny_batch(cfg)
    _, ref = _fwd_bwd(ref_model, batch)
    _, grads = _fwd_bwd(model, batch)
    for name, g in grads.items():
        if g is None:
            assert name in _attention_names(1)
        else:
            torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-7, msg=name)

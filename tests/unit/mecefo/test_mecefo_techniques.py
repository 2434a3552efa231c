"""A plan's per-micro-batch technique set reaches the degraded-mode controller: running a subset
of the installed techniques equals a model installed with exactly that subset (bit-identical)."""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode
from megatron_mecefo.plan import ALL_TECHNIQUES, DegradedTechniques, candidate_techniques


def _grads(model, batch):
    for p in model.parameters():
        p.grad = None
    tokens, pos, labels = batch
    loss = model(tokens, pos, attention_mask=None, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


ALL_ON = dict(skip_attention_backward=True, recompute_ffn=True, lowrank_ffn_grad=True)


@pytest.mark.parametrize("techniques", candidate_techniques(ALL_TECHNIQUES), ids=lambda t: t.key)
def test_plan_techniques_equal_a_model_installed_with_them(build_tiny, tiny_batch, techniques):
    model, cfg = build_tiny()
    batch = tiny_batch(cfg)
    ctl = install_degraded_mode(model, MecefoConfig(**ALL_ON))
    ref_model, _ = build_tiny()
    flags = {n: getattr(techniques, n) for n in ALL_ON}
    ref_ctl = install_degraded_mode(ref_model, MecefoConfig(**flags))
    ref_ctl.set_degraded(True)
    ref_loss, ref_grads = _grads(ref_model, batch)
    ctl.set_degraded(True, techniques)
    loss, grads = _grads(model, batch)
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert (g is None) == (grads[name] is None), name
        assert g is None or torch.equal(g, grads[name]), name
    # attention grads exist exactly when the skip is off
    attn = [n for n in grads if "self_attention" in n]
    assert all((grads[n] is None) == techniques.skip_attention_backward for n in attn)
    ctl.set_degraded(False)  # back to exact: the installed set is active again
    assert model.decoder.layers[0].mecefo_hooks.active == ALL_TECHNIQUES


def test_techniques_not_installed_are_refused(build_tiny):
    model, _ = build_tiny()
    ctl = install_degraded_mode(model, MecefoConfig(recompute_ffn=False))
    with pytest.raises(ConfigError, match="recompute"):
        ctl.set_degraded(True, DegradedTechniques(True, True, False))
    ctl.set_degraded(True, DegradedTechniques(False, False, True))  # a subset: fine
    assert ctl.degraded

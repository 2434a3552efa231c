"""Tests that fail when degraded-mode math is wrong: the gradient the attention skip hands to the
residual, and masked averaging in `PlanGradReducer` on real megatron DDP grad buffers."""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode
from megatron_mecefo.mecefo.masking import is_attention_branch_param

SKIP_ONLY = dict(skip_attention_backward=True, recompute_ffn=False, lowrank_ffn_grad=False)


def _loss(model, batch):
    tokens, pos, labels = batch
    return model(tokens, pos, attention_mask=None, labels=labels).float().mean()


def _grads(model, batch):
    for p in model.parameters():
        p.grad = None
    _loss(model, batch).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _detach_attention_branch(layer):
    """Reference skip, written independently of `_ResidualOnly`: h' = h + (Attn(LN1(h))).detach()
    as `h + (h' - h).detach()`, so d h'/d h is the identity and the branch gets no gradient."""
    original = layer._forward_attention

    def forward_attention(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        out, context = original(*args, **kwargs)
        return hidden + (out - hidden).detach(), context

    layer._forward_attention = forward_attention


def test_attention_skip_passes_the_unscaled_gradient_to_the_residual(build_tiny, tiny_batch):
    """Every gradient degraded mode computes (embedding, FFNs, norms, head) equals the one of a
    model whose attention branch is detached: a wrong scale on the residual gradient (x2, x0.5,
    0) changes the embedding and layer-0 FFN gradients by O(1)."""
    ref_model, cfg = build_tiny()
    for layer in ref_model.decoder.layers:
        _detach_attention_branch(layer)
    batch = tiny_batch(cfg, mbs=4)
    ref = _grads(ref_model, batch)
    model, _ = build_tiny()
    ctl = install_degraded_mode(model, MecefoConfig(**SKIP_ONLY))
    ctl.set_degraded(True)
    got = _grads(model, batch)
    checked = 0
    for name, g in got.items():
        if ctl.is_masked_param(name):
            assert g is None and ref[name] is None, name
            continue
        torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-7, msg=name)
        checked += 1
    assert checked == len(got) - 3 * cfg.num_layers
    # the check has teeth: the detached branch changes the embedding gradient substantially
    exact = _grads(build_tiny()[0], batch)
    emb = "embedding.word_embeddings.weight"
    assert (exact[emb] - ref[emb]).norm() > 0.05 * exact[emb].norm()


class _RecordingMembership:
    """Stands in for a one-member DP group: records what each all-reduce receives."""

    failed = None

    def __init__(self):
        self.reduced: list[torch.Tensor] = []

    def all_reduce(self, tensor):
        self.reduced.append(tensor.detach().clone())
        return True


def _ddp_with_grads(build_tiny, tiny_batch, mecefo_cfg: MecefoConfig | None = None):
    """Tiny model under megatron DDP with one exact and one degraded micro-batch accumulated in
    its contiguous grad buffers (what a covering hybrid rank holds before the reduction)."""
    from megatron_mecefo.mcore import stack

    model, cfg = build_tiny()
    ctl = install_degraded_mode(model, mecefo_cfg or MecefoConfig())
    ddp = stack.wrap_ddp(model, model.config)
    ddp.zero_grad_buffer()
    for seed, degraded in ((0, False), (1, True)):
        ctl.set_degraded(degraded)
        _loss(ddp, tiny_batch(cfg, seed=seed)).backward()
    ctl.set_degraded(False)
    return ddp, ctl, cfg


@pytest.mark.parametrize("masked_scale", [0.7, 0.0])  # M/E with E > 0, and E = 0 (all degraded)
def test_plan_grad_reducer_masks_attention_grads_in_megatron_buffers(
    build_tiny, tiny_batch, masked_scale
):
    from megatron_mecefo.mcore.stack import PlanGradReducer

    ddp, ctl, cfg = _ddp_with_grads(build_tiny, tiny_batch)
    named = dict(ddp.module.named_parameters())
    before = {n: p.main_grad.detach().clone() for n, p in named.items()}
    masked = {n for n in named if is_attention_branch_param(n)}
    assert len(masked) == 3 * cfg.num_layers
    assert all(before[n].abs().sum() > 0 for n in named)  # the exact micro-batch fed every param
    membership = _RecordingMembership()
    reducer = PlanGradReducer(ddp, membership, ctl.is_masked_param)
    grad_scale = 0.25  # 1/n, n = 4
    reducer.set_scales(grad_scale, masked_scale)
    reducer()
    for name, p in named.items():
        scale = masked_scale if name in masked else grad_scale
        torch.testing.assert_close(p.main_grad, before[name] * scale, rtol=1e-6, atol=0, msg=name)
        if name in masked and masked_scale == 0.0:
            assert p.main_grad.abs().sum() == 0, name
    # one SUM all-reduce per contiguous buffer, of the already scaled buffer
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    assert len(membership.reduced) == len(buffers)
    for sent, buffer in zip(membership.reduced, buffers):
        assert torch.equal(sent, buffer.grad_data)


def test_plan_grad_reducer_without_masking_scales_everything_alike(build_tiny, tiny_batch):
    from megatron_mecefo.mcore.stack import PlanGradReducer

    ddp, _, _ = _ddp_with_grads(build_tiny, tiny_batch)
    named = dict(ddp.module.named_parameters())
    before = {n: p.main_grad.detach().clone() for n, p in named.items()}
    reducer = PlanGradReducer(ddp, _RecordingMembership(), None)  # skip off: nothing is masked
    reducer.set_scales(0.25, 0.7)
    reducer()
    for name, p in named.items():
        torch.testing.assert_close(p.main_grad, before[name] * 0.25, rtol=1e-6, atol=0, msg=name)


def test_plan_grad_reducer_with_a_subset_of_layers_skipping(build_tiny, tiny_batch):
    """skip_attention_layers=last:1, one exact + one degraded micro-batch in megatron's buffers:
    after the reduction, layer 1's attention params hold the exact micro-batch's grad x
    masked_scale; everything else, layer 0's attention included (the degraded micro-batch
    computed it), the sum of both micro-batches' grads x 1/n (plain-autograd references)."""
    from megatron_mecefo.mcore.stack import PlanGradReducer

    mecefo_cfg = MecefoConfig(skip_attention_layers="last:1")
    ref_model, cfg = build_tiny()
    ref_ctl = install_degraded_mode(ref_model, mecefo_cfg)
    ref = []
    for seed, degraded in ((0, False), (1, True)):
        ref_ctl.set_degraded(degraded)
        ref.append(_grads(ref_model, tiny_batch(cfg, seed=seed)))
    ddp, ctl, _ = _ddp_with_grads(build_tiny, tiny_batch, mecefo_cfg)
    named = dict(ddp.module.named_parameters())
    masked = {n for n in named if ctl.is_masked_param(n)}
    assert masked == {n for n in named if n.startswith("decoder.layers.1.")} & {
        n for n in named if is_attention_branch_param(n)
    }
    assert len(masked) == 3
    reducer = PlanGradReducer(ddp, _RecordingMembership(), ctl.is_masked_param)
    grad_scale, masked_scale = 0.25, 0.7
    reducer.set_scales(grad_scale, masked_scale)
    reducer()
    exact, degraded = ref
    for name, p in named.items():
        if name in masked:
            assert degraded[name] is None, name
            expected = exact[name] * masked_scale
        else:
            assert degraded[name].abs().sum() > 0, name
            expected = (exact[name] + degraded[name]) * grad_scale
        torch.testing.assert_close(p.main_grad, expected, rtol=1e-5, atol=1e-8, msg=name)

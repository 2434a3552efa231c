"""The gradient-error benchmark: relative error of the degraded (low-rank) gradient against the
exact one, per rank fraction, at initialisation and after some exact training steps, on a bare
GPTModel.

Imported by `degraded.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

import time

from bench_common import sync
from bench_engine import load_model_cfg


class BareModel:
    """A GPTModel + torch AdamW without megatron DDP, for per-parameter `.grad` comparisons."""

    def __init__(self, model_cfg, args, device, hooked: bool = True):
        import torch
        from bench_engine import synthetic_batch

        from megatron_mecefo.mcore.model import build_gpt_model
        from megatron_mecefo.mcore.parallel import seed_everything
        from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode

        seed_everything(1234)
        self.model = build_gpt_model(model_cfg)[0].to(device)
        self.controller = install_degraded_mode(self.model, MecefoConfig(enabled=hooked))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.m = args.microbatches
        self.device = device
        self.batch = synthetic_batch(model_cfg, args.mbs, device)

    def micro_batch(self, degraded: bool) -> None:
        tokens, pos, labels = self.batch
        if self.controller.enabled:
            self.controller.set_degraded(degraded)
        loss = self.model(tokens, pos, attention_mask=None, labels=labels).float().mean()
        (loss / self.m).backward()

    def step(self, degraded_flags: list[bool], step: int = 0) -> float:
        """One step with these micro-batch modes; returns seconds."""
        sync()
        start = time.perf_counter()
        if self.controller.enabled:
            self.controller.on_step_start(step)
        for flag in degraded_flags:
            self.micro_batch(flag)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start


def grad_error(name: str, args, device, steps: int) -> list[dict]:
    """Relative error of the degraded gradient vs exact, at init and after `steps` exact steps."""
    import torch

    from megatron_mecefo.mecefo import MecefoConfig, install_degraded_mode

    model_cfg = load_model_cfg(name, args.num_layers)
    rank = BareModel(model_cfg, args, device, hooked=False)
    gen = torch.Generator().manual_seed(1)
    s = model_cfg.seq_length
    results = []

    def grads():
        rank.optimizer.zero_grad(set_to_none=True)
        rank.micro_batch(True)
        return {n: p.grad.clone() for n, p in rank.model.named_parameters() if p.grad is not None}

    def rel(got, ref, names):
        diff = torch.cat([(got[n] - ref[n]).flatten() for n in names]).norm()
        return float(diff / torch.cat([ref[n].flatten() for n in names]).norm())

    for trained in (0, steps):
        for _ in range(trained):  # exact AdamW steps on fresh random batches
            tokens = torch.randint(0, model_cfg.vocab_size, (args.mbs, s), generator=gen).to(device)
            rank.batch = (tokens, rank.batch[1], tokens.roll(-1, 1))
            rank.step([False])
        ref = grads()  # the un-hooked controller runs everything exact
        ffn = [n for n in ref if ".mlp.linear_fc" in n]
        for frac in (1 / 16, 1 / 8, 1 / 4, 1 / 2):
            plain = rank.controller
            rank.controller = install_degraded_mode(rank.model, MecefoConfig(rank=frac))
            got = grads()
            rank.controller.uninstall()
            rank.controller = plain
            row = {
                "after_steps": trained,
                "rank_fraction": frac,
                "ffn_weight_grad_rel_error": rel(got, ref, ffn),
                "computed_grads_rel_error": rel(got, ref, list(got)),
            }
            results.append(row)
            print(
                f"  grad error {name} after {trained} steps, r=n/{round(1 / frac)}: FFN weights "
                f"{row['ffn_weight_grad_rel_error']:.3f}, all computed grads "
                f"{row['computed_grads_rel_error']:.3f}",
                flush=True,
            )
    return results

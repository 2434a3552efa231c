"""The local NaN/Inf verdict of one step attempt (`training/anomaly.py`) and, without failover,
the bound on attempts of a step that stays non-finite (`training/hooks.StepControl.end_step`)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from megatron_mecefo.config.anomaly import AnomalyConfig
from megatron_mecefo.errors import NumericalFaultError
from megatron_mecefo.training.anomaly import AnomalyGuard
from megatron_mecefo.training.hooks import StepControl


def test_losses_and_gradients_are_checked_per_attempt():
    guard = AnomalyGuard()
    guard.begin_attempt(3)
    guard.check_losses([1.0, 2.0])
    guard.check_grad(torch.ones(4))
    assert guard.reason is None
    guard.check_grad(torch.tensor([1.0, math.inf]))
    assert guard.reason == "gradient NaN/Inf"
    guard.begin_attempt(3)  # the rerun starts clean
    assert guard.reason is None
    guard.check_losses([1.0, math.nan])
    assert guard.reason == "loss nan"
    off = AnomalyGuard(enabled=False)
    off.begin_attempt(0)
    off.check_losses([math.nan])
    assert off.reason is None


def test_injected_faults_poison_what_they_say():
    guard = AnomalyGuard()
    guard.poison_attempts = 1  # transient: one attempt
    guard.begin_attempt(5)
    assert guard.poisoned(5, source=0)
    guard.begin_attempt(5)
    assert not guard.poisoned(5, source=0)
    guard.poison_from = 7  # a device: every attempt from step 7 on, whatever the data
    guard.begin_attempt(6)
    assert not guard.poisoned(6, source=0)
    guard.begin_attempt(9)
    assert guard.poisoned(9, source=2)
    data = AnomalyGuard()
    data.poison_data.add((4, 2))  # replica 2's micro-batches at step 4, wherever computed
    data.begin_attempt(4)
    assert data.poisoned(4, source=2) and not data.poisoned(4, source=1)
    data.skipped.add((4, 2, 0))
    assert data.is_skipped(4, 2, 0) and not data.is_skipped(4, 2, 1)


def test_without_failover_a_step_that_stays_non_finite_stops_the_run():
    engine = types.SimpleNamespace(
        cfg=types.SimpleNamespace(anomaly=AnomalyConfig(max_attempts=3)),
        anomaly=types.SimpleNamespace(reason="loss nan"),
    )
    control = StepControl()
    control.end_step(engine, types.SimpleNamespace(step=4, committed=False))
    control.end_step(engine, types.SimpleNamespace(step=4, committed=True))  # a clean redo resets
    for _ in range(2):
        control.end_step(engine, types.SimpleNamespace(step=5, committed=False))
    with pytest.raises(NumericalFaultError, match=r"step 5: .* on 3 attempts \(loss nan\)"):
        control.end_step(engine, types.SimpleNamespace(step=5, committed=False))


def test_any_single_flipped_bit_changes_the_fingerprint():
    from megatron_mecefo.training.anomaly import fingerprint

    a = [torch.randn(64), torch.randn(3, 5).to(torch.bfloat16)]
    b = [t.clone() for t in a]
    assert fingerprint(a) == fingerprint(b)
    for bit in (0, 11, 22, 30):
        c = [t.clone() for t in a]
        c[0].view(torch.int32)[7] ^= 1 << bit
        assert fingerprint(c) != fingerprint(a), bit
    d = [t.clone() for t in a]
    d[1].view(torch.int16)[0, 0] ^= 1 << 3
    assert fingerprint(d) != fingerprint(a)

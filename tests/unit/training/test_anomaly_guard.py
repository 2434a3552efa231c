"""The local NaN/Inf and spike verdict of one step attempt (`training/anomaly.py`) and, without
failover, the bound on attempts of a step that stays non-finite
(`training/hooks.StepControl.end_step`)."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from megatron_mecefo.config.anomaly import AnomalyConfig
from megatron_mecefo.errors import NumericalFaultError
from megatron_mecefo.failover.trainer.rerun import reproduced
from megatron_mecefo.training.anomaly import SPIKE, AnomalyGuard
from megatron_mecefo.training.hooks import StepControl


def test_losses_and_gradients_are_checked_per_attempt():
    guard = AnomalyGuard()
    guard.begin_attempt(3)
    guard.check_losses([1.0, 2.0])
    guard.check_grad(torch.ones(4))
    assert guard.reason is None
    guard.check_grad(torch.tensor([1.0, math.inf]))
    assert guard.reason == "gradient NaN/Inf" and guard.kind == "nan"
    guard.begin_attempt(3)  # the rerun starts clean
    assert guard.reason is None
    guard.check_losses([1.0, math.nan])
    assert guard.reason == "loss nan"
    off = AnomalyGuard(AnomalyConfig(enabled=False))
    off.begin_attempt(0)
    off.check_losses([math.nan])
    assert off.reason is None


def test_injected_faults_poison_what_they_say():
    guard = AnomalyGuard()
    guard.poison_attempts = 1  # transient: one attempt
    guard.begin_attempt(5)
    assert math.isnan(guard.poison(5, source=0))
    guard.begin_attempt(5)
    assert guard.poison(5, source=0) is None
    guard.poison_from = 7  # a device: every attempt from step 7 on, whatever the data
    guard.poison_value = SPIKE
    guard.begin_attempt(6)
    assert guard.poison(6, source=0) is None
    guard.begin_attempt(9)
    assert guard.poison(9, source=2) == SPIKE
    data = AnomalyGuard()
    data.poison_data[(4, 2)] = SPIKE  # replica 2's micro-batches at step 4, wherever computed
    data.begin_attempt(4)
    assert data.poison(4, source=2) == SPIKE and data.poison(4, source=1) is None
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


def _attempt(guard, step, loss, grad_norm, ordinary=True, exact=True):
    guard.begin_attempt(step)
    guard.check_losses([loss, loss])
    guard.check_grad(torch.tensor([grad_norm * 0.6, grad_norm * 0.8]))  # norm: grad_norm
    guard.check_spikes(loss_ok=exact, grad_ok=ordinary)
    return json.loads(guard.record([(0, 0), (0, 1)], [loss, loss])) if guard.reason else None


def test_spikes_are_judged_against_the_median_of_the_committed_window():
    cfg = AnomalyConfig(
        loss_spike_factor=3.0, grad_spike_factor=10.0, spike_window=4, spike_warmup=3
    )
    guard = AnomalyGuard(cfg)
    for step, loss in enumerate([9.0, 2.0, 2.2]):  # warming up: never a spike
        assert _attempt(guard, step, loss, 1.0) is None
        guard.accept(loss_ok=True, grad_ok=True)
    # median of (9, 2, 2.2) is 2.2: 6.5 passes, 6.7 is a spike, whatever the first steps were
    assert _attempt(guard, 3, 6.5, 1.0) is None
    record = _attempt(guard, 3, 6.7, 1.0)
    assert record["kind"] == "loss" and record["limit"] == pytest.approx(6.6)
    assert record["what"].startswith("loss spike 6.7 > 3 x median 2.2 of the last 3 steps")
    # not committed: the spike never enters the window; a degraded attempt is not judged
    assert _attempt(guard, 3, 6.7, 1.0, ordinary=False, exact=False) is None
    guard.accept(loss_ok=False, grad_ok=False)
    assert list(guard.loss.values) == [9.0, 2.0, 2.2] and len(guard.grad_norm.values) == 3
    # an uneven share (exact, not this rank's own work): its loss is judged, not its gradients
    assert _attempt(guard, 3, 6.7, 50.0, ordinary=False)["kind"] == "loss"
    assert _attempt(guard, 3, 2.0, 50.0, ordinary=False) is None
    guard.begin_attempt(3)  # slices: 3 tasks making 1.5 micro-batches, mean 8.0 / 1.5
    guard.check_losses([4.0, 2.0, 2.0], units=1.5)
    guard.check_spikes(loss_ok=True, grad_ok=False)
    assert guard.kind is None and guard._stats()[0] == pytest.approx(8.0 / 1.5)
    record = _attempt(guard, 3, 2.1, 10.5)  # gradient norm 10.5 > 10 x median 1.0
    assert record["kind"] == "grad" and record["limit"] is None
    assert _attempt(guard, 3, 2.1, 9.5) is None
    guard.accept(loss_ok=True, grad_ok=True)
    assert guard.peaks() == {"loss": round(2.1 / 2.2, 4), "grad_norm": 9.5, "steps_checked": 1}
    for off in (dict(loss_spike_factor=0, grad_spike_factor=0), dict(enabled=False)):
        quiet = AnomalyGuard(AnomalyConfig(spike_window=3, spike_warmup=1, **off))
        _attempt(quiet, 0, 1.0, 1.0)
        quiet.accept(loss_ok=True, grad_ok=True)
        assert _attempt(quiet, 1, 100.0, 100.0) is None, off


def test_the_spike_settings_are_checked():
    for bad in (
        dict(loss_spike_factor=0.5),
        dict(grad_spike_factor=1.0),
        dict(spike_warmup=0),
        dict(spike_window=5, spike_warmup=6),
    ):
        with pytest.raises(ValueError):
            AnomalyConfig(**bad)


def test_what_reproduces_on_a_healthy_peer():
    nan = {"what": "loss nan", "kind": "nan", "limit": None}
    assert reproduced(nan, [2.0, 2.1]) == (False, [])  # finite on the peer: the device
    assert reproduced(nan, [math.nan, 2.1]) == (True, [0])  # NaN there too: the data
    spike = {"what": "loss spike", "kind": "loss", "limit": 6.0}
    assert reproduced(spike, [2.0, 2.1]) == (False, [])
    assert reproduced(spike, [2.0, 11.0]) == (True, [1])  # mean 6.5 > 6
    assert reproduced(spike, [5.0, 6.5]) == (False, [1])  # mean 5.75: the suspect's own fault
    assert reproduced({"what": "g", "kind": "grad", "limit": None}, [2.0, 2.1]) == (True, [0, 1])

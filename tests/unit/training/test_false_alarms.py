"""Zero false alarms over 1,000 failure-free steps (issue 35), without training in the suite.

`tests/data/failure_free_spikes.json` holds, for three failure-free runs of 1,000 steps (the demo
job's configuration in one process, three seeds and batch layouts), the loss and local gradient
norm each step was judged on, as recorded by `python tools/bench/spike_threshold.py --trace
tests/data/failure_free_spikes.json` (the trace names the machine). Each run is replayed here
through `AnomalyGuard` with the default settings, exactly as the engine drives it per step (begin,
losses, gradient, spike check, accept): no step may be flagged. The same replay must flag a spike
put into the trace, and must flag the real trace once the factors are set below its own peaks, so
the test fails if the guard stops judging (or the trace is too flat to judge anything).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_mecefo.config.anomaly import AnomalyConfig
from megatron_mecefo.training.anomaly import AnomalyGuard

TRACE = Path(__file__).resolve().parents[2] / "data" / "failure_free_spikes.json"


def _runs() -> list[dict]:
    return json.loads(TRACE.read_text())["runs"]


def _replay(losses, norms, cfg: AnomalyConfig) -> list[tuple[int, str]]:
    """The steps `AnomalyGuard` flags, and why (a flagged step is not accepted, as in the job)."""
    guard, alarms = AnomalyGuard(cfg), []
    for step, (loss, norm) in enumerate(zip(losses, norms, strict=True)):
        guard.begin_attempt(step)
        guard.check_losses([loss])
        guard.check_grad(torch.tensor([norm], dtype=torch.float64))
        guard.check_spikes(loss_ok=True, grad_ok=True)
        if guard.reason is not None:
            alarms.append((step, guard.reason))
            continue
        guard.accept(loss_ok=True, grad_ok=True)
    return alarms


def test_the_trace_is_three_runs_of_a_thousand_steps():
    runs = _runs()
    assert len(runs) == 3 and {len(r["loss"]) for r in runs} == {1000}, [r["run"] for r in runs]
    assert all(len(r["grad_norm"]) == 1000 for r in runs)


@pytest.mark.parametrize("index", range(3))
def test_no_false_alarm_in_a_thousand_failure_free_steps(index):
    run = _runs()[index]
    assert _replay(run["loss"], run["grad_norm"], AnomalyConfig()) == []


@pytest.mark.parametrize("stat", ["loss", "grad_norm"])
def test_the_replay_flags_a_spike_put_into_the_trace(stat):
    run = _runs()[0]
    cfg = AnomalyConfig()
    factor = cfg.loss_spike_factor if stat == "loss" else cfg.grad_spike_factor
    series = {"loss": list(run["loss"]), "grad_norm": list(run["grad_norm"])}
    series[stat][500] *= 1.5 * factor  # 1.5x the factor over its own value: past any median
    alarms = _replay(series["loss"], series["grad_norm"], cfg)
    assert [step for step, _ in alarms] == [500], alarms
    assert ("loss spike" if stat == "loss" else "gradient-norm spike") in alarms[0][1]


def test_factors_below_the_trace_s_own_peaks_do_flag_it():
    """The default factors pass the trace with a margin; factors set under the largest ratios a
    run reached flag it. A trace too flat to judge, or a guard that judges nothing, fails here."""
    run = _runs()[0]
    low = dataclasses.replace(AnomalyConfig(), loss_spike_factor=1.01, grad_spike_factor=1.01)
    alarms = _replay(run["loss"], run["grad_norm"], low)
    kinds = {why.split()[0] for _, why in alarms}
    assert alarms and kinds <= {"loss", "gradient-norm"}, alarms[:5]
    assert all(step >= AnomalyConfig().spike_warmup for step, _ in alarms)  # nothing before

"""The straggler watch's decisions (`failover/trainer/straggler.py`): when a rank shares its
pace, which replica is a straggler, how the share weights move until the replicas' compute times
agree, that a replica's pace is its slowest rank's, and that a new generation or a change of work
starts the window afresh."""

from __future__ import annotations

import pytest

from megatron_mecefo.config.straggler import StragglerConfig
from megatron_mecefo.failover.trainer.straggler import StragglerWatch


def _watch(replica_size=1, **kw):
    w = StragglerWatch(StragglerConfig(interval=5, window=3, **kw), replica_size=replica_size)
    w.forget(1)
    return w


def test_a_rank_shares_the_median_of_a_full_window_on_the_watch_steps_only():
    w = _watch()
    assert w.pace(5) == 0.0  # not known yet: the window is not full
    for t in (0.4, 2.0, 0.5):  # one slow step is noise
        w.took(t)
    assert [w.pace(s) for s in (0, 4, 5, 10)] == [None, None, 0.5, 0.5]
    assert _watch(enabled=False).pace(5) is None


def test_a_straggler_s_weight_moves_until_the_compute_times_agree_then_back():
    w = _watch()
    members = (0, 1, 2, 3)
    assert not w.judge({0: 1.0, 1: 1.1, 2: 1.25, 3: 0.9}, members)  # under 1.3x the others
    assert w.speeds is None
    w.took(1.0)
    assert w.judge({0: 1.0, 1: 1.0, 2: 2.0, 3: 1.0}, members)
    assert w.speeds == {0: 1.0, 1: 1.0, 2: 0.5, 3: 1.0} and len(w.window) == 0  # work changes
    # replica 2 has a fixed cost: on half the work it is still 1.6x as slow; its weight drops,
    # and only its own: the healthy replicas' times (1.0 and 0.8) are noise on a shared machine
    assert w.judge({0: 1.0, 1: 0.8, 2: 1.6, 3: 1.0}, members)
    assert w.speeds == {0: 1.0, 1: 1.0, 2: 0.31, 3: 1.0}
    assert not w.judge({0: 1.0, 1: 1.05, 2: 1.1, 3: 0.95}, members)  # even enough: stays
    assert not w.judge({0: 1.0, 1: 1.0, 2: 0.8, 3: 1.0}, members)  # a little faster: stays
    assert w.speeds[2] == 0.31
    # it recovered: fast on its small share; its weight climbs back, and even shares return
    assert w.judge({0: 1.0, 1: 1.0, 2: 0.5, 3: 1.0}, members) and w.speeds[2] == 0.62
    assert w.judge({0: 1.0, 1: 1.0, 2: 0.62, 3: 1.0}, members) and w.speeds is None
    two = _watch()  # with two replicas the other one is the reference
    assert two.judge({0: 1.0, 1: 2.0}, (0, 1)) and two.speeds == {0: 1.0, 1: 0.5}


def test_a_replica_is_as_slow_as_its_slowest_rank_and_all_paces_must_be_known():
    w = _watch(replica_size=2)  # replica r: ranks 2r, 2r + 1
    paces = {0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0, 4: 1.0, 5: 0.9}
    assert w.judge(paces, (0, 1, 2)) and w.speeds == {0: 1.0, 1: 0.33, 2: 1.0}
    assert not _watch().judge({0: 1.0, 1: 3.0, 2: 0.0}, (0, 1, 2))  # 2 not known: next time


def test_a_new_generation_forgets_the_weights_and_the_window():
    w = _watch()
    w.judge({0: 1.0, 1: 1.0, 2: 3.0}, (0, 1, 2))
    w.took(1.0)
    w.forget(1)
    assert w.speeds == {0: 1.0, 1: 1.0, 2: 0.33} and len(w.window) == 1
    assert w.too_slow == {2: 3.0}
    w.forget(2)  # a takeover's generation is not judged: no eviction asked from stale paces
    assert w.speeds is None and len(w.window) == 0 and w.too_slow == {}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="factor > 1"):
        StragglerConfig(factor=1.0)


def test_a_replica_evict_factor_times_slower_per_sample_is_too_slow():
    w = _watch()
    members = (0, 1, 2, 3)
    w.judge({0: 1.0, 1: 1.0, 2: 1.9, 3: 1.0}, members)
    assert w.too_slow == {} and w.speeds[2] == 0.53  # 1.9x: a smaller share only
    # on its smaller share it still takes 1.2 s: 1.2 / 0.53 = 2.26x the others per sample
    w.judge({0: 1.0, 1: 1.0, 2: 1.2, 3: 1.0}, members)
    assert w.too_slow == {2: 2.26}
    assert not w.judge({0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0}, members) and w.too_slow == {}
    never = _watch(evict_factor=0)
    assert never.judge({0: 1.0, 1: 3.0}, (0, 1)) and never.too_slow == {}
    once = _watch()  # a new straggler 3x slower is too slow at its first comparison
    assert once.judge({0: 1.0, 1: 3.0}, (0, 1)) and once.too_slow == {1: 3.0}
    with pytest.raises(ValueError, match="evict_factor"):
        StragglerConfig(evict_factor=1.2)

"""Hopcroft-Karp and the minimum stack number against brute force on small cases."""

import itertools

import numpy as np
import pytest

from megatron_mecefo.sim import matching
from megatron_mecefo.sim.spare import dead_run_length


def brute_max_matching(adj, num_right):
    best = 0
    for perm in itertools.product(*[[-1, *row] for row in adj]):
        used = [v for v in perm if v >= 0]
        if len(used) == len(set(used)):
            best = max(best, len(used))
    return best


def brute_min_stack(dead, n, r):
    """Smallest S over all shard -> live-holder assignments; plus the fewest moves at that S."""
    choices = [[g for g in matching.holders(j, n, r) if g not in dead] for j in range(n)]
    if any(not c for c in choices):
        return None, None
    best_s, best_moves = None, None
    for assign in itertools.product(*choices):
        s = max(np.bincount(assign, minlength=n))
        moves = sum(matching.holders(j, n, r).index(g) >= s for j, g in enumerate(assign))
        if best_s is None or (s, moves) < (best_s, best_moves):
            best_s, best_moves = s, moves
    return best_s, best_moves


@pytest.mark.timeout(60)
def test_hopcroft_karp_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        nl, nr = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        adj = [sorted(set(rng.integers(0, nr, rng.integers(0, 4)).tolist())) for _ in range(nl)]
        size, match_l = matching.hopcroft_karp(adj, nr)
        assert size == brute_max_matching(adj, nr)
        used = [v for v in match_l if v >= 0]
        assert len(used) == len(set(used)) == size
        assert all(v in adj[u] for u, v in enumerate(match_l) if v >= 0)


@pytest.mark.timeout(120)
def test_min_stack_and_moves_match_brute_force():
    rng = np.random.default_rng(1)
    cases = 0
    for _ in range(80):
        n = int(rng.integers(3, 8))
        r = int(rng.integers(2, min(n, 4) + 1))
        dead = set(rng.choice(n, int(rng.integers(0, n)), replace=False).tolist())
        s_brute, moves_brute = brute_min_stack(dead, n, r)
        assert matching.min_stack_number(dead, n, r) == s_brute
        assert matching.min_stack_fast(np.array(sorted(dead)), n, r) == s_brute
        if s_brute is not None:
            s, assign, moves = matching.reorder_min_moves(dead, n, r)
            assert (s, moves) == (s_brute, moves_brute)
            assert sorted(assign) == list(range(n))
            assert max(np.bincount(list(assign.values()))) <= s
            cases += 1
    assert cases > 20


@pytest.mark.timeout(60)
def test_fast_and_incremental_equal_hopcroft_karp_at_medium_size():
    rng = np.random.default_rng(2)
    for _ in range(15):
        n, r = int(rng.integers(20, 80)), int(rng.integers(2, 7))
        dead = np.zeros(n, dtype=bool)
        dead_sorted: list[int] = []
        stacks = 1
        for g in rng.permutation(n):
            dead[g] = True
            dead_sorted = sorted([*dead_sorted, int(g)])
            if dead_run_length(dead, int(g)) >= r:
                assert matching.min_stack_number(dead_sorted, n, r) is None
                break
            stacks = matching.min_stack_after_failure(np.array(dead_sorted), int(g), stacks, n, r)
            if len(dead_sorted) % 5 == 0:
                assert stacks == matching.min_stack_number(dead_sorted, n, r)
            assert stacks == matching.min_stack_fast(np.array(dead_sorted), n, r)

"""Minimum stack number after failures: Hopcroft-Karp, a fast Hall-condition form, fewest-moves
reorder.

Shard j is held by the groups whose stacks contain it, g in [j-r+1, j] (mod N). With dead groups,
the live groups must cover all N shards with at most S shards each; the smallest such S is the
minimum stack number. `min_stack_number` finds it with Hopcroft-Karp on the slot-expanded bipartite
graph (the reference); `min_stack_fast` evaluates Hall's condition on cyclic intervals (same answer,
used by the simulator); `reorder_min_moves` picks, among minimum-S assignments, one that moves the
fewest shards.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from scipy.optimize import linear_sum_assignment

INF_DIST = 1 << 30


def hopcroft_karp(adjacency: list[list[int]], num_right: int) -> tuple[int, list[int]]:
    """Maximum bipartite matching. Returns (size, match_left) with match_left[u] = right or -1.

    Args:
        adjacency: adjacency[u] lists the right vertices left vertex u may be matched to.
        num_right: number of right vertices.
    """
    num_left = len(adjacency)
    match_l = [-1] * num_left
    match_r = [-1] * num_right
    size = 0
    while True:
        dist = _hk_bfs(adjacency, match_l, match_r)
        if dist is None:
            return size, match_l
        for u in range(num_left):
            if match_l[u] == -1 and _hk_dfs(u, adjacency, match_l, match_r, dist):
                size += 1


def _hk_bfs(adj: list[list[int]], match_l: list[int], match_r: list[int]) -> list[int] | None:
    """Layer the graph from free left vertices; None when no augmenting path exists."""
    dist = [INF_DIST] * len(adj)
    queue = deque(u for u in range(len(adj)) if match_l[u] == -1)
    for u in queue:
        dist[u] = 0
    found = False
    while queue:
        u = queue.popleft()
        for v in adj[u]:
            w = match_r[v]
            if w == -1:
                found = True
            elif dist[w] == INF_DIST:
                dist[w] = dist[u] + 1
                queue.append(w)
    return dist if found else None


def _hk_dfs(u: int, adj: list[list[int]], match_l: list[int], match_r: list[int], dist) -> bool:
    """Iterative augmenting-path search along BFS layers (no recursion limit at large N)."""
    stack = [(u, iter(adj[u]))]
    path: list[tuple[int, int]] = []
    while stack:
        x, it = stack[-1]
        advanced = False
        for v in it:
            w = match_r[v]
            if w == -1:
                for a, b in [*path, (x, v)]:
                    match_l[a], match_r[b] = b, a
                return True
            if dist[w] == dist[x] + 1:
                path.append((x, v))
                stack.append((w, iter(adj[w])))
                advanced = True
                break
        if not advanced:
            dist[x] = INF_DIST
            stack.pop()
            if path:
                path.pop()
    return False


def holders(shard: int, num_groups: int, redundancy: int) -> list[int]:
    """Groups whose stack contains `shard`, in stack-position order (position 0 first)."""
    return [(shard - p) % num_groups for p in range(redundancy)]


def _slot_graph(dead: set[int], num_groups: int, redundancy: int, stacks: int):
    """Shards x (live group, slot) adjacency; slot index = live_index * stacks + s."""
    live = [g for g in range(num_groups) if g not in dead]
    index = {g: i for i, g in enumerate(live)}
    adj = []
    for j in range(num_groups):
        row = []
        for g in holders(j, num_groups, redundancy):
            if g in index:
                row.extend(index[g] * stacks + s for s in range(stacks))
        adj.append(row)
    return adj, live


def min_stack_number(dead, num_groups: int, redundancy: int) -> int | None:
    """Exact minimum stack number by Hopcroft-Karp; None when some shard has no live holder."""
    dead = {int(g) for g in dead}
    if len(dead) >= num_groups:
        return None
    lower = -(-num_groups // (num_groups - len(dead)))
    for stacks in range(lower, redundancy + 1):
        adj, live = _slot_graph(dead, num_groups, redundancy, stacks)
        size, _ = hopcroft_karp(adj, len(live) * stacks)
        if size == num_groups:
            return stacks
    return None


def min_stack_fast(dead_sorted: np.ndarray, num_groups: int, redundancy: int) -> int | None:
    """Minimum stack number from Hall's condition on cyclic intervals, O(k^2) numpy for k dead.

    A set of shards X needs S * |live holders(X)| >= |X|. The binding sets are cyclic intervals of
    shards; their holder range [p, q] can be taken to start and end at dead groups (adding a live
    end group only lowers the ratio), so we scan all pairs of dead groups plus the whole ring.
    Returns None when r consecutive groups are dead (a shard is lost).
    """
    d = np.asarray(dead_sorted, dtype=np.int64)
    k = d.size
    if k == 0:
        return 1
    if k >= num_groups:
        return None
    best = -(-num_groups // (num_groups - k))
    offsets = np.arange(k)
    j = (np.arange(k)[:, None] + offsets[None, :]) % k
    span = (d[j] - d[:, None]) % num_groups + 1
    span = np.where((offsets[None, :] > 0) & (span == 1), num_groups + 1, span)
    num_dead = offsets[None, :] + 1
    shards = span - (redundancy - 1)
    alive = span - num_dead
    ok = (shards > 0) & (span <= num_groups)
    if np.any(ok & (alive <= 0)):
        return None
    ok &= alive > 0
    if np.any(ok):
        best = max(best, int((-(-shards[ok] // alive[ok])).max()))
    return best if best <= redundancy else None


def min_stack_after_failure(
    dead_sorted: np.ndarray, group: int, stacks: int, num_groups: int, redundancy: int
) -> int:
    """Incremental min stack number after `group` (already in `dead_sorted`) died, O(k * steps).

    Holder ranges not containing `group` kept their live count, so they still satisfy the old
    `stacks`; only ranges through `group` are re-checked. For such a range, from the a-th dead group
    counter-clockwise to the b-th clockwise, Hall's violation S*D - (S-1)*span > r-1 separates into
    F(a) + G(b) > r - 2 with a + b <= k - 1, a prefix-max scan. The caller ensures no r-run is dead.
    """
    d = np.asarray(dead_sorted, dtype=np.int64)
    k = d.size
    c = int(np.searchsorted(d, group))
    steps = np.arange(k)
    x = (group - d[(c - steps) % k]) % num_groups  # distance back to the a-th dead group
    y = (d[(c + steps) % k] - group) % num_groups  # distance on to the b-th dead group
    s = max(stacks, -(-num_groups // (num_groups - k)))
    while s < redundancy:
        f = s * steps - (s - 1) * x
        h = np.maximum.accumulate(s * steps - (s - 1) * y)
        if int((f + h[::-1]).max()) <= redundancy - 2:
            return s
        s += 1
    return s


def reorder_min_moves(dead, num_groups: int, redundancy: int) -> tuple[int, dict[int, int], int]:
    """Minimum-S assignment that moves the fewest shards: (S, shard -> group, moves).

    A shard "moves" when its assigned group holds it below the top S entries of the original stack
    (the group must reorder its stack to compute it). Solved exactly as a min-cost assignment
    (shards x group slots, cost 0 = already in the top S, 1 = reorder) after Hopcroft-Karp fixes S.
    """
    stacks = min_stack_number(dead, num_groups, redundancy)
    if stacks is None:
        raise ValueError("a shard lost all its holders: restart needed, no reorder possible")
    dead = {int(g) for g in dead}
    live = [g for g in range(num_groups) if g not in dead]
    index = {g: i for i, g in enumerate(live)}
    big = num_groups + 1
    cost = np.full((num_groups, len(live) * stacks), float(big))
    for j in range(num_groups):
        for pos, g in enumerate(holders(j, num_groups, redundancy)):
            if g in index:
                cols = index[g] * stacks + np.arange(stacks)
                cost[j, cols] = 0.0 if pos < stacks else 1.0
    rows, cols = linear_sum_assignment(cost)
    assignment = {int(j): live[c // stacks] for j, c in zip(rows, cols)}
    moves = int(cost[rows, cols].sum())
    return stacks, assignment, moves

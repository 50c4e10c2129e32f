"""The fine-grained design (``scheme: fine_grained``): each slot to exactly C of M workers, chosen
greedily so that every pair of workers shares about the same number of slots."""
from __future__ import annotations

import random


def design(n: int, M: int, C: int, seed: int) -> list[list[int]]:
    """Greedy balanced design: for each sample the C least-loaded workers, ties broken by the
    fewest samples already shared with the workers chosen so far, then randomly (seeded).
    Loads stay within one of each other; pairwise intersections stay within a few samples of
    the mean N*C*(C-1)/(M*(M-1)). O(N*C*M) in pure Python."""
    rnd = random.Random(seed)
    load = [0] * M
    pair = [[0] * M for _ in range(M)]
    per_worker: list[list[int]] = [[] for _ in range(M)]
    order = list(range(M))
    for s in range(n):
        rnd.shuffle(order)                    # random tie-break among equals ...
        order.sort(key=load.__getitem__)      # ... stable sort: least loaded first
        thr = load[order[C - 1]]
        chosen = [w for w in order if load[w] < thr]
        free = [w for w in order if load[w] == thr]
        score = [0] * M
        for w in chosen:
            row = pair[w]
            for v in free:
                score[v] += row[v]
        for _ in range(C - len(chosen)):
            best = min(free, key=score.__getitem__)
            free.remove(best)
            chosen.append(best)
            row = pair[best]
            for v in free:
                score[v] += row[v]
        for w in chosen:
            load[w] += 1
            row = pair[w]
            for v in chosen:
                row[v] += 1
            per_worker[w].append(s)
    if n <= 64 * M:  # only a small N can leave two workers with identical samples
        _break_equal_workers(per_worker, pair, n)
    return per_worker


def _break_equal_workers(per_worker: list[list[int]], pair: list[list[int]], n: int) -> None:
    """Repair pass for small N: when the greedy leaves two workers a, b holding identical
    samples (it can at the end of a round, when the last least-loaded workers are forced
    together), swap one membership: sample s (held by a and b) goes from a to a worker c that
    holds a sample t that a lacks, and t goes from c to a. Loads and copies are unchanged; the
    swap with the smallest increase of the sum of squared pair counts is taken."""
    M = len(per_worker)
    holders: list[list[int]] = [[] for _ in range(n)]
    for w, samples in enumerate(per_worker):
        for s in samples:
            holders[s].append(w)
    for _ in range(4 * M):
        seen: dict[tuple, int] = {}
        dup = None
        for w, samples in enumerate(per_worker):
            key = tuple(sorted(samples))
            if key in seen:
                dup = (seen[key], w)
                break
            seen[key] = w
        if dup is None:
            return
        a = dup[0]
        held = set(per_worker[a])
        best = None
        for s in per_worker[a]:
            xs = [x for x in holders[s] if x != a]
            for t in range(n):
                if t in held:
                    continue
                for c in holders[t]:
                    if c in holders[s]:
                        continue
                    ys = [y for y in holders[t] if y != c]
                    # pairs (a,x),(c,y) lost; (c,x),(a,y) gained: change of the sum of squares
                    delta = sum(2 * (pair[c][x] - pair[a][x]) + 2 for x in xs) + \
                        sum(2 * (pair[a][y] - pair[c][y]) + 2 for y in ys)
                    if best is None or delta < best[0]:
                        best = (delta, s, t, c, xs, ys)
        if best is None:
            return
        _, s, t, c, xs, ys = best
        for x in xs:
            pair[a][x] -= 1; pair[x][a] -= 1; pair[c][x] += 1; pair[x][c] += 1  # noqa: E702
        for y in ys:
            pair[c][y] -= 1; pair[y][c] -= 1; pair[a][y] += 1; pair[y][a] += 1  # noqa: E702
        holders[s][holders[s].index(a)] = c
        holders[t][holders[t].index(c)] = a
        per_worker[a][per_worker[a].index(s)] = t
        per_worker[c][per_worker[c].index(t)] = s

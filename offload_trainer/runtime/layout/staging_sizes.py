"""Host staging buffer sizes: a few size classes from the groups' sizes, not all the largest group's.

Pure. The host staging pool (NVMe and off-device traffic of gradients and optimizer states) is
split into size classes: each class is a run of groups of similar size, its buffers are the size
of the run's largest group, and a request is served by its own class only (BufferPool's
`exact_class`), so a small group never holds a buffer that a large one is waiting for. A class
has room for `groups_in_flight` of its groups at once (or all of them, if fewer), each with
`buffers_per_group` buffers; the classes are the split of the sorted sizes that costs the fewest
bytes. A model whose tied embedding is five times a block then pays for the embedding once per
state kind, not once per buffer.

Parameter staging (NVMe reads on their way to an accelerator) is a ring whose buffers are given
back as soon as their read is issued, so every buffer is always available to the next load: its
sizes are simply the largest groups' (any that many loads in flight fit at once).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

MAX_CLASSES = 4
"""At most this many distinct staging sizes: each costs at least one group's buffers."""


def staging_classes(
    group_numels: Sequence[int], buffers_per_group: int, groups_in_flight: int, min_per_class: int = 2
) -> List[Tuple[int, int]]:
    """(buffer numel, number of buffers) per class, largest first, for groups of `group_numels`
    (the groups that use staging). Each class holds min(its groups, `groups_in_flight`) x
    `buffers_per_group` buffers, at least `min_per_class` (a gradient merge holds two of one
    group's buffers at once). The split into at most MAX_CLASSES classes minimises the bytes."""
    sizes = sorted((n for n in group_numels if n > 0), reverse=True)
    if not sizes:
        return []

    def count(members: int) -> int:
        return max(min_per_class, min(members, groups_in_flight) * buffers_per_group)

    # Classes are runs of the sorted sizes, cut only between different sizes.
    cuts = [i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]] + [len(sizes)]
    starts = [0] + cuts[:-1]
    # best[c][j]: least elements to cover sizes[starts[j]:] with at most c classes, and the next cut.
    n_runs = len(starts)
    inf = float("inf")
    best = [[(inf, -1)] * (n_runs + 1) for _ in range(MAX_CLASSES + 1)]
    for c in range(MAX_CLASSES + 1):
        best[c][n_runs] = (0, -1)
    for c in range(1, MAX_CLASSES + 1):
        for j in range(n_runs - 1, -1, -1):
            lo = starts[j]
            for k in range(j + 1, n_runs + 1):
                hi = cuts[k - 1]
                rest = best[c - 1][k][0]
                cost = count(hi - lo) * sizes[lo] + rest
                if cost < best[c][j][0]:
                    best[c][j] = (cost, k)
    out: List[Tuple[int, int]] = []
    c, j = MAX_CLASSES, 0
    while j < n_runs:
        k = best[c][j][1]
        lo, hi = starts[j], cuts[k - 1]
        out.append((sizes[lo], count(hi - lo)))
        c, j = c - 1, k
    return out


def class_numels(classes: Sequence[Tuple[int, int]]) -> Tuple[int, ...]:
    """Every buffer's numel, largest first."""
    return tuple(numel for numel, num in classes for _ in range(num))


def ring_numels(group_numels: Sequence[int], num_buffers: int) -> Tuple[int, ...]:
    """A ring of `num_buffers` buffers any that many of the groups fit at once: the largest sizes."""
    return tuple(sorted((n for n in group_numels if n > 0), reverse=True)[:num_buffers])

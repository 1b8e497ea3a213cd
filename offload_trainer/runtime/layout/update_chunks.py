"""Update chunks: where a large group's optimizer update is cut into contiguous element ranges (pure).

    cuts = update_cuts([(0, 3000), (3000, 9000)], 12000, chunk_numel=4096, block_numel=1024)
    # (0, 4096, 8192, 12000): chunk k is elements [cuts[k], cuts[k + 1]) of the flat shard

Why a group is updated in chunks, and how the chunks move, is [Note: Chunked updates] in
runtime/optimizer.py. Here only where the cuts may fall. A cut must keep two things exact:
- Every NVMe read and write of a chunk's range stays whole IO blocks (IOConfig.block_bytes, the
  checksum chunk of the swap extents), so that every byte stays checked and O_DIRECT aligned: a
  cut is a multiple of `block_numel` elements from the shard's start.
- The fused update of a parameter cut in two is bitwise that of the whole parameter: torch's
  CPU kernels (`_fused_adamw_`, `_fused_sgd_`) work in FUSED_UNIT_NUMEL-element units counted
  from each tensor's start, so a cut inside a parameter's piece must lie a multiple of that many
  elements from the piece's start (a cut at a piece's boundary, or between pieces, always does).
Where no cut satisfies both within a chunk's length, the chunk grows to the next one that does
(correct; only the staging it needs is less bounded).
"""

from __future__ import annotations

import bisect
import functools
from typing import List, Sequence, Tuple

FUSED_UNIT_NUMEL = 16
"""torch's CPU fused AdamW/SGD kernels update a tensor in units of this many elements from its
first: a parameter cut at a multiple of it from its start is updated bitwise as a whole (checked
by hand for both kernels: a cut at 3001 or 7 elements changes the last bit)."""


def update_cuts(
    pieces: Sequence[Tuple[int, int]], numel: int, chunk_numel: int, block_numel: int
) -> Tuple[int, ...]:
    """See _update_cuts. Cached: the planner asks again for the same group at every grid point (a 70B
    model's refusal took 29 s of its 47 here, 65 groups x 753 placements)."""
    return _update_cuts(tuple(pieces), numel, chunk_numel, block_numel, FUSED_UNIT_NUMEL)


@functools.lru_cache(maxsize=4096)
def _update_cuts(
    pieces: Tuple[Tuple[int, int], ...], numel: int, chunk_numel: int, block_numel: int, unit_numel: int
) -> Tuple[int, ...]:
    """The chunk boundaries (0, c1, ..., numel) of a flat shard of `numel` elements holding
    `pieces` ((start, numel) of each parameter's piece, not overlapping). Each cut is a multiple
    of `block_numel` and, inside a piece, a multiple of FUSED_UNIT_NUMEL from the piece's start;
    each chunk is the longest that such a cut allows within `chunk_numel` (rounded up to whole
    blocks), or, where none does, runs to the next allowed cut. A shard of at most one chunk's
    elements is one chunk: (0, numel)."""
    if block_numel < 1 or chunk_numel < 1:
        raise ValueError(f"block_numel={block_numel} and chunk_numel={chunk_numel} must be at least 1")
    chunk_numel = -(-chunk_numel // block_numel) * block_numel
    if numel <= chunk_numel:
        return (0, numel)
    ordered = sorted((start, n) for start, n in pieces if n > 0)
    starts = [start for start, _ in ordered]

    def allowed(cut: int) -> bool:
        k = bisect.bisect_right(starts, cut) - 1
        if k < 0:
            return True
        start, n = ordered[k]
        return cut >= start + n or (cut - start) % unit_numel == 0

    cuts = [0]
    while numel - cuts[-1] > chunk_numel:
        at = cuts[-1]
        # The furthest allowed cut within one chunk's length, else the nearest past it.
        best = next((c for c in range(at + chunk_numel, at, -block_numel) if allowed(c)), None)
        if best is None:
            best = next((c for c in range(at + chunk_numel + block_numel, numel, block_numel) if allowed(c)), None)
        if best is None:
            break
        cuts.append(best)
    cuts.append(numel)
    return tuple(cuts)


def staged_numels(cuts: Sequence[int], shard_numel: int) -> List[int]:
    """Per chunk of `cuts`, the elements its staging buffers hold: its range, the last one's to the
    end of the parameter shard (`shard_numel`: the shard's frozen tail and padding move with it).
    The plan sizes the staging pool by these and the optimizer takes buffers of them, so both agree."""
    return [(shard_numel if b == cuts[-1] else b) - a for a, b in zip(cuts, cuts[1:])]


def block_numel_of(block_bytes: int, element_bytes: int) -> int:
    """Elements of the narrowest staged dtype (`element_bytes`) in one IO block: a cut at a multiple
    of it is block-aligned in every state kind's home (fp32 states, a bf16 parameter shard)."""
    return max(1, block_bytes // element_bytes)


__all__ = ["FUSED_UNIT_NUMEL", "block_numel_of", "staged_numels", "update_cuts"]

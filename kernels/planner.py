"""Planner kernel: the split-KV work partition, computed on the device.

The decode runs a *persistent* grid of ``num_parts`` programs along the KV axis (times
the query-row blocks). The planner lays every request's KV tiles (``block_n`` keys each)
end to end — request 0's tiles, then request 1's, ... — and cuts that sequence into
``P_eff = max(1, min(num_parts, total_tiles // min_tiles_per_part))`` equal contiguous
ranges, one per part. A request crossed by a cut is *split*; its pieces are merged by
the combine kernel. Equal ranges balance the parts whatever the length skew.

Outputs (all int32, written in place, read by the decode and combine kernels):

- ``part_info`` ``[num_parts + 1, 3]``: for part ``p``, where its range starts:
  ``(request, tile within the request, split index of that first piece)``; row
  ``num_parts`` (and every part ``>= P_eff``) is the end, ``(B, 0, 0)``. Part ``p`` covers
  ``[start(p), start(p+1))``.
- ``num_splits`` ``[B]``: pieces of each request (0 for a request with no keys).
- ``split_offsets`` ``[B]``: first row of the request's pieces in the fp32 partial buffer
  (only requests with >= 2 pieces use it: a single piece is written straight to the
  output). Rows used: at most ``2 * (num_parts - 1)`` (``DecodeConfig.partial_capacity``).

One program, no host sync, grid ``(1,)`` whatever the batch: the planner lives inside a
captured CUDA graph and re-plans on every replay from the then-current ``cache_seqlens``.

Extension point (sparse top-k decode, a later issue): a request's work is just "a count
of key tiles"; for sparse decode that count becomes ``ceil(topk_length / block_n)`` per
(request, query token) and the decode's slot computation reads ``indices`` instead of the
block table. The partition logic here does not change.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import next_pow2

__all__ = ["launch_planner", "plan_reference"]


@triton.jit
def _tiles_of(seq_ptr, offs, B, BLOCK_N: tl.constexpr):
    lens = tl.load(seq_ptr + offs, mask=offs < B, other=0)
    lens = tl.maximum(lens, 0)
    return (lens + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _cdiv64(a, b):
    return (a.to(tl.int64) + b - 1) // b


@triton.jit
def _planner_kernel(seq_ptr, part_ptr, nsplit_ptr, off_ptr, B,
                    NUM_PARTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr,
                    BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    offs_b0 = tl.arange(0, BLOCK_B)
    # pass 1: total tiles of the batch
    total = 0
    for b0 in range(0, B, BLOCK_B):
        total += tl.sum(_tiles_of(seq_ptr, b0 + offs_b0, B, BLOCK_N), axis=0)
    parts_eff = tl.maximum(tl.minimum(NUM_PARTS, total // MIN_TILES), 1)
    # Part q starts at global tile G_q = q * total // P_eff, so "how many parts start at or
    # before tile x" has a closed form, cdiv((x + 1) * P_eff, total), used below instead of
    # comparing every part with every cut. int64: total * P_eff can pass 2**31.
    total64 = tl.maximum(total, 1).to(tl.int64)
    peff64 = parts_eff.to(tl.int64)

    # pass 2, in chunks of parts: the request holding each part's start tile = the number
    # of requests ending at or before it (empty requests before it count too: skipped)
    for p0 in range(0, NUM_PARTS + 1, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        g = (p.to(tl.int64) * total.to(tl.int64) // peff64).to(tl.int32)
        g = tl.where(p <= parts_eff, g, total)
        count = tl.zeros([BLOCK_P], dtype=tl.int32)
        before = tl.zeros([BLOCK_P], dtype=tl.int32)
        carry = 0
        for b0 in range(0, B, BLOCK_B):
            tiles = _tiles_of(seq_ptr, b0 + offs_b0, B, BLOCK_N)
            incl = tl.cumsum(tiles, axis=0) + carry
            ends_before = (incl[None, :] <= g[:, None]) & ((b0 + offs_b0) < B)[None, :]
            count += tl.sum(ends_before.to(tl.int32), axis=1)
            before += tl.sum(tl.where(ends_before, tiles[None, :], 0), axis=1)
            carry += tl.sum(tiles, axis=0)
        start_tile = g - before
        live = p < parts_eff
        inner = live & (start_tile > 0)  # a cut strictly inside a request starts a new piece
        # piece index = parts q <= p starting inside this request = p + 1 - #(G_q <= its first tile)
        first_split = p + 1 - _cdiv64((before.to(tl.int64) + 1) * peff64, total64).to(tl.int32)
        first_split = tl.where(inner, first_split, 0)
        row_ok = p <= NUM_PARTS
        tl.store(part_ptr + p * 3 + 0, tl.where(p <= parts_eff, count, B), mask=row_ok)
        tl.store(part_ptr + p * 3 + 1, tl.where(live, start_tile, 0), mask=row_ok)
        tl.store(part_ptr + p * 3 + 2, first_split, mask=row_ok)

    # pass 3: pieces per request (1 + cuts strictly inside it) and their partial-buffer rows
    carry = 0
    off_carry = 0
    for b0 in range(0, B, BLOCK_B):
        offs_b = b0 + offs_b0
        tiles = _tiles_of(seq_ptr, offs_b, B, BLOCK_N)
        incl = tl.cumsum(tiles, axis=0) + carry
        excl = incl - tiles
        cuts = _cdiv64(incl.to(tl.int64) * peff64, total64) - _cdiv64((excl.to(tl.int64) + 1) * peff64, total64)
        nsplit = tl.where(tiles > 0, 1 + cuts.to(tl.int32), 0)
        used = tl.where(nsplit > 1, nsplit, 0)
        rows = tl.cumsum(used, axis=0) - used + off_carry
        tl.store(nsplit_ptr + offs_b, nsplit, mask=offs_b < B)
        tl.store(off_ptr + offs_b, rows, mask=offs_b < B)
        carry += tl.sum(tiles, axis=0)
        off_carry += tl.sum(used, axis=0)


def launch_planner(cache_seqlens: torch.Tensor, part_info: torch.Tensor, num_splits: torch.Tensor,
                   split_offsets: torch.Tensor, *, block_n: int, min_tiles_per_part: int) -> None:
    """Launch the planner (arguments checked by ``ops.plan``).

    Args:
        cache_seqlens: int32 ``[B]``; part_info: int32 ``[num_parts + 1, 3]``;
        num_splits, split_offsets: int32 ``[B]``.
    """
    B = cache_seqlens.shape[0]
    if B == 0:
        return  # nothing to plan: the decode and combine launch nothing for an empty batch
    num_parts = part_info.shape[0] - 1
    # [BLOCK_P, BLOCK_B] comparison tiles of <= 4096 elements: no register spills
    block_b = min(max(next_pow2(B), 16), 128)
    block_p = min(max(next_pow2(num_parts + 1), 16), 4096 // block_b)
    _planner_kernel[(1,)](cache_seqlens, part_info, num_splits, split_offsets, B,
                          NUM_PARTS=num_parts, BLOCK_P=block_p, BLOCK_B=block_b,
                          BLOCK_N=block_n, MIN_TILES=min_tiles_per_part, num_warps=4)


def plan_reference(seq_lens: list, *, num_parts: int, block_n: int, min_tiles_per_part: int):
    """The same partition in plain Python (for tests and diagnosis).

    Returns ``(part_info [(req, tile, split)] * (num_parts+1), num_splits [B], split_offsets [B])``.
    """
    B = len(seq_lens)
    tiles = [-(-max(int(L), 0) // block_n) for L in seq_lens]
    total = sum(tiles)
    parts_eff = max(1, min(num_parts, total // min_tiles_per_part))
    cum = [0]
    for t in tiles:
        cum.append(cum[-1] + t)
    starts = []
    for p in range(num_parts + 1):
        if p > parts_eff:
            starts.append((B, 0))
            continue
        g = p * total // parts_eff
        req = sum(1 for b in range(B) if cum[b + 1] <= g)
        starts.append((req, g - cum[req] if req < B else 0))
    info = []
    for p, (req, tile) in enumerate(starts):
        live = p < parts_eff
        inner = live and tile > 0
        split = sum(1 for q in range(p + 1) if q < parts_eff and starts[q][0] == req and starts[q][1] > 0) if inner else 0
        info.append((req if p <= parts_eff else B, tile if live else 0, split))
    nsplit = []
    for b in range(B):
        cuts = sum(1 for p in range(parts_eff) if starts[p][0] == b and starts[p][1] > 0)
        nsplit.append(0 if tiles[b] == 0 else 1 + cuts)
    offsets, acc = [], 0
    for n in nsplit:
        offsets.append(acc)
        acc += n if n > 1 else 0
    return info, nsplit, offsets

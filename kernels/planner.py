"""Planner kernel: the split-KV work partition, computed on the device.

The decode runs a *persistent* grid of ``num_parts`` programs along the KV axis (times
the query-row blocks). The planner lays every request's KV tiles (``block_n`` keys each)
end to end — request 0's tiles, then request 1's, ... — and cuts that sequence into
``P_eff`` equal contiguous ranges, one per part. A request crossed by a cut is *split*; its
pieces are merged by the combine kernel. Equal ranges balance the parts whatever the length
skew. ``P_eff`` is the fewest parts that keep the longest one at ``T = cdiv(total, P0)``
tiles, ``P0 = max(1, min(num_parts, total // min_tiles_per_part))``: ``P_eff = cdiv(total,
T)``. A batch of short requests (at most ``SHORT_TILES`` tiles a request on average;
``first_parts``) too small to keep half the parts busy at ``min_tiles_per_part`` tiles a part
is cut into parts of two tiles, up to half the parts:
``P0 = max(1, min(num_parts, max(total // min_tiles_per_part, min(total // 2, num_parts //
2))))`` -- a change only for ``min_tiles_per_part > 2`` (the few-row TMA kernels' 4). Longer
requests keep the rule above: parts of two tiles would double the pieces the combine merges
one after another. The decode's time follows its longest part, which is ``T`` tiles either
way, while fewer parts cut fewer requests (less partial traffic, less combine work) and, when
requests hold multiples of ``T`` tiles, cut them only at their ends: B=32 requests of 8 tiles over
132 parts are 128 parts of 2 tiles, each inside one request, instead of 132 parts of 1-2
tiles straddling requests.

Outputs (all int32, written in place, read by the decode and combine kernels):

- ``part_info`` ``[num_parts + 1, 3]``: for part ``p``, where its range starts:
  ``(request, tile within the request, split index of that first piece)``; row
  ``num_parts`` (and every part ``>= P_eff``) is the end, ``(B, 0, 0)``. Part ``p`` covers
  ``[start(p), start(p+1))``.
- ``num_splits`` ``[B]``: pieces of each request (0 for a request with no keys).
- ``split_offsets`` ``[B]``: first row of the request's pieces in the fp32 partial buffer
  (only requests with >= 2 pieces use it: a single piece is written straight to the
  output). Rows used: at most ``2 * (num_parts - 1)`` (``DecodeConfig.partial_capacity``).

Grid (no host sync; its size depends only on ``B`` and ``num_parts``, so one captured CUDA
graph re-plans on every replay from the then-current ``cache_seqlens``): one launch of
independent programs of two roles, none waiting on another, so the latency is that of one
short program whatever the batch:

- ``cdiv(num_parts + 1, BLOCK_P)`` *part programs*, one per chunk of ``part_info`` rows;
- ``cdiv(B, BLOCK_B)`` *request programs*, one per chunk of requests, writing their
  ``num_splits`` / ``split_offsets``.

Under Triton's interpreter (CPU), where programs run one after another, a launch of one
part program and one request program runs as one program doing both roles in turn
(``FUSED``), sparing the repeated prologue; the GPU launch is unchanged (``FUSED=0``).

Part ``q`` starts at global tile ``G_q = q * total // P_eff``. A part program finds the
request holding each of its ``G_q`` by comparing them with the requests' inclusive tile
prefix sums (a ``[BLOCK_P, BLOCK_B]`` tile: the requests ending at or before ``G_q``); a
request program counts the cuts inside each request in closed form (the parts starting at
or before tile ``x`` number ``cdiv((x + 1) * P_eff, total)``), then prefix-sums the rows
of split requests. Every program recomputes the batch total (hence ``P_eff``) from the seq lens itself: ``B``
int32 loads, far cheaper than any inter-program hand-off. A batch of up to ``BLOCK_B``
(1024) requests is one chunk, held in registers and loaded once; longer batches loop over
chunks (a request program also re-derives the pieces of the requests before its chunk, for
its first partial-buffer row).

Extension point (sparse top-k decode, a later issue): a request's work is just "a count
of key tiles"; for sparse decode that count becomes ``ceil(topk_length / block_n)`` per
(request, query token) and the decode's slot computation reads ``indices`` instead of the
block table. The partition logic here does not change.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import interpreting, next_pow2
from .hopper.pdl import grid_release, pdl_on

__all__ = ["launch_planner", "plan_reference", "first_parts", "SHORT_TILES"]

#: the short-batch rule (module doc): its requests hold at most this many tiles on average (2048
#: keys at 64). Parts of four tiles left most SMs idle at h=16 B=8 L=1k; parts of two won there
#: (1.05-1.17x) and lost at 32+ pieces a request (h100-2026-11-27-short-parts.json)
SHORT_TILES = 32


# Chunk caps (module-level so tests can shrink them to exercise the multi-chunk paths with
# small batches). 1024 seq lens fit one chunk: every batch size the decode is tuned for is
# planned without loops over the batch.
_MAX_BLOCK_B = 1024
_MAX_BLOCK_P = 32
# Under the interpreter, a launch of one part program and one request program (every batch
# the CPU fuzzer draws) runs as one program doing both roles (FUSED): programs run one after
# the other there, so a second program only repeats the shared prologue (the batch total).


@triton.jit(do_not_specialize=("B",))  # the batch: one variant for every batch size
def _planner_kernel(seq_ptr, part_ptr, nsplit_ptr, off_ptr, B,
                    NUM_PARTS: tl.constexpr, PART_PROGS: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
                    FUSED: tl.constexpr, PDL: tl.constexpr = False, SHORT: tl.constexpr = False,
                    SHORT_TILES: tl.constexpr = 32):
    # No nested jit helpers: under TRITON_INTERPRET=1 every nested call re-patches the
    # interpreter (milliseconds each), paid per program of every test example.
    #
    # Divisions: q = n // d with d fixed per program is an fp64 estimate n * (1 / d) plus one
    # correction step, instead of int64 `//` (a called subroutine per element on the GPU).
    # Exact: every n here is < 2**53 (tiles < 2**31 times parts), so it converts exactly,
    # and the estimate's relative error ~2**-52 times a quotient < 2**31 is off by < 1.
    if PDL:
        # let the decode's blocks be scheduled now; they wait for this grid's end (kernels/hopper/pdl.py)
        grid_release()
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    # Every program derives the batch total itself (no inter-program hand-off). The first
    # chunk's tiles stay in registers for the loops below: a one-chunk batch is loaded once.
    lens = tl.load(seq_ptr + offs_b, mask=offs_b < B, other=0)
    tiles = (tl.maximum(lens, 0) + BLOCK_N - 1) // BLOCK_N
    total = tl.sum(tiles, axis=0)
    busy = tl.sum((tiles > 0).to(tl.int32), axis=0)  # requests with keys
    for b0 in range(BLOCK_B, B, BLOCK_B):
        lens_x = tl.load(seq_ptr + b0 + offs_b, mask=(b0 + offs_b) < B, other=0)
        total += tl.sum((tl.maximum(lens_x, 0) + BLOCK_N - 1) // BLOCK_N, axis=0)
        busy += tl.sum((lens_x > 0).to(tl.int32), axis=0)
    parts0 = total // MIN_TILES
    if SHORT:  # first_parts: parts of two tiles, up to half of them, for a batch of short requests
        parts0 = tl.where(total <= SHORT_TILES * busy, tl.maximum(parts0, tl.minimum(total // 2, NUM_PARTS // 2)),
                          parts0)
    parts0 = tl.maximum(tl.minimum(NUM_PARTS, parts0), 1)
    # int64: total * P_eff can pass 2**31 (and total + T - 1 nearly so)
    total64 = tl.maximum(total, 1).to(tl.int64)
    # the fewest parts of at most T = cdiv(total, P0) tiles (module doc); scalar divisions, once
    longest = (total64 + parts0.to(tl.int64) - 1) // parts0.to(tl.int64)
    peff64 = (total64 + longest - 1) // longest
    parts_eff = peff64.to(tl.int32)
    inv_total = 1.0 / total64.to(tl.float64)
    carry = total * 0  # tiles of the chunks already walked
    # FUSED (0 or 1; interpreter only, see _launch_shape): one program, both roles in turn
    if pid < PART_PROGS:
        # ---- part program: part_info rows [pid * BLOCK_P, (pid + 1) * BLOCK_P)
        p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
        # start tile G_p = p * total // P_eff
        num = p.to(tl.int64) * total
        g64 = (num.to(tl.float64) * (1.0 / peff64.to(tl.float64))).to(tl.int64)
        rem = num - g64 * peff64
        g64 = tl.where(rem >= peff64, g64 + 1, tl.where(rem < 0, g64 - 1, g64))
        g = tl.where(p <= parts_eff, g64.to(tl.int32), total)
        # the request holding G_p = the requests ending at or before it (empty requests before
        # it count too: skipped); `before` = their tiles, i.e. G_p minus the start tile
        count = tl.zeros([BLOCK_P], dtype=tl.int32)
        before = tl.zeros([BLOCK_P], dtype=tl.int32)
        for b0 in range(0, B, BLOCK_B):
            incl_p = tl.cumsum(tiles, axis=0) + carry
            ends_before = (incl_p[None, :] <= g[:, None]) & ((b0 + offs_b) < B)[None, :]
            count += tl.sum(ends_before.to(tl.int32), axis=1)
            before += tl.sum(tl.where(ends_before, tiles[None, :], 0), axis=1)
            carry += tl.sum(tiles, axis=0)
            # next chunk (every lane masked off after the last one: no memory traffic)
            nxt = b0 + BLOCK_B + offs_b
            lens = tl.load(seq_ptr + nxt, mask=nxt < B, other=0)
            tiles = (tl.maximum(lens, 0) + BLOCK_N - 1) // BLOCK_N
        start_tile = g - before
        live = p < parts_eff
        inner = live & (start_tile > 0)  # a cut strictly inside a request starts a new piece
        # The parts starting at or before tile x number cdiv((x + 1) * P_eff, total), so the
        # piece index of part p (the parts q <= p starting inside its request) is
        # p + 1 - #(G_q <= the request's first tile).
        num = (before.to(tl.int64) + 1) * peff64 + total64 - 1
        q = (num.to(tl.float64) * inv_total).to(tl.int64)
        rem = num - q * total64
        q = tl.where(rem >= total64, q + 1, tl.where(rem < 0, q - 1, q))
        first_split = tl.where(inner, p + 1 - q.to(tl.int32), 0)
        row_ok = p <= NUM_PARTS
        tl.store(part_ptr + p * 3 + 0, tl.where(p <= parts_eff, count, B), mask=row_ok)
        tl.store(part_ptr + p * 3 + 1, tl.where(live, start_tile, 0), mask=row_ok)
        tl.store(part_ptr + p * 3 + 2, first_split, mask=row_ok)
    if pid >= PART_PROGS - FUSED:
        if FUSED:
            # the part role walked the chunks: back to the first one
            lens = tl.load(seq_ptr + offs_b, mask=offs_b < B, other=0)
            tiles = (tl.maximum(lens, 0) + BLOCK_N - 1) // BLOCK_N
            carry = total * 0
        # ---- request program: num_splits / split_offsets of requests [r0, r0 + BLOCK_B).
        # Pieces = 1 + the part starts strictly inside the request, i.e. in tiles
        # [first + 1, last]: cdiv(incl * P_eff, total) - cdiv((excl + 1) * P_eff, total).
        # The chunks before r0 are walked too: their split requests' rows come first.
        r0 = (pid - PART_PROGS + FUSED) * BLOCK_B
        off_carry = total * 0
        nsplit = tl.zeros([BLOCK_B], dtype=tl.int32)
        rows = tl.zeros([BLOCK_B], dtype=tl.int32)
        for b0 in range(0, r0 + 1, BLOCK_B):
            incl = (tl.cumsum(tiles, axis=0) + carry).to(tl.int64)
            hi = incl * peff64 + total64 - 1
            q_hi = (hi.to(tl.float64) * inv_total).to(tl.int64)
            rem = hi - q_hi * total64
            q_hi = tl.where(rem >= total64, q_hi + 1, tl.where(rem < 0, q_hi - 1, q_hi))
            lo = (incl - tiles + 1) * peff64 + total64 - 1
            q_lo = (lo.to(tl.float64) * inv_total).to(tl.int64)
            rem = lo - q_lo * total64
            q_lo = tl.where(rem >= total64, q_lo + 1, tl.where(rem < 0, q_lo - 1, q_lo))
            nsplit = tl.where(tiles > 0, 1 + (q_hi - q_lo).to(tl.int32), 0)
            used = tl.where(nsplit > 1, nsplit, 0)  # a single piece goes straight to the output
            rows = tl.cumsum(used, axis=0) - used + off_carry
            carry += tl.sum(tiles, axis=0)
            off_carry += tl.sum(used, axis=0)
            nxt = b0 + BLOCK_B + offs_b
            lens = tl.load(seq_ptr + nxt, mask=nxt < B, other=0)
            tiles = (tl.maximum(lens, 0) + BLOCK_N - 1) // BLOCK_N
        own = r0 + offs_b
        tl.store(nsplit_ptr + own, nsplit, mask=own < B)
        tl.store(off_ptr + own, rows, mask=own < B)


def _launch_shape(B: int, num_parts: int) -> tuple:
    """``(BLOCK_B, BLOCK_P, part programs, request programs, num_warps)`` for a batch of B."""
    block_b = min(max(next_pow2(B), 16), _MAX_BLOCK_B)
    # Little work per program: one warp keeps every reduction and scan in shuffles (no
    # shared-memory round trips) while a chunk is small; wider chunks get more warps so a
    # thread holds ~16 elements of the [BLOCK_P, BLOCK_B] comparison tile.
    num_warps = 1 if block_b <= 64 else (2 if block_b <= 256 else 4)
    block_p = max(2, min(512 * num_warps // block_b, _MAX_BLOCK_P, next_pow2(num_parts + 1)))
    part_progs = triton.cdiv(num_parts + 1, block_p)
    req_progs = triton.cdiv(B, block_b)
    return block_b, block_p, part_progs, req_progs, num_warps


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
    block_b, block_p, part_progs, req_progs, num_warps = _launch_shape(B, num_parts)
    fused = int(part_progs == 1 and req_progs == 1 and interpreting())
    _planner_kernel[(part_progs + req_progs - fused,)](
        cache_seqlens, part_info, num_splits, split_offsets, B,
        NUM_PARTS=num_parts, PART_PROGS=part_progs, BLOCK_P=block_p, BLOCK_B=block_b,
        BLOCK_N=block_n, MIN_TILES=min_tiles_per_part, FUSED=fused, PDL=pdl_on(cache_seqlens),
        SHORT=_short(min_tiles_per_part), SHORT_TILES=SHORT_TILES, num_warps=num_warps)


def _short(min_tiles_per_part: int) -> bool:
    # the rule changes nothing at parts of at most two tiles: one compiled variant there
    return min_tiles_per_part > 2


def first_parts(total: int, requests: int, *, num_parts: int, min_tiles_per_part: int) -> int:
    """``P0``, the parts the planner first cuts ``total`` key tiles of ``requests`` requests with keys
    into (module doc): ``min(num_parts, total // min_tiles_per_part)``, at least 1; with parts of
    more than two tiles and at most ``SHORT_TILES`` tiles a request, at least ``min(total // 2,
    num_parts // 2)`` too. ``P_eff`` then follows from ``T = cdiv(total, P0)``."""
    short = _short(min_tiles_per_part)
    p0 = total // min_tiles_per_part
    if short and total <= SHORT_TILES * requests:
        p0 = max(p0, min(total // 2, num_parts // 2))
    return max(1, min(num_parts, p0))


def plan_reference(seq_lens: list, *, num_parts: int, block_n: int, min_tiles_per_part: int):
    """The same partition in plain Python (for tests and diagnosis).

    Returns ``(part_info [(req, tile, split)] * (num_parts+1), num_splits [B], split_offsets [B])``.
    """
    B = len(seq_lens)
    tiles = [-(-max(int(L), 0) // block_n) for L in seq_lens]
    total = sum(tiles)
    parts0 = first_parts(total, sum(t > 0 for t in tiles), num_parts=num_parts, min_tiles_per_part=min_tiles_per_part)
    longest = -(-max(total, 1) // parts0)
    parts_eff = -(-max(total, 1) // longest)
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

"""Combine kernel: merge the fp32 partials of split requests into ``out`` and ``lse``.

Grid ``(B, ceil(s_q*h / BLOCK_M), col_blocks)`` -- fixed by the padded batch size and the
config. Program ``(b, mb, c)`` merges latent columns ``c * BLOCK_R ...`` (``BLOCK_R = rank /
col_blocks``) of rows ``mb * BLOCK_M ...`` of request ``b``; column block 0 also writes the
rows' lse. Splitting the columns is for the GPU (a long request in few pieces of a small batch
would otherwise be merged by one program reading every piece in turn); the interpreter keeps one
column block, since its cost is per executed op. Per request:

- ``num_splits == 1``: the decode kernel already wrote the final rows; the program returns after
  loading ``num_splits``;
- ``num_splits >= 2``: log-sum-exp merge of its pieces' partials (pieces past the partial buffer
  are not read; a request left with none gets 0 / -inf)::

      m = max_j lse_j;  w_j = exp2(lse_j - m);  out = sum_j w_j o_j / sum_j w_j;  lse = (m + log2 sum_j w_j) ln 2

- ``num_splits == 0`` (seq_len 0, e.g. a padded row): out 0, lse -inf written explicitly (without
  the merge's loops), so no output row is ever left uninitialised.

Most programs are of the first and last kinds (only requests crossed by a cut are split), so
they are kept short: under the interpreter every executed op costs ~20 us.

The merge is one pass over the pieces, ``COMBINE_CHUNK`` (4) a trip, unrolled: each piece (its lse
``[BLOCK_M]`` and partial rows ``[BLOCK_M, BLOCK_R]``) is folded into a running max, sum and
accumulator (rescaled by ``2**(m_old - m_new)``, as the decode's online softmax). Compiled for
sm_90, each piece's tile is loaded into the registers the previous one was folded from, so a
program would have one piece in flight at a time; with blocks of at most ``NARROW_COLUMNS``
columns (``LOADS_FIRST``) a trip loads its four pieces into four tensors and only then folds them,
and a launch whose grid would leave SMs idle (``combine_columns``) narrows its blocks to 32
columns, 4x the programs. While ``WIDE_TRIP`` (16) or more pieces remain, a narrow trip loads
sixteen (four groups of four, all issued before the first is folded) and folds them four at a
time, the same arithmetic in the same order (bit for bit the same results).

Launched with programmatic dependent launch where the device has it (``kernels/hopper/pdl.py``):
its wait comes before any read of the plan or the partials. The measurements behind each step
are in ``docs/kernel-performance.md``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import interpreting, sm_count
from .hopper.pdl import grid_wait, launch_options, pdl_on
from .rounding import to_out

__all__ = ["launch_combine", "combine_columns", "COMBINE_CHUNK", "NARROW_COLUMNS", "WIDE_TRIP"]

#: pieces of a request merged per loop trip: their loads are independent, so a trip keeps
#: CHUNK of them in flight (module doc; 4 and 8 measured alike at B=1, 4 level elsewhere)
COMBINE_CHUNK = 4
#: columns of a "narrow" block: at most this many (and chunks of 4) and the four pieces of a
#: trip are loaded before they are folded (module doc, "Loads first"); also what a launch that
#: would leave SMs idle narrows its blocks to
NARROW_COLUMNS = 32
#: pieces a narrow block's trip loads while that many remain (module doc, "Wide trips"); the
#: kernel's wide trip is four ``_load4`` groups, so this is 16 (a static assertion holds it)
WIDE_TRIP = 16


@triton.jit
def _load4(po_ptr, plse_ptr, r0, jv, n, row_ok, offs_m, prow, ROWS, RANK: tl.constexpr):
    # Pieces r0 .. r0 + 3 of the partial buffer, those of index (jv: as a [BLOCK_M] tensor, the
    # interpreter takes no scalar masks) below n: lse [BLOCK_M] (-inf past n) and partial rows
    # [BLOCK_M, BLOCK_R] at prow (0 past n), four independent loads
    ok0 = row_ok & (jv < n)
    ok1 = row_ok & (jv + 1 < n)
    ok2 = row_ok & (jv + 2 < n)
    ok3 = row_ok & (jv + 3 < n)
    l0 = tl.load(plse_ptr + r0 * ROWS + offs_m, mask=ok0, other=float("-inf"))
    l1 = tl.load(plse_ptr + (r0 + 1) * ROWS + offs_m, mask=ok1, other=float("-inf"))
    l2 = tl.load(plse_ptr + (r0 + 2) * ROWS + offs_m, mask=ok2, other=float("-inf"))
    l3 = tl.load(plse_ptr + (r0 + 3) * ROWS + offs_m, mask=ok3, other=float("-inf"))
    p0 = tl.load(po_ptr + r0 * (ROWS * RANK) + prow, mask=ok0[:, None], other=0.0)
    p1 = tl.load(po_ptr + (r0 + 1) * (ROWS * RANK) + prow, mask=ok1[:, None], other=0.0)
    p2 = tl.load(po_ptr + (r0 + 2) * (ROWS * RANK) + prow, mask=ok2[:, None], other=0.0)
    p3 = tl.load(po_ptr + (r0 + 3) * (ROWS * RANK) + prow, mask=ok3[:, None], other=0.0)
    return l0, l1, l2, l3, p0, p1, p2, p3


@triton.jit
def _fold4(m, l_sum, acc, l0, l1, l2, l3, p0, p1, p2, p3):
    # Four loaded pieces folded into the running max m, sum l_sum ([BLOCK_M]) and accumulator
    # acc ([BLOCK_M, BLOCK_R]), rescaled by 2**(m_old - m_new) as the decode's online softmax
    m_new = tl.maximum(tl.maximum(m, tl.maximum(l0, l1)), tl.maximum(l2, l3))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)  # 0 while m is -inf (nothing merged yet)
    w0 = tl.exp2(l0 - m_ref)  # 0 for a masked piece or a row without keys
    w1 = tl.exp2(l1 - m_ref)
    w2 = tl.exp2(l2 - m_ref)
    w3 = tl.exp2(l3 - m_ref)
    l_sum = l_sum * alpha + ((w0 + w1) + (w2 + w3))
    acc = acc * alpha[:, None] + w0[:, None] * p0 + w1[:, None] * p1 + w2[:, None] * p2 + w3[:, None] * p3
    return m_new, l_sum, acc


@triton.jit(do_not_specialize=("partial_cap", "SQ"))  # why: config.UNSPECIALIZED_DECODE_INTEGERS
def _combine_kernel(po_ptr, plse_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, partial_cap, SQ, H,
                    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
                    LOADS_FIRST: tl.constexpr = False, PDL: tl.constexpr = False, WIDE: tl.constexpr = 16):
    if PDL:  # before any read of the plan or the partials (kernels/hopper/pdl.py)
        grid_wait()
    b = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    # one column block (the interpreter's default): no column offset, every program stores
    # its rows' lse -- compile-time branches, so the interpreter executes no extra op
    ONE_COL: tl.constexpr = BLOCK_R == RANK
    ROWS = SQ * H
    LN2: tl.constexpr = 0.6931471805599453
    nsplit = tl.load(nsplit_ptr + b)
    # A request in one piece was written by the decode: nothing to do. Most programs are
    # these (or padding, below); returning first keeps them to a load and a branch.
    if nsplit == 1:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < ROWS
    tok = offs_m // H
    head = offs_m % H
    if ONE_COL:
        offs_r = tl.arange(0, BLOCK_R)
        lse_here = True
    else:
        pid_r = tl.program_id(2)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        lse_here = pid_r == 0  # one column block writes the rows' lse
    out_rows = out_ptr + b * (ROWS * RANK) + offs_m[:, None] * RANK + offs_r[None, :]
    lse_rows = lse_ptr + b * ROWS + head * SQ + tok
    if nsplit <= 0:
        # no keys (seq_len 0, e.g. a padded request): out 0 / lse -inf, the values the
        # merge below gives with no piece, without its loops and arithmetic
        tl.store(out_rows, tl.zeros([BLOCK_M, BLOCK_R], dtype=out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if lse_here:
            tl.store(lse_rows, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=row_ok)
        return
    first = tl.load(off_ptr + b)

    # pieces to merge; clamped to the buffer so a bad plan cannot read past it
    n = tl.where(nsplit > 1, nsplit, 0)
    n = tl.minimum(n, partial_cap - first)
    # One pass over the pieces, CHUNK at a time, with a running max (module doc): the trip's
    # CHUNK loads are unrolled and independent of each other, so they are in flight together
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if LOADS_FIRST:
        # Narrow column blocks: a trip's pieces are loaded into separate tensors before any is
        # folded, so their loads are in flight together (module doc, "Loads first"); sixteen
        # a trip while sixteen remain, then four (module doc, "Wide trips")
        prow = offs_m[:, None] * RANK + offs_r[None, :]
        tl.static_assert(WIDE == 16)  # four groups of four below
        j_wide = n - n % WIDE
        for j0 in range(0, j_wide, WIDE):
            r0 = (first + j0).to(tl.int64)
            jv = offs_m * 0 + j0
            l0, l1, l2, l3, p0, p1, p2, p3 = _load4(po_ptr, plse_ptr, r0, jv, n, row_ok, offs_m, prow, ROWS, RANK)
            l4, l5, l6, l7, p4, p5, p6, p7 = _load4(po_ptr, plse_ptr, r0 + 4, jv + 4, n, row_ok, offs_m, prow, ROWS,
                                                    RANK)
            l8, l9, la, lb, p8, p9, pa, pb = _load4(po_ptr, plse_ptr, r0 + 8, jv + 8, n, row_ok, offs_m, prow, ROWS,
                                                    RANK)
            lc, ld, le, lf, pc, pd, pe, pf = _load4(po_ptr, plse_ptr, r0 + 12, jv + 12, n, row_ok, offs_m, prow, ROWS,
                                                    RANK)
            m, l_sum, acc = _fold4(m, l_sum, acc, l0, l1, l2, l3, p0, p1, p2, p3)
            m, l_sum, acc = _fold4(m, l_sum, acc, l4, l5, l6, l7, p4, p5, p6, p7)
            m, l_sum, acc = _fold4(m, l_sum, acc, l8, l9, la, lb, p8, p9, pa, pb)
            m, l_sum, acc = _fold4(m, l_sum, acc, lc, ld, le, lf, pc, pd, pe, pf)
        for j0 in range(j_wide, n, 4):
            r0 = (first + j0).to(tl.int64)
            jv = offs_m * 0 + j0
            l0, l1, l2, l3, p0, p1, p2, p3 = _load4(po_ptr, plse_ptr, r0, jv, n, row_ok, offs_m, prow, ROWS, RANK)
            m, l_sum, acc = _fold4(m, l_sum, acc, l0, l1, l2, l3, p0, p1, p2, p3)
    else:
        for j0 in range(0, n, CHUNK):
            for c in tl.static_range(CHUNK):
                row = (first + j0 + c).to(tl.int64)
                ok = row_ok & ((offs_m * 0 + j0 + c) < n)
                lse_j = tl.load(plse_ptr + row * ROWS + offs_m, mask=ok, other=float("-inf"))
                part = tl.load(po_ptr + row * (ROWS * RANK) + offs_m[:, None] * RANK + offs_r[None, :],
                               mask=ok[:, None], other=0.0)
                m_new = tl.maximum(m, lse_j)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_ref)  # 0 while m is -inf (nothing merged yet)
                w = tl.exp2(lse_j - m_ref)  # 0 for a masked piece or a row without keys
                l_sum = l_sum * alpha + w
                acc = acc * alpha[:, None] + w[:, None] * part
                m = m_new
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    has_keys = l_sum > 0.0
    o = acc / tl.where(has_keys, l_sum, 1.0)[:, None]
    lse = tl.where(has_keys, (m_ref + tl.log2(tl.where(has_keys, l_sum, 1.0))) * LN2, float("-inf"))
    tl.store(out_rows, to_out(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if lse_here:
        tl.store(lse_rows, lse, mask=row_ok)


def combine_columns(pairs: int, col_blocks: int, rank: int, out: torch.Tensor) -> int:
    """Column blocks a combine launch takes: ``col_blocks`` (the config's), or on a GPU whose
    SMs the grid would not fill (``pairs`` request x row-block pairs times ``col_blocks`` below
    the SM count) blocks of ``NARROW_COLUMNS`` columns where the rank allows (module doc,
    "Loads first"). ``out`` (any shape) gives the device; the interpreter keeps the config's."""
    if out.device.type != "cuda" or interpreting():
        return col_blocks
    narrow = rank // NARROW_COLUMNS
    if narrow <= col_blocks or rank % NARROW_COLUMNS or pairs * col_blocks >= sm_count(out.device):
        return col_blocks
    return narrow


def launch_combine(partial_o, partial_lse, num_splits, split_offsets, out, lse, *, block_m: int,
                   col_blocks: int = 1, chunk: int = COMBINE_CHUNK) -> None:
    """Launch the combine (arguments checked by ``ops.combine``).

    Shapes: partial_o fp32 ``[cap, s_q*h, rank]``; partial_lse fp32 ``[cap, s_q*h]`` (base 2);
    num_splits / split_offsets int32 ``[B]``; out ``[B, s_q, h, rank]``; lse fp32 ``[B, h, s_q]``.
    ``col_blocks``: programs per row block along the latent columns (``rank / col_blocks``
    columns each, a power of two). ``chunk``: pieces merged per loop trip (a positive int; the trip is unrolled).
    """
    B, s_q, h, rank = out.shape
    if B == 0:
        return
    row_blocks = triton.cdiv(s_q * h, block_m)
    col_blocks = combine_columns(B * row_blocks, col_blocks, rank, out)
    grid = (B, row_blocks, col_blocks)
    pdl = pdl_on(out)
    _combine_kernel[grid](partial_o, partial_lse, num_splits, split_offsets, out, lse, partial_o.shape[0], s_q, h,
                          RANK=rank, BLOCK_M=block_m, BLOCK_R=rank // col_blocks, CHUNK=chunk,
                          LOADS_FIRST=rank // col_blocks <= NARROW_COLUMNS and chunk == 4, PDL=pdl, WIDE=WIDE_TRIP,
                          num_warps=4, **launch_options(pdl))

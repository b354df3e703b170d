"""The plan-row reads shared by the Gluon decode kernels (``decode_wgmma``, ``decode_wgmma_keys``).

The planner (``kernels/planner.py``) writes ``part_info`` ``[num_parts + 1, 3]`` int32: part
``p`` covers the key tiles from row ``p``'s ``(request, tile, piece)`` to row ``p + 1``'s.
A decode program walks the requests of its part and, for each, needs the tiles it owns,
the request's piece count and the row of its fp32 partial. The Triton kernels inline these
lines (under the interpreter a nested jit call costs more than the lines,
``decode_split`` module doc); the Gluon kernels, GPU-only, share them here.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernels only
    gluon = None

__all__ = ["part_bounds", "request_span"]

if gluon is not None:

    @gluon.jit
    def part_bounds(part_ptr, pid_p):
        """Part ``pid_p``'s bounds from ``part_info`` (int32 ``[num_parts + 1, 3]``): its first
        request, tile and piece (``b_first, t_first, j_first``), the end row's request and tile
        (``b_end, t_end``) and the last request it touches (``b_last``); int32 scalars."""
        b_first = gl.load(part_ptr + pid_p * 3 + 0)
        t_first = gl.load(part_ptr + pid_p * 3 + 1)
        j_first = gl.load(part_ptr + pid_p * 3 + 2)
        b_end = gl.load(part_ptr + (pid_p + 1) * 3 + 0)
        t_end = gl.load(part_ptr + (pid_p + 1) * 3 + 1)
        # an end at tile 0 of b_end leaves b_end to the next part
        b_last = gl.where(t_end > 0, b_end, b_end - 1)
        return b_first, t_first, j_first, b_end, t_end, b_last

    @gluon.jit
    def request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr, nsplit_ptr, off_ptr,
                     BLOCK_N: gl.constexpr):
        """For request ``b`` of a part (bounds from ``part_bounds``): its key count
        (``seq_ptr``: int32 ``[B]``), the part's tiles ``[t0, t1)`` of it (``BLOCK_N`` keys each;
        empty when ``t1 <= t0``), its piece count (``nsplit_ptr``: int32 ``[B]``) and the
        partial-buffer row of this piece (``off_ptr``: int32 ``[B]``, plus the piece index);
        int32 scalars."""
        seq_len = gl.load(seq_ptr + b)
        n_tiles = (gl.maximum(seq_len, 0) + BLOCK_N - 1) // BLOCK_N
        t0 = gl.where(b == b_first, t_first, 0)
        t1 = gl.where(b == b_end, t_end, n_tiles)
        nsplit = gl.load(nsplit_ptr + b)
        p_row = gl.load(off_ptr + b) + gl.where(b == b_first, j_first, 0)
        return seq_len, t0, t1, nsplit, p_row

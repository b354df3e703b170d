"""The combine kernel on its own: what it writes for each kind of request.

Requests in one piece (``num_splits == 1``) were written by the decode and must be left
alone (the kernel returns before touching them); requests without keys
(``num_splits == 0``) get out 0 / lse -inf; split requests get the log-sum-exp merge of
their pieces, including pieces with no keys, and never more pieces than the buffer holds.
Runs on CPU (interpreter) and, with a GPU, compiled.
"""
from __future__ import annotations

import math

import pytest
import torch

from mla_fuzz.kernels import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = 7.25  # exact in bf16/fp16/fp32: a row left alone keeps it


def merge_reference(po, plse, first, n):
    """fp64 merge of pieces ``[first, first + n)``: out ``[rows, rank]``, natural-log lse ``[rows]``."""
    po, plse = po[first:first + n].double(), plse[first:first + n].double()
    m = plse.max(dim=0).values
    m_ref = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w = torch.exp2(plse - m_ref[None])
    l_sum = w.sum(dim=0)
    has = l_sum > 0
    o = (w[..., None] * po).sum(dim=0) / torch.where(has, l_sum, torch.ones_like(l_sum))[:, None]
    lse = torch.where(has, (m_ref + torch.log2(torch.where(has, l_sum, torch.ones_like(l_sum)))) * math.log(2),
                      torch.full_like(l_sum, -math.inf))
    return o, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("s_q,h,col_blocks", [(2, 3, 1), (1, 16, 1), (3, 8, 1), (2, 3, 4), (1, 16, 2)])
def test_combine_by_kind_of_request(dtype, s_q, h, col_blocks):
    """Also with the latent columns split over programs (``col_blocks``): every column of
    every row is merged, lse is written once, untouched requests stay untouched."""
    g = torch.Generator().manual_seed(3)
    rank, cap = 32, 12
    rows = s_q * h
    # request:          0  1  2  3  4  5   6
    nsplit = torch.tensor([0, 1, 3, 0, 2, 1, 4], dtype=torch.int32)
    offsets = torch.tensor([0, 0, 0, 9, 3, 9, 5], dtype=torch.int32)
    B = nsplit.numel()
    po = torch.randn(cap, rows, rank, generator=g)
    plse = torch.randn(cap, rows, generator=g) * 4
    plse[4] = -math.inf  # request 4: its first piece has no keys
    plse[5:9, 0] = -math.inf  # request 6, row 0: no piece has keys
    # rows no request of this plan owns: NaN, so reading them would show
    po[9:] = float("nan")
    plse[9:] = float("nan")
    out = torch.full((B, s_q, h, rank), SENTINEL, dtype=dtype)
    lse = torch.full((B, h, s_q), SENTINEL, dtype=torch.float32)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out_d, lse_d = dev(out), dev(lse)
    ops.combine(dev(po), dev(plse), dev(nsplit), dev(offsets), out_d, lse_d, 16, col_blocks)
    out, lse = out_d.cpu(), lse_d.cpu()
    lse_rows = lse.permute(0, 2, 1).reshape(B, rows)  # [B, h, s_q] -> rows token-major
    out_rows = out.reshape(B, rows, rank)
    for b in range(B):
        n = int(nsplit[b])
        if n == 1:
            assert (out_rows[b] == SENTINEL).all() and (lse_rows[b] == SENTINEL).all(), \
                f"request {b} (one piece) was written by the combine"
        elif n == 0:
            assert (out_rows[b] == 0).all() and not torch.signbit(out_rows[b].float()).any(), f"request {b}"
            assert (lse_rows[b] == -math.inf).all(), f"request {b}"
        else:
            o_ref, lse_ref = merge_reference(po, plse, int(offsets[b]), n)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out_rows[b].double(), o_ref.to(dtype).double(), rtol=tol, atol=tol)
            torch.testing.assert_close(lse_rows[b].double(), lse_ref, rtol=1e-5, atol=1e-5)
    # request 6, row 0: every piece empty -> 0 / -inf, like a request without keys
    assert (out_rows[6, 0] == 0).all() and lse_rows[6, 0] == -math.inf



@pytest.mark.parametrize("col_blocks,trip", [(1, "chunk"), (2, "chunk"), (4, "chunk"), (1, "wide"), (2, "wide"),
                                             (4, "wide")])
def test_combine_many_pieces_over_several_trips(col_blocks, trip):
    """Requests of more pieces than one merge trip holds (``combine.COMBINE_CHUNK``, or the
    narrow blocks' ``combine.WIDE_TRIP``): a whole number of trips, one and a piece, and a last
    trip of a single piece; the running max rises in a later trip (a large lse there) and some
    pieces have no keys for some rows. The rows past each request's pieces are NaN, so a lane
    of a trip that reads past its request would show. Rank 64: one column block folds piece by
    piece, two and four (32 and 16 columns) load a trip's pieces first
    (``combine.NARROW_COLUMNS``), sixteen a trip while sixteen remain."""
    from mla_fuzz.kernels.combine import COMBINE_CHUNK, WIDE_TRIP
    K = COMBINE_CHUNK if trip == "chunk" else WIDE_TRIP
    g = torch.Generator().manual_seed(11)
    rank, rows = 64, 6
    nsplit = torch.tensor([2 * K, K + 1, 2 * K + 1, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 2 * K + 1, 3 * K + 3, 0], dtype=torch.int32)  # one NaN row after each
    cap = 5 * K + 5
    po = torch.randn(cap, rows, rank, generator=g)
    plse = torch.randn(cap, rows, generator=g) * 3
    plse[K + 1, :] += 40.0  # request 0: the max moves up in its second trip
    plse[2 * K + 1:2 * K + 3, 2] = -math.inf  # request 1: pieces without keys in row 2
    for b in range(3):
        end = int(offsets[b] + nsplit[b])
        po[end], plse[end] = float("nan"), float("nan")
    out_d = torch.full((4, 1, rows, rank), SENTINEL, dtype=torch.float32, device=DEVICE)
    lse_d = torch.full((4, rows, 1), SENTINEL, dtype=torch.float32, device=DEVICE)
    ops.combine(po.to(DEVICE), plse.to(DEVICE), nsplit.to(DEVICE), offsets.to(DEVICE), out_d, lse_d, 16, col_blocks)
    out, lse = out_d.cpu().reshape(4, rows, rank), lse_d.cpu().reshape(4, rows)
    for b in range(3):
        o_ref, lse_ref = merge_reference(po, plse, int(offsets[b]), int(nsplit[b]))
        torch.testing.assert_close(out[b].double(), o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b].double(), lse_ref, rtol=1e-5, atol=1e-5)
    assert (out[3] == SENTINEL).all() and (lse[3] == SENTINEL).all()  # one piece: untouched

def test_combine_clamps_pieces_to_the_buffer():
    """A plan whose pieces run past the partial buffer merges only the rows inside it; a
    request whose first piece lies past the end gets 0 / -inf (never an out-of-bounds read)."""
    rank, cap, s_q, h = 16, 4, 1, 16
    po = torch.randn(cap, s_q * h, rank)
    plse = torch.randn(cap, s_q * h)
    nsplit = torch.tensor([3, 2], dtype=torch.int32)
    offsets = torch.tensor([2, 4], dtype=torch.int32)  # rows 2..4 (4 is past the end); 4..5
    out = torch.full((2, s_q, h, rank), SENTINEL)
    lse = torch.full((2, h, s_q), SENTINEL)
    out_d, lse_d = out.to(DEVICE), lse.to(DEVICE)
    ops.combine(po.to(DEVICE), plse.to(DEVICE), nsplit.to(DEVICE), offsets.to(DEVICE), out_d, lse_d, 16)
    out, lse = out_d.cpu(), lse_d.cpu()
    o_ref, lse_ref = merge_reference(po, plse, 2, 2)
    torch.testing.assert_close(out[0, 0].double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0, :, 0].double(), lse_ref, rtol=1e-5, atol=1e-5)
    assert (out[1] == 0).all() and (lse[1] == -math.inf).all()


@pytest.mark.parametrize("col_blocks", [0, 3, 64])
def test_combine_rejects_bad_column_blocks(col_blocks):
    """``col_blocks`` must cut the rank into power-of-two column blocks: a clear ValueError
    before any launch (rank 32: 3 does not divide it, 64 leaves no column)."""
    po, plse = torch.zeros(2, 4, 32), torch.zeros(2, 4)
    nsplit, offsets = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    out, lse = torch.zeros(1, 1, 4, 32), torch.zeros(1, 4, 1)
    with pytest.raises(ValueError, match="col_blocks"):
        ops.combine(po, plse, nsplit, offsets, out, lse, 16, col_blocks)


def test_combine_narrows_its_column_blocks_where_the_grid_would_leave_sms_idle(monkeypatch):
    """``combine_columns``: on a GPU, a grid of fewer programs than SMs (request x row-block
    pairs x the config's column blocks) takes 32-column blocks (rank 512: 16), a grid that
    fills the SMs keeps the config's; the interpreter and CPU tensors always keep it, and so
    does a rank that has no more 32-column blocks than asked for."""
    import types
    import mla_fuzz.kernels.combine as kc
    monkeypatch.setattr(kc, "sm_count", lambda device: 132)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert kc.combine_columns(8, 4, 512, gpu) == 16  # h=16 x 1, B=8: 32 programs
    assert kc.combine_columns(32, 4, 512, gpu) == 16  # 128 programs < 132
    assert kc.combine_columns(33, 4, 512, gpu) == 4  # 132 programs
    assert kc.combine_columns(1024, 4, 512, gpu) == 4
    assert kc.combine_columns(1, 4, 64, gpu) == 4  # 64 / 32 = 2 blocks: not more than 4
    assert kc.combine_columns(1, 1, 64, gpu) == 2
    assert kc.combine_columns(1, 4, 96, gpu) == 4  # 96 / 32 = 3 blocks: not more than 4
    assert kc.combine_columns(8, 4, 512, types.SimpleNamespace(device=torch.device("cpu"))) == 4
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kc.combine_columns(8, 4, 512, gpu) == 4

"""The device planner: every KV tile of every request covered exactly once, pieces and
partial-buffer rows consistent, parts balanced."""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mla_fuzz.kernels import DecodeConfig, ops, plan_reference
from mla_fuzz.kernels import planner as planner_mod


def run_planner(seq_lens, num_parts, block_n, min_tiles, device="cpu"):
    B = len(seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    # sentinel-filled outputs: any entry the planner forgets stays visibly wrong
    info = torch.full((num_parts + 1, 3), -7, dtype=torch.int32, device=device)
    nsplit = torch.full((B,), -7, dtype=torch.int32, device=device)
    offsets = torch.full((B,), -7, dtype=torch.int32, device=device)
    ops.plan(seq, info, nsplit, offsets, block_n, min_tiles)
    return info.cpu().tolist(), nsplit.cpu().tolist(), offsets.cpu().tolist()


def walk_parts(info, seq_lens, block_n):
    """Replay the decode kernel's walk: ``{(request, tile): [(part, piece)]}``."""
    B = len(seq_lens)
    tiles = [-(-L // block_n) for L in seq_lens]
    covered = {}
    for p in range(len(info) - 1):
        b0, t0, j0 = info[p]
        b1, t1 = info[p + 1][:2]
        last = b1 if t1 > 0 else b1 - 1
        for b in range(b0, last + 1):
            assert 0 <= b < B, f"part {p} walks into request {b} of {B}"
            lo = t0 if b == b0 else 0
            hi = t1 if b == b1 else tiles[b]
            piece = j0 if b == b0 else 0
            for t in range(lo, hi):
                covered.setdefault((b, t), []).append((p, piece))
    return covered


def check_plan(seq_lens, num_parts, block_n, min_tiles, info, nsplit, offsets):
    B = len(seq_lens)
    tiles = [-(-L // block_n) for L in seq_lens]
    total = sum(tiles)
    covered = walk_parts(info, seq_lens, block_n)
    # every tile exactly once, nothing else
    want = {(b, t) for b in range(B) for t in range(tiles[b])}
    assert set(covered) == want, f"covered {sorted(set(covered) ^ want)[:5]} wrongly"
    dup = {k: v for k, v in covered.items() if len(v) != 1}
    assert not dup, f"tiles covered more than once: {list(dup.items())[:3]}"
    # pieces: request b is cut into num_splits[b] contiguous pieces 0..n-1, one part each
    for b in range(B):
        pieces = [covered[(b, t)][0] for t in range(tiles[b])]
        if tiles[b] == 0:
            assert nsplit[b] == 0
            continue
        idx = [pc for _, pc in pieces]
        assert idx == sorted(idx) and idx[0] == 0, f"request {b}: piece order {idx}"
        assert sorted(set(idx)) == list(range(nsplit[b])), f"request {b}: pieces {set(idx)} vs num_splits {nsplit[b]}"
        parts_of = {}
        for p, pc in pieces:
            parts_of.setdefault(pc, set()).add(p)
        assert all(len(v) == 1 for v in parts_of.values()), f"request {b}: a piece spans parts {parts_of}"
    # partial rows of split requests: disjoint, inside the buffer the config sizes
    cap = DecodeConfig(num_parts=num_parts).partial_capacity()
    rows = [(offsets[b], offsets[b] + nsplit[b]) for b in range(B) if nsplit[b] > 1]
    used = set()
    for lo, hi in rows:
        assert 0 <= lo and hi <= cap, f"partial rows [{lo}, {hi}) outside capacity {cap}"
        span = set(range(lo, hi))
        assert not (span & used), "partial rows overlap"
        used |= span
    # balance: live parts differ by at most one tile and hold >= min_tiles when possible --
    # or >= 2 where the short-batch rule (min_tiles > 2, planner module doc) took more parts
    sizes = {}
    for (b, t), [(p, _)] in covered.items():
        sizes[p] = sizes.get(p, 0) + 1
    if total:
        live = list(sizes.values())
        assert max(live) - min(live) <= 1, f"unbalanced parts {sizes}"
        assert len(live) <= num_parts
        # P0 = min(num_parts, total // min_tiles), or with the short-batch rule at least
        # min(total // 2, num_parts // 2) (planner module doc)
        p0 = total // min_tiles
        busy = sum(t > 0 for t in tiles)
        if (min_tiles > 2 and total <= planner_mod.SHORT_TILES * busy
                and min(total // 2, num_parts // 2) > p0):
            p0, least = min(total // 2, num_parts // 2), 2
        else:
            least = min_tiles
        if total >= least:
            assert min(live) >= least, f"a part got fewer than {least} tiles: {sizes}"
        # the longest part is that of an equal split over P0 parts, and no more parts are used
        # than that length needs
        p0 = max(1, min(num_parts, p0))
        longest = -(-total // p0)
        assert max(live) == longest, f"longest part {max(live)} tiles, an equal split over {p0} has {longest}"
        assert len(live) == -(-total // longest), f"{len(live)} parts where {-(-total // longest)} of <= {longest} do"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq_lens=st.lists(st.one_of(st.sampled_from([0, 1, 15, 16, 17, 32]), st.integers(0, 400)),
                         min_size=1, max_size=40),
       num_parts=st.integers(1, 20), block_n=st.sampled_from([16, 32, 64]), min_tiles=st.integers(1, 4))
def test_planner_covers_every_tile_once(seq_lens, num_parts, block_n, min_tiles):
    info, nsplit, offsets = run_planner(seq_lens, num_parts, block_n, min_tiles)
    check_plan(seq_lens, num_parts, block_n, min_tiles, info, nsplit, offsets)
    ref = plan_reference(seq_lens, num_parts=num_parts, block_n=block_n, min_tiles_per_part=min_tiles)
    assert (info, nsplit, offsets) == ([list(r) for r in ref[0]], ref[1], ref[2])


def test_short_batch_rule_cuts_parts_of_two_tiles():
    """h=16 at B=8, L=1k (128 tiles of 64 keys, 132 parts, parts of at least four tiles): 32 parts of
    four leave 100 SMs idle; the short-batch rule cuts 64 parts of two instead. Requests of more
    than SHORT_TILES tiles keep parts of four: B=2, L=4k (also 128 tiles, 64 a request), and B=1,
    L=16k. Empty requests (padding) do not count as requests."""
    for seq_lens, want_parts, want_tiles in (([1024] * 8, 64, 2), ([4096, 4096], 32, 4), ([16384], 64, 4),
                                            ([1024], 8, 2), ([2048] + [0] * 7, 16, 2), ([4096] + [0] * 7, 16, 4)):
        info, nsplit, offsets = run_planner(seq_lens, 132, 64, 4)
        check_plan(seq_lens, 132, 64, 4, info, nsplit, offsets)
        assert_matches_reference(seq_lens, 132, 64, 4, (info, nsplit, offsets))
        sizes = {}
        for (b, t), [(p, _)] in walk_parts(info, seq_lens, 64).items():
            sizes[p] = sizes.get(p, 0) + 1
        assert len(sizes) == want_parts and set(sizes.values()) == {want_tiles}, (seq_lens, sizes)
    # parts of at most two tiles: the rule changes nothing (one compiled planner there)
    assert planner_mod.first_parts(128, 8, num_parts=132, min_tiles_per_part=2) == 64
    assert planner_mod.first_parts(16, 1, num_parts=132, min_tiles_per_part=1) == 16


def assert_matches_reference(seq_lens, num_parts, block_n, min_tiles, got):
    ref = plan_reference(seq_lens, num_parts=num_parts, block_n=block_n, min_tiles_per_part=min_tiles)
    assert got == ([list(r) for r in ref[0]], ref[1], ref[2])


@contextlib.contextmanager
def small_chunks(block_b, block_p):
    """Shrink the planner's chunk caps so small batches take the multi-chunk paths."""
    saved = planner_mod._MAX_BLOCK_B, planner_mod._MAX_BLOCK_P
    planner_mod._MAX_BLOCK_B, planner_mod._MAX_BLOCK_P = block_b, block_p
    try:
        yield
    finally:
        planner_mod._MAX_BLOCK_B, planner_mod._MAX_BLOCK_P = saved


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq_lens=st.lists(st.one_of(st.sampled_from([0, 1, 16, 17]), st.integers(0, 300)),
                         min_size=1, max_size=60),
       num_parts=st.integers(1, 12), block_n=st.sampled_from([16, 64]), min_tiles=st.integers(1, 3),
       caps=st.sampled_from([(16, 2), (16, 4), (32, 8)]))
# split requests in an earlier request chunk shift a later chunk's partial-buffer rows
@example(seq_lens=[0] * 15 + [17, 0], num_parts=2, block_n=16, min_tiles=1, caps=(16, 2))
@example(seq_lens=[40] * 37, num_parts=5, block_n=16, min_tiles=1, caps=(16, 2))
def test_planner_multi_chunk_matches_reference(seq_lens, num_parts, block_n, min_tiles, caps):
    """Batches longer than one request chunk (a multiple of it or not) and more part_info
    rows than one part chunk: the carries between chunks and the per-program totals."""
    with small_chunks(*caps):
        got = run_planner(seq_lens, num_parts, block_n, min_tiles)
    assert_matches_reference(seq_lens, num_parts, block_n, min_tiles, got)


@pytest.mark.parametrize("case", ["one", "one_empty", "all_empty", "one_chunk_1000", "three_chunks_2500",
                                  "int64_products", "total_near_int32_max"])
def test_planner_edges_match_reference(case):
    """B = 1, empty batches, one request chunk of 1000 and several (2500), and products
    total * P_eff past 2**31 (the kernel's exact fp64-reciprocal divisions)."""
    g = torch.Generator().manual_seed(5)
    num_parts, block_n, min_tiles = 132, 64, 2
    if case == "one":
        seq = [16000]
    elif case == "one_empty":
        seq = [0]
    elif case == "all_empty":
        seq = [0] * 37
    elif case == "one_chunk_1000":
        seq = torch.randint(0, 16384, (1000,), generator=g).tolist()
    elif case == "three_chunks_2500":
        seq = torch.randint(0, 3000, (2500,), generator=g).tolist()
        seq[::37] = [0] * len(seq[::37])
    elif case == "int64_products":  # 26M tiles * 132 parts
        seq = [1 << 24] * 100
        seq[3] = 5
    else:  # ~2**31 - 2**24 tiles, odd remainders
        seq = [1 << 30] * 126 + [12345, 7, (1 << 30) - 1]
    got = run_planner(seq, num_parts, block_n, min_tiles)
    if case not in ("int64_products", "total_near_int32_max"):  # too many tiles for check_plan's walk
        check_plan(seq, num_parts, block_n, min_tiles, *got)
    assert_matches_reference(seq, num_parts, block_n, min_tiles, got)


def test_planner_large_batch_chunks():
    """More requests than one planner chunk, with small parts counts."""
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(0, 3000, (700,), generator=g).tolist()
    seq[::37] = [0] * len(seq[::37])
    with small_chunks(256, 32):
        got = run_planner(seq, 40, 64, 2)
    check_plan(seq, 40, 64, 2, *got)
    assert_matches_reference(seq, 40, 64, 2, got)


def test_planner_rejects_bad_buffers():
    seq = torch.tensor([3, 4], dtype=torch.int32)
    info = torch.zeros(5, 3, dtype=torch.int32)
    ns = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_splits"):
        ops.plan(seq, info, ns[:1], ns.clone(), 16, 1)
    with pytest.raises(ValueError, match="part_info must be contiguous"):
        ops.plan(seq, torch.zeros(3, 5, dtype=torch.int32).t(), ns, ns.clone(), 16, 1)
    with pytest.raises(ValueError, match="cache_seqlens"):
        ops.plan(seq.long(), info, ns, ns.clone(), 16, 1)


@pytest.mark.gpu
def test_planner_covers_every_tile_once_gpu():
    g = torch.Generator().manual_seed(11)
    for trial in range(24):
        # B up to 2500: one request chunk (1024) and several
        B = int(torch.randint(1, 300, (1,), generator=g)) if trial < 16 else [1000, 1024, 1025, 2500][trial % 4]
        seq = torch.randint(0, 20000, (B,), generator=g)
        seq[torch.rand(B, generator=g) < 0.2] = 0
        P = [1, 7, 132, 264][trial % 4]  # num_parts is a compile-time constant: few distinct values
        info, nsplit, offsets = run_planner(seq.tolist(), P, 64, 2, device="cuda")
        check_plan(seq.tolist(), P, 64, 2, info, nsplit, offsets)
        assert_matches_reference(seq.tolist(), P, 64, 2, (info, nsplit, offsets))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq_lens=st.lists(st.one_of(st.sampled_from([0, 1, 31, 32, 33]), st.integers(0, 512)),
                         min_size=1, max_size=16),
       num_parts=st.integers(1, 7), block_n=st.sampled_from([16, 32]), min_tiles=st.integers(1, 3))
@example(seq_lens=[0, 0, 0], num_parts=5, block_n=32, min_tiles=1)
@example(seq_lens=[300, 0, 5, 64], num_parts=5, block_n=32, min_tiles=1)
def test_planner_one_program_and_two_agree(seq_lens, num_parts, block_n, min_tiles):
    """Under the interpreter a one-chunk plan runs as one program doing both roles (``FUSED``);
    launched as on the GPU (the launcher told it is not interpreting), the two programs of the
    GPU layout run. Both give plan_reference's plan, for the batch shapes the CPU fuzzer draws."""
    got = {}
    real = planner_mod.interpreting
    try:
        for fuse in (True, False):
            planner_mod.interpreting = (lambda: True) if fuse else (lambda: False)
            got[fuse] = run_planner(seq_lens, num_parts, block_n, min_tiles)
            assert_matches_reference(seq_lens, num_parts, block_n, min_tiles, got[fuse])
    finally:
        planner_mod.interpreting = real
    assert got[True] == got[False]


def test_planner_fuses_only_one_chunk_interpreted(monkeypatch):
    """The launch is one program exactly when interpreting and both roles fit one chunk."""
    grids = []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *a, **k: None

    monkeypatch.setattr(planner_mod, "_planner_kernel", Spy())
    seq = torch.tensor([40, 0, 7], dtype=torch.int32)
    info = torch.zeros((6, 3), dtype=torch.int32)
    ns = torch.zeros(3, dtype=torch.int32)
    for interp, want in ((True, (1,)), (False, (2,))):
        monkeypatch.setattr(planner_mod, "interpreting", lambda v=interp: v)
        planner_mod.launch_planner(seq, info, ns, ns.clone(), block_n=32, min_tiles_per_part=1)
        assert grids[-1] == want
    monkeypatch.setattr(planner_mod, "interpreting", lambda: True)
    with small_chunks(16, 2):  # 3 part programs: no fusion
        planner_mod.launch_planner(seq, info, ns, ns.clone(), block_n=32, min_tiles_per_part=1)
    assert grids[-1] == (3 + 1,)


@pytest.mark.parametrize("tiles_each,batch,num_parts", [(8, 32, 132), (4, 32, 66), (16, 128, 132), (3, 100, 132),
                                                        (6, 5, 10)])
def test_planner_cuts_uniform_batches_at_request_ends(tiles_each, batch, num_parts):
    """A batch of equal requests whose tile count is a multiple of the longest part is cut
    only between its pieces of equal length: no part straddles two requests (B=32 requests
    of 8 tiles over 132 parts: 128 parts of 2 tiles, 4 pieces a request)."""
    block_n = 64
    seq = [tiles_each * block_n] * batch
    info, nsplit, offsets = run_planner(seq, num_parts, block_n, 1)
    check_plan(seq, num_parts, block_n, 1, info, nsplit, offsets)
    total = tiles_each * batch
    longest = -(-total // min(num_parts, total))
    covered = walk_parts(info, seq, block_n)
    parts_of_request = {}
    for (b, _), [(p, _)] in covered.items():
        parts_of_request.setdefault(p, set()).add(b)
    assert tiles_each % longest == 0  # the premise of the case
    assert all(len(v) == 1 for v in parts_of_request.values()), \
        f"parts straddling requests: {[p for p, v in parts_of_request.items() if len(v) > 1][:5]}"
    assert nsplit == [tiles_each // longest] * batch

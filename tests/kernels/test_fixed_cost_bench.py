"""benchmarks/fixed_cost_bench.py and kernel_timeline.py: the plan arithmetic the fit uses,
the fit itself, and the instrumented kernel copies (built on CPU; run by the GPU test)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_fuzz.kernels.planner import plan_reference


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the loader holds no state
@given(batch=st.integers(1, 40), length=st.integers(0, 3000), block_n=st.sampled_from([32, 64, 128]),
       num_parts=st.integers(1, 140), min_tiles=st.integers(1, 4))
def test_tiles_per_part_is_the_planners_longest_part(load_benchmark, batch, length, block_n, num_parts, min_tiles):
    """``T`` (the x of the fit) is the longest part of the plan the planner makes, and
    ``P_eff`` the number of non-empty parts, as ``plan_reference`` lays them out."""
    fc = load_benchmark("fixed_cost_bench")
    t, p_eff = fc.tiles_per_part(batch, length, block_n, num_parts, min_tiles)
    info, _, _ = plan_reference([length] * batch, num_parts=num_parts, block_n=block_n,
                                min_tiles_per_part=min_tiles)
    tiles = -(-length // block_n)
    starts = [req * tiles + tile for req, tile, _ in info]  # global tile where each part starts
    sizes = [b - a for a, b in zip(starts, starts[1:])]
    assert max(sizes) == t
    assert sum(1 for s in sizes if s > 0) == p_eff


def test_fit_line_recovers_a_line_and_reports_the_worst_residual(load_benchmark):
    fc = load_benchmark("fixed_cost_bench")
    f = fc.fit_line([4, 8, 16, 32], [11.5 + 3.25 * x for x in (4, 8, 16, 32)])
    assert f["a"] == pytest.approx(11.5) and f["b"] == pytest.approx(3.25) and f["max_residual"] < 1e-9
    f = fc.fit_line([0, 1, 2], [0.0, 2.0, 1.0])  # least squares: y = 0.5 + 0.5 x, worst miss 1.0 at x = 1
    assert (f["a"], f["b"], f["max_residual"]) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(1.0))
    with pytest.raises(ValueError, match="two or more distinct"):
        fc.fit_line([4, 4], [1.0, 2.0])


def test_bad_cases_are_usage_errors(load_benchmark):
    fc = load_benchmark("fixed_cost_bench")
    assert fc._parse_cases("fp8,128,2;bf16,16,1", 3) == [("fp8", 128, 2), ("bf16", 16, 1)]
    for bad in ("fp4,16,1", "bf16,16", "bf16,16,x"):
        with pytest.raises(SystemExit, match="bad case"):
            fc._parse_cases(bad, 3)


@pytest.mark.parametrize("kernel", ["pp", "ws64", "rs", "kt"])
def test_timeline_copies_build_with_every_event(load_benchmark, kernel):
    """Every anchor is found in the shipping kernel's source and every event gets a timer
    store; the copy imports (Gluon parses it) and its kernel takes the extra pointer right
    after the partial lse, as the copied launcher passes it."""
    kt = load_benchmark("kernel_timeline")
    src = kt.instrument_source(kernel)
    for e in kt.EVENTS[kernel]:
        # the cadence slots are one run-time store, slot 16 + the tile's index
        assert f"_ts(ts_ptr, {e})" in src or (e >= 16 and "_ts(ts_ptr, 16 + " in src)
    mod = kt.instrument(kernel)
    fn = getattr(mod, f"_decode_{kernel}_kernel")
    names = fn.arg_names
    assert names[names.index("plse_ptr") + 1] == "ts_ptr"
    assert kt.STORED[kernel] in kt.EVENTS[kernel]


def test_timeline_kernel_is_the_default_route(load_benchmark):
    """The kernel a timeline case is said to run is the one the CUDA defaults give it on Hopper (the
    route table, kernels/routes.py), and cases no instrumented kernel runs are refused."""
    kt = load_benchmark("kernel_timeline")
    assert kt.kernel_for("bf16", 128, 1) == "pp" and kt.kernel_for("bf16", 16, 4) == "pp"
    assert kt.kernel_for("fp8", 128, 2) == "ws64" and kt.kernel_for("fp8", 16, 1) == "rs"
    assert kt.kernel_for("fp8", 16, 2) is None  # 32 rows: ws64's keys consumer (B > 4) or two rs blocks
    assert kt.kernel_for("bf16", 16, 1) == "kt" and kt.kernel_for("bf16", 16, 2) == "kt"
    fc = load_benchmark("fixed_cost_bench")
    if torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no instrumented kernel runs it"):
            fc.main(["--timeline", "fp8,16,2,8,512", "--routes", "", "--no-stores", "--bounds", ""])


def test_timeline_refuses_a_moved_anchor(load_benchmark, monkeypatch):
    kt = load_benchmark("kernel_timeline")
    monkeypatch.setitem(kt._EDITS, "pp", [("sub", "no such line in the kernel", "x", 1)])
    with pytest.raises(ValueError, match="anchor found 0 times"):
        kt.instrument_source("pp")


def test_summarize_spreads_times_after_the_first_entry(load_benchmark):
    kt = load_benchmark("kernel_timeline")
    ts = torch.zeros(4, 16, dtype=torch.int64)
    ts[:3, 0] = torch.tensor([10_000, 10_500, 11_000])  # program 3 never entered
    ts[:3, 6] = torch.tensor([20_000, 30_000, 40_000])
    ts[1, 3] = 15_000
    s = kt.summarize(ts, {3: "a", 6: "b", 9: "never"})
    assert s["programs"] == 3
    assert s["3: a"] == [5.0, 5.0, 5.0]
    assert s["6: b"] == [10.0, 20.0, 30.0]
    assert "9: never" not in s
    with pytest.raises(ValueError, match="no program recorded its entry"):
        kt.summarize(torch.zeros(2, 16, dtype=torch.int64), {0: "entry"})


@pytest.mark.gpu
def test_timeline_events_are_ordered_gpu(load_benchmark):
    """On the GPU, the instrumented kernels run the shipping launch and record, per program,
    entry <= plan visible <= first tile <= loop end <= stored, the loop's tiles in order; and the
    results equal the shipping kernel's (the copies only add timer stores)."""
    kt = load_benchmark("kernel_timeline")
    fc = load_benchmark("fixed_cost_bench")
    kb = load_benchmark("kernel_bench")
    from mla_fuzz.mla_ref import ModelSpec
    pool = kb.CachePool(ModelSpec(), 8 * 512 + 4096)
    gen = torch.Generator().manual_seed(0)
    for kv, h, kernel in (("bf16", 128, "pp"), ("fp8", 128, "ws64"), ("fp8", 16, "rs"), ("bf16", 16, "kt")):
        torch.manual_seed(1)
        c = fc._Case(pool, kv, h, 1, 8, 512, gen)
        c.forward()
        want = c.out.clone()
        ts = torch.zeros(c.programs, kt.SLOTS, dtype=torch.int64, device="cuda")
        restore = kt.install(ts)
        try:
            c.out.zero_()
            c.forward()
            torch.cuda.synchronize()
        finally:
            restore()
        assert torch.equal(c.out, want)
        t = ts.cpu()
        live = t[:, kt.STORED[kernel]] > 0
        assert int(live.sum()) >= 8  # 8 requests (x 2 row blocks at h=128), at least one program each
        # entry, plan, first tile, loop end / scores exchanged, stored
        chain = {"rs": [0, 1, 3, 5, 6, 8], "kt": [0, 1, 3, 4, 8, 5, 6]}.get(kernel, [0, 1, 3, 5, 6])
        for a, b in zip(chain, chain[1:]):
            assert bool((t[live, a] <= t[live, b]).all()), (kernel, a, b)
        # the cadence: each recorded tile after the one before, the first at the first tile's slot
        cad = t[live, 16:]
        assert bool(((cad[:, 0] - t[live, 3]).abs() <= 1000).all()), kernel  # same point, within 1 us
        for k in range(1, cad.shape[1]):
            seen = cad[:, k] > 0
            assert bool((cad[seen, k - 1] > 0).all() and (cad[seen, k - 1] <= cad[seen, k]).all()), (kernel, k)


def test_without_merge_drops_exactly_the_merge_and_restores(load_benchmark, monkeypatch):
    """The bounds' patch: the decode gets every argument unchanged but partial buffers of no
    rows (so it stores no partial), the combine is not launched, and both launchers are back
    afterwards -- also when the block raises."""
    fc = load_benchmark("fixed_cost_bench")
    import mla_fuzz.kernels.ops as ops
    seen = []
    monkeypatch.setattr(ops, "launch_decode", lambda *a, **k: seen.append(("decode", a, k)))
    monkeypatch.setattr(ops, "launch_combine", lambda *a, **k: seen.append(("combine", a, k)))
    dec, comb = ops.launch_decode, ops.launch_combine
    args = [torch.full((1,), float(i)) for i in range(11)] + [torch.zeros(5, 2, 3), torch.zeros(5, 2)]
    with fc.without_merge(combine=True, partials=True):
        ops.launch_decode(*args, softmax_scale=0.5, block_m=16)
        ops.launch_combine("p", "l")
    assert [s[0] for s in seen] == ["decode"]
    _, a, k = seen[0]
    assert all(x is y for x, y in zip(a[:11], args[:11])) and len(a) == 13
    assert a[11].shape == (0, 2, 3) and a[12].shape == (0, 2)
    assert k == {"softmax_scale": 0.5, "block_m": 16}
    assert ops.launch_decode is dec and ops.launch_combine is comb
    seen.clear()
    with fc.without_merge(combine=True, partials=False):
        ops.launch_decode(*args)
        ops.launch_combine("p", "l")
    assert [s[0] for s in seen] == ["decode"] and seen[0][1][11] is args[11]
    with pytest.raises(RuntimeError, match="inside"):
        with fc.without_merge(combine=True, partials=True):
            raise RuntimeError("inside")
    assert ops.launch_decode is dec and ops.launch_combine is comb


@pytest.mark.gpu
@pytest.mark.parametrize("kv,h,s_q", [("fp8", 16, 1), ("fp8", 16, 2), ("bf16", 16, 1), ("fp8", 128, 1),
                                      ("bf16", 128, 1)])
def test_without_merge_leaves_split_rows_unwritten_and_the_rest_as_shipped_gpu(load_benchmark, kv, h, s_q):
    """On the GPU, for each route's kernel: with neither partials nor combine, a batch whose every
    request is split (B=2, L=2048) keeps the NaN its output was filled with, where the shipped
    launch writes it; a batch that the plan does not split (B=128, L=128: parts of whole
    requests) gets the shipped launch's output bit for bit. So the bounds remove the merge of
    split requests and nothing else."""
    fc = load_benchmark("fixed_cost_bench")
    kb = load_benchmark("kernel_bench")
    from mla_fuzz.mla_ref import ModelSpec
    pool = kb.CachePool(ModelSpec(), 128 * 128 + 4096)
    gen = torch.Generator().manual_seed(0)
    for batch, length, split in ((2, 2048, True), (128, 128, False)):
        torch.manual_seed(2)
        c = fc._Case(pool, kv, h, s_q, batch, length, gen)
        c.out.fill_(float("nan"))
        c.forward()
        shipped = c.out.clone()
        nsplit = c.md.num_splits[:batch].cpu()
        assert bool((nsplit > 1).all()) if split else bool((nsplit == 1).all()), nsplit
        assert not shipped.isnan().any()
        for partials in (False, True):
            c.out.fill_(float("nan"))
            with fc.without_merge(combine=True, partials=partials):
                c.forward()
            torch.cuda.synchronize()
            if split:
                assert bool(c.out.isnan().all()), (kv, h, s_q, partials)
            else:
                assert torch.equal(c.out, shipped), (kv, h, s_q, partials)

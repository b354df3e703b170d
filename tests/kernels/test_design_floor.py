"""benchmarks/design_floor.py: the targets' time limits (agreeing with the table's misses), the
design floor's arithmetic, the command line's bad input; on the GPU, the floor graphs themselves."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _record(h, B, L, io_bytes, roofline_us, copy_tbps, time_us):
    # a case record as kernel_bench.case_record fills it (bw_ratio, x_roofline from the time)
    return {"h": h, "B": B, "L": L, "time_us": time_us, "roofline_us": roofline_us,
            "bw_ratio": io_bytes / (time_us * 1e-6) / 1e12 / copy_tbps, "x_roofline": time_us / roofline_us}


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the loader holds no state
@given(h=st.sampled_from([16, 128]), B=st.sampled_from([1, 8, 31, 32, 128]), L=st.sampled_from([1024, 4096, 16384]),
       io_mb=st.floats(1, 3000), roof_frac=st.floats(0.05, 1.0), copy=st.floats(1.0, 5.0))
def test_each_limit_is_where_the_tables_miss_flips(load_benchmark, h, B, L, io_mb, roof_frac, copy):
    """A case exactly at one limit of ``target_limits_us`` and inside the others is not a miss;
    1% slower than the tightest limit it is one; with no limit it never is."""
    kt = load_benchmark("kernel_table")
    io = io_mb * 1e6
    roof = io / (copy * 1e12) * 1e6 / roof_frac  # the roofline is at least the bytes' time
    lim = kt.target_limits_us(h, B, L, io, roof, copy)
    assert ("copy_share" in lim) == (h == 16 and B * L >= 128 * 1024)
    assert ("x_roofline" in lim) == (B >= 32)
    if not lim:
        assert not kt.misses_target(_record(h, B, L, io, roof, copy, 50 * roof))
        return
    tight = min(lim.values())
    assert not kt.misses_target(_record(h, B, L, io, roof, copy, tight * (1 - 1e-9)))
    assert kt.misses_target(_record(h, B, L, io, roof, copy, tight * 1.01))


def test_limits_in_numbers(load_benchmark):
    kt = load_benchmark("kernel_table")
    # 151 MB at 75% of 3 TB/s: 67.1 us; twice a 56 us roofline: 112 us
    lim = kt.target_limits_us(16, 32, 4096, 151e6, 56.0, 3.0)
    assert lim == {"copy_share": pytest.approx(151e6 / 2.25e12 * 1e6), "x_roofline": pytest.approx(112.0)}
    assert kt.target_limits_us(128, 8, 16384, 151e6, 56.0, 3.0) == {}


def test_design_floor_takes_the_slower_of_read_and_dots(load_benchmark):
    """The read kernel's duration in the floor graph is replaced by the dots' time at the matmul
    rate where that is longer; each target is reachable when the design floor is within it."""
    df = load_benchmark("design_floor")
    times = {"shipped": 60.0, "floor": 40.0, "floor_no_combine": 35.0, "read_alone": 33.0}
    # h=128, B=32: 1e9 flops at 100 TFLOP/s = 10 us, under a 30 us read: the floor stands
    r = df.floor_record(("fp8", 128, 1, 32, 1024), times, {"read": 30.0, "planner": 2.0, "combine": 3.0},
                        io_bytes=30e6, flops=1e9, copy_tbps=3.0, mm_tflops=100.0)
    assert r["design_floor_us"] == pytest.approx(40.0)
    assert r["roofline_us"] == pytest.approx(10.0)  # 30 MB at 3 TB/s = 10 us, the dots 10 us too
    assert r["target_limits_us"] == {"x_roofline": pytest.approx(20.0)}
    assert r["reachable"] == {"x_roofline": False}
    assert r["shipped_x_design_floor"] == pytest.approx(1.5)
    # 5e9 flops = 50 us: 20 us more than the read
    r = df.floor_record(("fp8", 128, 1, 32, 1024), times, {"read": 30.0}, io_bytes=30e6, flops=5e9,
                        copy_tbps=3.0, mm_tflops=100.0)
    assert r["design_floor_us"] == pytest.approx(60.0)
    assert r["target_limits_us"] == {"x_roofline": pytest.approx(100.0)}  # roofline 50 us now
    assert r["reachable"] == {"x_roofline": True}
    # the three-kernel graph's floor, from its own read: 25 us with a 20 us read under 50 us of dots
    r = df.floor_record(("fp8", 128, 1, 32, 1024), dict(times, three_kernels=25.0), {"read": 30.0}, io_bytes=30e6,
                        flops=5e9, copy_tbps=3.0, mm_tflops=100.0, three_read_us=20.0)
    assert r["design_floor_any_kernels_us"] == pytest.approx(55.0)
    assert r["reachable_any_kernels"] == {"x_roofline": True}
    r = df.floor_record(("fp8", 16, 1, 32, 1024), dict(times, three_kernels=25.0), {"read": 30.0}, io_bytes=30e6,
                        flops=1e8, copy_tbps=3.0, mm_tflops=100.0, three_read_us=20.0)
    assert r["design_floor_any_kernels_us"] == pytest.approx(25.0)  # the dots (1 us) hide under the read
    assert r["reachable_any_kernels"] == {"x_roofline": False}  # limit: twice a 10 us roofline


def test_pieces_used_is_one_past_the_last_split_piece(load_benchmark):
    import torch
    df = load_benchmark("design_floor")
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    assert df.pieces_used(t([1, 3, 1, 2]), t([0, 0, 3, 3])) == 5
    assert df.pieces_used(t([2, 1, 4]), t([4, 6, 0])) == 6  # offsets need not follow request order
    assert df.pieces_used(t([1, 1]), t([0, 0])) == 0  # nothing split: no partial rows


def _grid(tmp_path, rows):
    p = tmp_path / "grid.json"
    base = {"kv": "fp8", "s_q": 1, "time_us": 1.0, "flop_ratio": 0.1}
    p.write_text(json.dumps({"results": [dict(base, **r) for r in rows]}))
    return str(p)


def test_misses_are_read_from_a_grid(load_benchmark, tmp_path):
    df = load_benchmark("design_floor")
    path = _grid(tmp_path, [
        {"h": 16, "B": 8, "L": 16384, "bw_ratio": 0.7499, "x_roofline": 1.3},   # under 75%: a miss
        {"h": 16, "B": 8, "L": 16384, "bw_ratio": 0.75, "x_roofline": 1.3, "s_q": 2},  # on the line: met
        {"h": 128, "B": 32, "L": 1024, "bw_ratio": 0.2, "x_roofline": 2.01},   # over 2x: a miss
        {"h": 128, "B": 8, "L": 1024, "bw_ratio": 0.1, "x_roofline": 9.0},     # no target applies
    ])
    assert df.misses_of(path) == [("fp8", 16, 1, 8, 16384), ("fp8", 128, 1, 32, 1024)]


@pytest.mark.parametrize("argv,message", [
    (["--cases", "fp8,16,2,8,100"], "positive multiple of 64"),
    (["--cases", "fp4,16,2,8,1024"], "bad case"),
    (["--cases", ";"], "no cases given"),
    (["--misses", "/nonexistent/grid.json"], "cannot read"),
    (["--cases", "fp8,16,2,8,1024", "--reps", "0"], "--reps"),
])
def test_bad_input_is_one_line_and_status_2(load_benchmark, capsys, argv, message):
    df = load_benchmark("design_floor")
    assert df.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_grid_without_misses_is_refused(load_benchmark, capsys, tmp_path):
    df = load_benchmark("design_floor")
    path = _grid(tmp_path, [{"h": 16, "B": 8, "L": 16384, "bw_ratio": 0.9, "x_roofline": 1.1}])
    assert df.main(["--misses", path]) == 2
    assert "no case misses a target" in capsys.readouterr().err


def _run(**extra):
    # a design_floor run of three cases: a target met by the shipped replay (no row), one missed
    # but within both floors, one out of reach of the shipped kernels' floor only
    def case(c, shipped, ours, any_k, limits):
        return {"case": c, "shipped_us": shipped, "design_floor_us": ours, "design_floor_any_kernels_us": any_k,
                "target_limits_us": limits}
    return {"gpu": "G", "copy_TBps": 3.0, "matmul_bf16_TFLOPs": 700.0, "cases": [
        case(["fp8", 16, 1, 128, 16384], 500.0, 450.0, 440.0, {"copy_share": 600.0}),
        case(["bf16", 16, 1, 32, 4096], 70.0, 60.0, 55.0, {"copy_share": 67.0, "x_roofline": 100.0}),
        case(["fp8", 16, 1, 32, 1024], 25.0, 18.0, 14.0, {"x_roofline": 15.0}),
    ], **extra}


def test_table_rows_are_the_missed_targets_and_bold_the_floors_over_them(load_benchmark):
    df = load_benchmark("design_floor")
    text = df.table(_run())
    rows = [line for line in text.splitlines() if line.startswith("| fp8") or line.startswith("| bf16")]
    assert len(rows) == 2  # fp8 B=128 met its target; bf16 B=32 met 2x, missed 75%
    assert rows[0] == "| bf16 | 16 | 1 | 32 | 4096 | 75% of the copy rate: 67.0 µs | 70.0 µs | 60.0 µs | 55.0 µs |"
    assert rows[1] == "| fp8 | 16 | 1 | 32 | 1024 | 2x the roofline: 15.0 µs | 25.0 µs | **18.0 µs** | 14.0 µs |"
    assert "of the 2 targets this run's shipped replays miss, 1 are out of reach" in text
    assert ", 0 with any planner" in text
    # with a parts sweep, the best plan's floor is the one shown
    run = _run()
    run["cases"][2].update(design_floor_any_plan_us=14.8, by_parts=[])
    text = df.table(run)
    assert "| 14.8 µs | 14.0 µs |" in text and "best plan tried" in text and "0 are out of reach" in text


def test_load_run_refuses_what_is_not_a_run(load_benchmark, tmp_path):
    df = load_benchmark("design_floor")
    kt = load_benchmark("kernel_table")
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"cases": [{"case": [1]}]}))
    with pytest.raises(Exception, match="is not a design_floor run") as e:
        df.load_run(str(bad))
    assert type(e.value).__name__ == kt.TableError.__name__
    good = tmp_path / "y.json"
    good.write_text(json.dumps(_run()))
    assert df.load_run(str(good))["gpu"] == "G"


@pytest.mark.gpu
@pytest.mark.parametrize("kv,h,s_q,B,L", [("fp8", 16, 2, 8, 4096), ("bf16", 128, 1, 32, 1024)])
def test_floor_graphs_gpu(load_benchmark, kv, h, s_q, B, L):
    """The floor graph runs the planner, the read and the combine, and nothing of the decode;
    a plain read in the decode's place is not slower than the decode; the floor adds the planner
    and the combine to the read alone; dropping the combine does not make it slower."""
    import torch
    df = load_benchmark("design_floor")
    kb = load_benchmark("kernel_bench")
    from replay_timing import L2Flush, ReadReference

    from mla_fuzz.mla_ref import ModelSpec
    flush = L2Flush()
    pool = kb.CachePool(ModelSpec(), B * L + 4096)
    reader = ReadReference(B * L * kb.BYTES_PER_TOKEN[kv] + 64, flush)
    rec = df.run_case((kv, h, s_q, B, L), pool, reader, flush, torch.Generator().manual_seed(0), 20, (3.0, 700.0),
                      parts=(16,), sweep_all=True)
    assert set(rec["floor_kernels_us"]) == {"planner", "read", "combine"}
    assert rec["floor_us"] <= rec["shipped_us"] * 1.02
    assert rec["read_alone_us"] < rec["floor_us"]
    assert rec["floor_no_combine_us"] <= rec["floor_us"] * 1.02
    assert rec["design_floor_us"] >= rec["floor_us"]
    # empty kernels in the planner's and the combine's places: no slower than theirs
    assert rec["read_alone_us"] <= rec["three_kernels_us"] * 1.02
    assert rec["three_kernels_us"] <= rec["floor_us"] * 1.02
    assert rec["design_floor_any_kernels_us"] <= rec["design_floor_us"] * 1.02
    # 16 parts: the read on the decode's programs only (fewer than the SMs), slower than on all
    (p16,) = rec["by_parts"]
    assert p16["num_parts"] == 16 and p16["programs"] < torch.cuda.get_device_properties(0).multi_processor_count
    assert p16["read_kernel_us"] > rec["floor_kernels_us"]["read"]
    assert rec["design_floor_any_plan_us"] == min(rec["design_floor_us"], p16["design_floor_us"])

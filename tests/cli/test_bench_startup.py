"""``benchmarks/startup.py``: where a command's first seconds go, measured in fresh processes."""
from __future__ import annotations

import json


def test_startup_benchmark_times_imports_pool_and_scenarios(tmp_path, load_benchmark, capsys):
    bench = load_benchmark("startup")
    out_json = tmp_path / "s.json"
    assert bench.main(["--graph", "emulated", "--workers", "1", "--scenarios", "2", "--out", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    assert doc["format"] == "mla-fuzz-startup-bench/1" and doc["settings"]["graph"] == "emulated"
    imp = doc["imports"]
    # cumulative, from the process start: each import after the one before it
    assert 0 < imp["torch_s"] <= imp["harness_s"] <= imp["triton_s"] and imp["cuda_s"] is None
    [pool] = doc["pool"]
    assert pool["workers"] == 1 and 0 < pool["first_ready_s"] == pool["all_ready_s"]
    sc = doc["scenarios"]
    assert len(sc["scenarios"]) == 2 and all(r["seconds"] > 0 and r["status"] == "ok" for r in sc["scenarios"])
    assert sc["total_s"] >= sc["imports_s"] + sum(r["seconds"] for r in sc["scenarios"]) - 0.01
    assert "pool of 1: first ready" in capsys.readouterr().out


def test_startup_benchmark_refuses_a_bad_pool_size(tmp_path, load_benchmark, capsys):
    bench = load_benchmark("startup")
    try:
        bench.main(["--workers", "two", "--out", str(tmp_path / "s.json")])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--workers two was accepted")
    err = capsys.readouterr().err
    assert "--workers: expected comma-separated whole numbers" in err and "Traceback" not in err

"""``mla-fuzz bench``: the throughput command end to end (small, CPU) and its summary maths."""
from __future__ import annotations

import json

import pytest

from mla_fuzz.harness import cli
from mla_fuzz.harness.throughput import TARGET_SCALING, summarize

def test_bench_runs_campaigns_and_writes_json(tmp_path, fakes, capsys):
    out_json = tmp_path / "bench.json"
    code = cli.main(["bench", "--backend", "cli_fakes:RefBackend", "--graph", "eager", "--workers", "1",
                     "--budget", "8s", "--warmup", "0", "--corpus", str(tmp_path / "corpus"),
                     "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    assert code == 0, out + err
    doc = json.loads(out_json.read_text())
    assert doc["format"] == "mla-fuzz-fuzz-bench/2" and doc["exit_code"] == 0
    (run,) = doc["runs"]
    assert run["mode"] == "eager" and run["workers"] == 1 and run["failures"] == []
    # the reference backend is cheap: several scenarios fit in the budget, each >= 1 step
    assert run["examples"] >= 1 and run["steps"] >= run["examples"]
    assert run["cases_per_s"] == pytest.approx(run["examples"] / run["elapsed_s"], rel=0.01)
    assert "cases/s" in out and "eager" in out


def test_bench_flags_a_failing_backend_and_keeps_its_repro(tmp_path, fakes, capsys):
    """A backend that fails (the reference op syncs inside an emulated capture) is not a
    throughput figure: exit 1 and the repro lands in the corpus."""
    corpus = tmp_path / "corpus"
    code = cli.main(["bench", "--backend", "cli_fakes:RefBackend", "--graph", "emulated", "--workers", "1",
                     "--budget", "20s", "--warmup", "0", "--corpus", str(corpus)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    assert code == 1, out + err
    assert list(corpus.glob("*.json")), "the failure's repro must be kept"


@pytest.mark.parametrize("argv, needle", [
    (["--spec", "huge"], "--spec"),
    (["--graph", "warp"], "--graph"),
    (["--per-gpu", "0"], "--per-gpu"),
    (["--workers", "x"], "--workers"),
    (["--budget", "soon"], "--budget"),
    (["--backend", "nope.nothing:Cls"], "--backend"),
])
def test_bench_usage_errors_exit_2(argv, needle, capsys):
    code = cli.main(["bench", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and needle in err and "Traceback" not in err


def _run(spec, mode, gpus, per_gpu, rate, workers=None):
    workers = workers or (gpus * per_gpu if gpus else 1)
    return {"spec": spec, "mode": mode, "gpus": gpus, "per_gpu": per_gpu, "workers": workers,
            "cases_per_s": rate, "cases_per_s_per_worker": rate / workers}


def test_summary_scaling_and_targets():
    runs = [_run("tiny", "cuda", 1, 1, 12.0), _run("tiny", "cuda", 1, 8, 60.0),
            _run("tiny", "cuda", 2, 8, 100.0), _run("tiny", "cuda", 2, 1, 23.0),
            {**_run("tiny", "cuda", 1, 8, 500.0), "warmup": True},  # warm-ups never count
            _run("tiny", "emulated", 0, None, 3.0, workers=2)]
    s = summarize(runs)
    assert s["tiny_cuda_one_gpu_best_cases_per_s"] == 60.0 and s["tiny_cuda_one_gpu_best_workers"] == 8
    assert s["tiny_cuda_one_gpu_met"] is True
    eff = {sc["per_gpu"]: sc for sc in s["gpu_scaling"]}
    assert eff[8]["efficiency"] == pytest.approx(100.0 / (2 * 60.0), abs=1e-3)
    assert eff[8]["met"] is (100.0 / 120.0 >= TARGET_SCALING)
    assert eff[1]["efficiency"] == pytest.approx(23.0 / 24.0, abs=1e-3) and eff[1]["met"] is True
    assert s["tiny_emulated_best_cases_per_s_per_core"] == 1.5 and s["tiny_emulated_met"] is False

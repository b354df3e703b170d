"""Every way a campaign can go wrong through the user's input ends as one clear line (exit
2) before any work, and a campaign's counts add up (issue: "every way a campaign can go
wrong ends as a finding or one clear line")."""
from __future__ import annotations

import json
import time

import pytest
import torch

from mla_fuzz.harness.repro import FORMAT
from mla_fuzz.mla_ref import ModelSpec
from cli_helpers import one_line as _one_line, record_display, run_cli as _run


def test_unwritable_corpus_is_refused_before_the_campaign(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    t0 = time.monotonic()
    code, _, err = _run(["run", "--corpus", str(blocker / "corpus"), "--budget", "30s"], capsys)
    assert code == 2 and "--corpus" in _one_line(err) and time.monotonic() - t0 < 20


@pytest.mark.parametrize("where", ["missing-folder/report.json", "."])
def test_unwritable_json_is_refused_before_the_campaign(where, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(["run", "--json", where, "--corpus", str(tmp_path / "c"), "--budget", "30s"], capsys)
    assert code == 2 and _one_line(err).startswith("mla-fuzz run: error: --json")


def _repro(tmp_path, **over) -> str:
    data = {"format": FORMAT, "backend": "triton", "graph_mode": "eager",
            "config": {"spec": ModelSpec.tiny(num_heads=1).to_dict(), "kv_dtype": "bf16", "q_dtype": "bf16",
                       "page_size": 16, "next_n": 1, "capture_sizes": [1], "max_pages_per_seq": 4},
            "steps": [{"op": "eager", "batch": {"seed": 0, "seq_lens": [3], "q_lens": [1], "max_decode_len": 1},
                       "pad_to": None, "poison": False}],
            "failure": {"oracle": "reference", "step": 0, "message": "x"}}
    for key, value in over.items():
        if key == "batch":
            data["steps"][0]["batch"].update(value)
        else:
            data[key] = value
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("batch, text", [
    ({"seq_lens": [-5]}, "batch.seq_lens must hold integers >= 0, got -5"),
    ({"seq_lens": [1], "q_lens": [2], "max_decode_len": 1}, "batch.q_lens[0] = 2 exceeds batch.seq_lens[0] = 1"),
])
def test_bad_repro_fields_are_named(batch, text, tmp_path, capsys):
    code, _, err = _run(["replay", _repro(tmp_path, batch=batch)], capsys)
    assert code == 2 and text in _one_line(err)


def test_unknown_spec_names_the_known_ones(tmp_path, capsys):
    cfg = {"spec": "huge", "kv_dtype": "bf16", "page_size": 16, "capture_sizes": [1]}
    code, _, err = _run(["replay", _repro(tmp_path, config=cfg)], capsys)
    assert code == 2 and "unknown spec 'huge'; known: tiny, deepseek-v3" in _one_line(err)


def test_empty_only_is_a_usage_error(capsys):
    code, _, err = _run(["mutants", "--only", ""], capsys)
    assert code == 2 and "--only" in _one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_replay_graph_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    code, _, err = _run(["replay", "--graph", "cuda", _repro(tmp_path)], capsys)
    assert code == 2 and "--graph cuda: no CUDA device" in _one_line(err)


def test_replay_of_a_hang_uses_the_recorded_timeout(tmp_path, fakes, capsys):
    """A hang repro replays under the case timeout it was recorded with (not the 300 s default)."""
    path = _repro(tmp_path, backend="cli_fakes:HangBackend",
                  batch={"seq_lens": [0, 3], "q_lens": [0, 1]},
                  failure={"oracle": "timeout", "step": 0, "message": "timed out"},
                  diagnosis={"cls": "hang", "explanation": "x", "oracle": "timeout"}, search={"case_timeout_s": 3})
    t0 = time.monotonic()
    code, out, _ = _run(["replay", path], capsys)
    assert code == 1 and "hang" in out and time.monotonic() - t0 < 120


def test_counts_add_up_when_chunks_crash(tmp_path, fakes, capsys):
    """A campaign whose chunks die still reports the coverage of what they ran, and coverage
    counts searched examples only (not shrink re-runs)."""
    report = tmp_path / "r.json"
    code, out, _ = _run(["run", "--backend", "cli_fakes:AbortLongBackend", "--graph", "eager", "--examples", "6",
                         "--seed", "0", "--chunk", "3", "--quiet", "--corpus", str(tmp_path / "c"),
                         "--json", str(report), "--no-reduce"], capsys)
    rep = json.loads(report.read_text())
    assert code == 1 and rep["coverage"], rep
    assert sum(rep["coverage"]["kv_dtype"].values()) == rep["examples"]
    assert sum(rep["coverage"]["op"].values()) == rep["steps"]


def test_counts_add_up_when_a_failure_is_shrunk(tmp_path, capsys, monkeypatch):
    # cases, steps and every coverage table count searched examples; Hypothesis' shrink
    # re-runs (and the diagnosis) are reported apart, live and at the end
    display = record_display(monkeypatch)
    report = tmp_path / "r.json"
    code, out, _ = _run(["run", "--mutant", "item-in-capture", "--graph", "emulated", "--examples", "4", "--seed", "0",
                         "--corpus", str(tmp_path / "c"), "--json", str(report)], capsys)
    rep = json.loads(report.read_text())
    assert code == 1
    assert rep["failures"][0]["shrunk"] and rep["shrink_runs"] > 0 and f"shrinking: {rep['shrink_runs']} re-run" in out
    assert rep["examples"] <= 4 + sum(rep["unsupported"].values())
    for table in ("kv_dtype", "next_n", "page_size", "heads", "spec", "path"):
        assert sum(rep["coverage"][table].values()) == rep["examples"], table
    assert sum(rep["coverage"]["op"].values()) == rep["steps"]
    assert display.counts and all(c <= rep["examples"] and s <= rep["steps"] for c, s in display.counts)


@pytest.mark.parametrize("cmd", [["run", "--budget", "30s"], ["mutants"], ["bench", "--budget", "5s"]])
@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_bad_max_seq_len_is_one_line(cmd, value, tmp_path, capsys):
    code, _, err = _run(cmd + ["--max-seq-len", value, *(["--corpus", str(tmp_path / "c")] if cmd[0] == "run" else [])],
                        capsys)
    assert code == 2 and f"--max-seq-len: expected a positive integer, got {value!r}" in _one_line(err)


def test_max_seq_len_reaches_the_search_and_the_report(tmp_path, capsys):
    report = tmp_path / "r.json"
    code, _, err = _run(["run", "--examples", "6", "--seed", "2", "--max-seq-len", "1500", "--quiet",
                         "--backend", "mla_fuzz.examples.reference_backend:ReferenceBackend",
                         "--corpus", str(tmp_path / "c"), "--json", str(report)], capsys)
    data = json.loads(report.read_text())
    assert code == 0, err
    assert data["max_seq_len"] == 1500
    assert 512 < int(next(iter(data["coverage"]["longest"]))) <= 1500

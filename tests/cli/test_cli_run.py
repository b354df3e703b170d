"""``mla-fuzz run`` and ``replay`` end to end, with worker processes: exit codes, repros
that replay, crash and hang isolation. Backends are the small ones in ``cli_fakes.py``
(put on PYTHONPATH for the workers); graph mode ``eager`` keeps them exact, ``emulated``
makes the reference backend's host reads during capture a real ``host-sync`` finding."""
from __future__ import annotations

import json
from pathlib import Path

from mla_fuzz.harness.repro import load_repro
from cli_helpers import run_cli as _run


def _campaign(tmp_path, capsys, backend, graph, *extra):
    corpus, report = tmp_path / "corpus", tmp_path / "report.json"
    code, out, err = _run(["run", "--backend", backend, "--graph", graph, "--corpus", str(corpus),
                           "--json", str(report), "--quiet", *extra], capsys)
    rep = json.loads(report.read_text())
    assert rep["exit_code"] == code
    files = sorted(corpus.glob("*.json")) if corpus.exists() else []
    return code, out, rep, files


def test_clean_backend_exits_0(tmp_path, fakes, capsys):
    code, out, rep, files = _campaign(tmp_path, capsys, "cli_fakes:RefBackend", "eager",
                                      "--examples", "3", "--seed", "3")
    assert code == 0, out
    assert rep["failures"] == [] and files == []
    assert rep["examples"] >= 3 and rep["steps"] >= 3
    # merged FuzzReport coverage reaches the report and the summary
    assert sum(rep["coverage"]["op"].values()) == rep["steps"]
    assert "no failures found" in out and "next_n" in out


def test_failure_is_written_and_replays(tmp_path, fakes, capsys):
    code, out, rep, files = _campaign(tmp_path, capsys, "cli_fakes:RefBackend", "emulated",
                                      "--examples", "4", "--seed", "1")
    assert code == 1
    assert len(files) == 1 and len(rep["failures"]) == 1
    f = rep["failures"][0]
    assert f["class"] == "host-sync" and Path(f["path"]) == files[0]
    data = load_repro(files[0])
    assert data["diagnosis"]["cls"] == "host-sync" and data["graph_mode"] == "emulated"

    code, out, _ = _run(["replay", str(files[0]), "--json", str(tmp_path / "rp.json")], capsys)
    assert code == 1
    assert "STILL FAILS" in out and "diagnosis: host-sync" in out
    assert "> " in out and "capture" in out          # the failing step is printed and marked
    assert json.loads((tmp_path / "rp.json").read_text())["outcomes"][0]["oracle"] == "host-sync"

    # without graphs there is no capture to break: the same steps pass
    code, out, _ = _run(["replay", "--graph", "eager", str(files[0])], capsys)
    assert code == 0 and "PASSES" in out, out


def test_abort_is_a_crash_with_a_reduced_repro(tmp_path, fakes, capsys):
    # the first scenario (the opening book's "grow") crashes at its third step, the first padded
    # batch with a real row of seq_len >= 20; the crash needs only its graph's capture and that
    # replay, so the repro is reduced to those two steps.
    code, out, rep, files = _campaign(tmp_path, capsys, "cli_fakes:AbortLongBackend", "eager",
                                      "--examples", "2", "--seed", "1")
    assert code == 1, out
    assert rep["restarts"] >= 1
    crash = [f for f in rep["failures"] if f["class"] == "crash"]
    assert len(crash) == 1 and crash[0]["oracle"] == "worker-died"
    assert crash[0]["reduced_from"] == 3 and crash[0]["steps"] == 2
    assert files == [Path(crash[0]["path"])]           # the unreduced repro was replaced, not kept
    data = load_repro(files[0])
    assert [s["op"] for s in data["steps"]] == ["capture", "replay"] and data["failure"]["step"] == 1
    last = data["steps"][1]
    assert max(last["batch"]["seq_lens"]) >= 20 and len(last["batch"]["seq_lens"]) < last["size"]
    assert "SIGABRT" in data["failure"]["message"] and "cli_fakes.py" in data["failure"]["message"]
    assert data["failure"]["message"].startswith("step 1 (replay)")

    # replay runs it in a worker process: the abort is reported, the command survives it
    code, out, _ = _run(["replay", str(files[0])], capsys)
    assert code == 1 and "worker-died" in out and "in a worker process" in out and "SIGABRT" in out


def test_hang_is_caught_by_case_timeout(tmp_path, fakes, capsys):
    code, out, rep, files = _campaign(tmp_path, capsys, "cli_fakes:HangBackend", "eager", "--examples", "1",
                                      "--seed", "4", "--case-timeout", "3", "--no-reduce")
    assert code == 1, out
    assert [f["class"] for f in rep["failures"]] == ["hang"]
    data = load_repro(files[0])
    assert data["failure"]["oracle"] == "timeout"
    # the stack dump taken before the kill says where it was stuck
    assert any("cli_fakes.py" in ln for ln in data["failure"]["evidence"]["log_tail"])

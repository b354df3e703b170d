"""``mla-fuzz run --shard I/N`` and ``mla-fuzz merge`` (issue 42, item 4): N shards run
disjoint chunks of one seeded campaign, each seeded as in the unsharded campaign, and
their reports merge into one report and one deduplicated corpus. Campaigns use the small
backends of ``cli_fakes.py`` on CPU (see test_cli_run.py)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mla_fuzz.harness.campaign import CampaignOptions, CampaignRun, chunk_seed, shard_chunks
from mla_fuzz.harness.repro import load_repro
from cli_helpers import one_line as _one_line, run_cli as _run


def _campaign(tmp_path, capsys, name, graph, *extra):
    corpus, report = tmp_path / f"corpus-{name}", tmp_path / f"report-{name}.json"
    code, out, err = _run(["run", "--backend", "cli_fakes:RefBackend", "--graph", graph, "--corpus", str(corpus),
                           "--json", str(report), "--quiet", *extra], capsys)
    rep = json.loads(report.read_text())
    assert rep["exit_code"] == code, out + err
    return code, rep, report, err


# -- chunk selection -------------------------------------------------------------------------
def _planned(examples, chunk, shard, die_after=None):
    """(k, examples) of every chunk a campaign dispatches; ``die_after``: the first chunk's
    worker dies after that many examples (its unrun examples come back)."""
    run = CampaignRun(CampaignOptions(examples=examples, chunk=chunk, budget_s=None, seed=5, shard=shard))
    out = []
    while (task := run._next_task()) is not None:
        assert task["seed"] == chunk_seed(5, task["chunk"])
        out.append((task["chunk"], task["examples"]))
        if die_after is not None and len(out) == 1:
            run._dispatched -= task["examples"] - die_after
    assert [list(c) for c in run.result.chunks_run] == [[k, chunk_seed(5, k)] for k, _ in out]
    return out


@pytest.mark.parametrize("examples, chunk, n", [(7, 2, 3), (10, 3, 2), (5, 5, 3), (100, 7, 8), (3, 1, 3)])
def test_shards_split_the_unsharded_chunks(examples, chunk, n):
    whole = _planned(examples, chunk, (0, 1))
    assert sum(e for _, e in whole) == examples
    parts = [_planned(examples, chunk, (i, n)) for i in range(n)]
    for i, part in enumerate(parts):
        assert all(k % n == i for k, _ in part)
        assert part == shard_chunks(examples, chunk, (i, n))
    assert sorted(c for part in parts for c in part) == whole


def test_a_dead_chunk_s_examples_stay_in_its_shard():
    # shard 1/3 of 20 examples in chunks of 3: chunks 1 and 4 (3 + 3 examples); chunk 1 dies
    # after 1 example, so the shard runs 2 more in a chunk of its own past the plan (k = 7)
    assert _planned(20, 3, (1, 3), die_after=1) == [(1, 3), (4, 3), (7, 2)]


# -- usage errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("shard", [["--shard", "3/3"], ["--shard", "a/b"], ["--shard", "-1/2"], ["--shard=-1/2"],
                                   ["--shard", "0/0"], ["--shard", "1"], ["--shard", "1/2/3"]])
def test_bad_shard_is_one_line_before_any_work(shard, tmp_path, capsys):
    t0 = time.monotonic()
    code, _, err = _run(["run", *shard, "--corpus", str(tmp_path / "c"), "--examples", "3"], capsys)
    line = _one_line(err)
    assert code == 2 and line.startswith("mla-fuzz run: error:") and "--shard" in line
    assert not (tmp_path / "c").exists() and time.monotonic() - t0 < 20


def _report(tmp_path, name, **over) -> Path:
    rep = {"format": "mla-fuzz-report/1", "backend": "cli_fakes:RefBackend", "graph_mode": "eager", "spec": "tiny",
           "seed": 7, "chunk": 2, "examples_limit": 6, "examples": 2, "steps": 4, "chunks": 1, "restarts": 0,
           "workers": 1, "elapsed_s": 1.0, "cases_per_s": 2.0, "coverage": {"op": {"capture": 4}},
           "unsupported": {}, "failures_by_class": {}, "failures": [], "errors": [], "warnings": [], "exit_code": 0,
           "shard": [0, 3], "chunks_run": [[0, chunk_seed(7, 0)]]}
    rep.update(over)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(rep))
    return path


@pytest.mark.parametrize("case, text", [
    ("missing", "no such file"),
    ("not-json", "not valid JSON"),
    ("a-repro", "not an mla-fuzz campaign report"),
    ("other-seed", "not the same campaign as"),
    ("other-graph", "graph_mode"),
    ("bad-chunks", "chunks_run"),
])
def test_merge_input_errors_are_one_line(case, text, tmp_path, capsys):
    good = _report(tmp_path, "good")
    bad = tmp_path / "bad.json"
    if case == "not-json":
        bad.write_text("{\"format\": ")
    elif case == "a-repro":
        bad.write_text(json.dumps({"format": "mla-fuzz-repro/1"}))
    elif case == "other-seed":
        bad = _report(tmp_path, "bad", seed=8, shard=[1, 3])
        text = "seed 8 != 7"
    elif case == "other-graph":
        bad = _report(tmp_path, "bad", graph_mode="emulated", shard=[1, 3])
    elif case == "bad-chunks":
        bad = _report(tmp_path, "bad", chunks_run=[[1, "x"]])
    code, out, err = _run(["merge", str(good), str(bad), "--corpus", str(tmp_path / "m")], capsys)
    line = _one_line(err)
    assert code == 2 and line.startswith("mla-fuzz merge: error:") and text in line, line
    assert out == ""


@pytest.mark.parametrize("argv", [["merge"], ["merge", "r.json"]])
def test_merge_needs_reports_and_a_corpus(argv, capsys):
    code, _, err = _run(argv, capsys)
    assert code == 2 and _one_line(err).startswith("mla-fuzz merge: error:")


def test_merge_warns_about_missing_and_overlapping_shards(tmp_path, capsys):
    a = _report(tmp_path, "a")
    b = _report(tmp_path, "b", shard=[1, 3], chunks_run=[[0, chunk_seed(7, 0)], [1, chunk_seed(7, 1)]])
    out_json = tmp_path / "m.json"
    code, out, _ = _run(["merge", str(a), str(b), "--corpus", str(tmp_path / "m"), "--json", str(out_json)], capsys)
    assert code == 0 and "no failures found" in out
    assert "warning: shard(s) 2/3 missing" in out
    assert f"warning: {a} and {b} both ran chunk(s) 0:" in out
    rep = json.loads(out_json.read_text())
    assert rep["examples"] == 4 and rep["steps"] == 8 and rep["coverage"] == {"op": {"capture": 8}}
    assert rep["shards"] == [[0, 3], [1, 3]] and rep["chunks_run"] == [[0, chunk_seed(7, 0)], [1, chunk_seed(7, 1)]]


# -- end to end ------------------------------------------------------------------------------
def test_three_shards_cover_the_unsharded_campaign(tmp_path, fakes, capsys):
    flags = ["--graph", "eager", "--examples", "7", "--chunk", "2", "--seed", "7"]
    code, whole, _, _ = _campaign(tmp_path, capsys, "all", "eager", *flags[2:])
    assert code == 0 and whole["shard"] == [0, 1]
    assert [k for k, _ in whole["chunks_run"]] == [0, 1, 2, 3]
    shards, paths = [], []
    for i in range(3):
        code, rep, path, err = _campaign(tmp_path, capsys, f"s{i}", "eager", *flags[2:], "--shard", f"{i}/3")
        assert code == 0 and rep["shard"] == [i, 3] and f"shard {i}/3" in err
        assert all(k % 3 == i for k, _ in rep["chunks_run"])
        shards.append(rep)
        paths.append(str(path))
    assert sorted(c for rep in shards for c in rep["chunks_run"]) == whole["chunks_run"]
    assert [len(rep["chunks_run"]) for rep in shards] == [2, 1, 1]
    assert sum(rep["examples"] for rep in shards) == whole["examples"] == 7

    merged = tmp_path / "merged.json"
    code, out, _ = _run(["merge", *paths, "--corpus", str(tmp_path / "corpus"), "--json", str(merged)], capsys)
    assert code == 0 and "no failures found" in out and "warning" not in out, out
    rep = json.loads(merged.read_text())
    assert rep["exit_code"] == 0 and rep["chunks_run"] == whole["chunks_run"]
    for key in ("examples", "steps", "chunks", "coverage"):
        assert rep[key] == whole[key], key


def test_shards_findings_merge_into_one_corpus(tmp_path, fakes, capsys):
    # emulated graphs make the reference backend's host reads during capture a host-sync
    # finding, which each shard finds on its own
    reports = []
    for i in range(2):
        code, rep, path, _ = _campaign(tmp_path, capsys, f"s{i}", "emulated", "--examples", "2", "--chunk", "1",
                                       "--seed", "1", "--shard", f"{i}/2")
        assert code == 1 and [f["class"] for f in rep["failures"]] == ["host-sync"]
        reports.append((path, rep))
    sig = reports[0][1]["failures"][0]["signature"]
    assert reports[1][1]["failures"][0]["signature"] == sig

    corpus, merged = tmp_path / "corpus", tmp_path / "merged.json"
    code, out, _ = _run(["merge", *(str(p) for p, _ in reports), "--corpus", str(corpus), "--json", str(merged)],
                        capsys)
    assert code == 1 and "failures: 1 distinct (2 in all)" in out, out
    rep = json.loads(merged.read_text())
    assert rep["exit_code"] == 1 and rep["failures_by_class"] == {"host-sync": 2}
    assert rep["examples"] == sum(r["examples"] for _, r in reports)
    [f] = rep["failures"]
    files = sorted(corpus.glob("*.json"))
    assert f["signature"] == sig and f["count"] == 2 and files == [Path(f["path"])]
    assert f["found_in"] == ["0/2", "1/2"]
    smallest = min(len(load_repro(r["failures"][0]["path"])["steps"]) for _, r in reports)
    assert f["steps"] == len(load_repro(files[0])["steps"]) == smallest

    # a bigger repro of the same signature (one more step) loses, in either order
    small = load_repro(reports[0][1]["failures"][0]["path"])
    big = dict(small, steps=small["steps"] + [dict(small["steps"][-1])])
    big_path = tmp_path / "big-repro.json"
    big_path.write_text(json.dumps(big))
    fbig = dict(reports[1][1]["failures"][0], path=str(big_path), count=3, steps=len(big["steps"]))
    big_report = tmp_path / "big.json"
    big_report.write_text(json.dumps(dict(reports[1][1], failures=[fbig])))
    for order in ([big_report, reports[0][0]], [reports[0][0], big_report]):
        out_dir = tmp_path / f"c-{order[0].stem}"
        code, out, _ = _run(["merge", *map(str, order), "--corpus", str(out_dir), "--json", str(merged)], capsys)
        assert code == 1, out
        [f] = json.loads(merged.read_text())["failures"]
        assert f["count"] == 4 and f["steps"] == len(small["steps"])
        [written] = list(out_dir.glob("*.json"))
        assert load_repro(written)["steps"] == small["steps"]

    # a repro named by a report but gone: one line, exit 2, nothing merged
    gone = tmp_path / "gone.json"
    gone.write_text(json.dumps(dict(reports[1][1], failures=[dict(fbig, path=str(tmp_path / "nope.json"))])))
    code, out, err = _run(["merge", str(reports[0][0]), str(gone), "--corpus", str(tmp_path / "c3")], capsys)
    assert code == 2 and "nope.json: no such file" in _one_line(err)
    assert list((tmp_path / "c3").glob("*.json")) == []

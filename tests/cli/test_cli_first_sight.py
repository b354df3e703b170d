"""A failure reaches the user the moment a worker first sees it, then its shrunk repro
replaces the first one: the live line, the report entry and the unshrunk repro file come at
first sight; the finished finding is the same entry, with the first-sight time. Counts are
of searched examples only.

The first tests drive a campaign's bookkeeping with hand-made messages (no worker
processes); the last runs ``mla-fuzz run`` against a mutant end to end."""
from __future__ import annotations

import json
import time
from pathlib import Path

from mla_fuzz.harness import cli
from mla_fuzz.harness.campaign import UNDIAGNOSED, CampaignOptions, CampaignRun
from mla_fuzz.harness.render import summary_lines
from mla_fuzz.harness.repro import FORMAT, load_repro
from cli_helpers import RecordingDisplay, record_display, replaced_paths_are_announced
from cli_helpers import run_cli as _run


def _repro(key: str, steps: int, cls: str | None = None, seed: int = 0) -> dict:
    """A repro as a worker sends it: unshrunk and undiagnosed (``cls`` None) or final."""
    return {"format": FORMAT, "backend": "mutant:fake", "graph_mode": "emulated", "config": {"seed": seed},
            "steps": [{"op": "eager", "batch": {"seq_lens": [i + 1], "q_lens": [1], "seed": i}} for i in range(steps)],
            "failure": {"oracle": key.split(":")[0], "step": steps - 1, "message": f"{key} broke", "key": key},
            "diagnosis": None if cls is None else {"cls": cls, "explanation": "why", "oracle": key.split(":")[0]},
            "search": {"unshrunk": True} if cls is None else {}}


def _campaign(tmp_path):
    display = RecordingDisplay()
    run = CampaignRun(CampaignOptions(backend="mutant:fake", corpus=tmp_path / "corpus"), display)
    run._t0 = time.monotonic()
    return run, display


def _files(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "corpus").glob("*.json"))


def _adds_up(res) -> None:
    assert sum(f.count for f in res.findings.values()) == sum(res.failures.values()), (res.findings, res.failures)


def test_first_sight_is_reported_then_finished_in_place(tmp_path):
    run, display = _campaign(tmp_path)
    run._sighted("c0", {"repro": _repro("reference", 5)})
    res = run.result
    [f] = res.findings.values()
    assert not f.shrunk and f.cls == UNDIAGNOSED and f.path.exists()
    assert res.failures == {UNDIAGNOSED: 1}
    # the line came with the file already complete, the only one in the corpus
    [(_, text, files)] = display.notes
    assert "FOUND reference failure" in text and "unshrunk" in text
    assert json.loads(files[str(f.path)]["content"]) == _repro("reference", 5)
    assert files[str(f.path)]["listing"] == [f.path.name]
    first_path, first_at = f.path, f.found_at_s
    time.sleep(0.05)

    assert run._found(_repro("reference", 2, "stale-address"), 3, "c0")
    [g] = res.findings.values()
    assert g is f and g.shrunk and g.cls == "stale-address" and g.count == 1
    assert g.found_at_s == first_at and g.reduced_at_s > first_at and g.reduced_from == 5
    assert not first_path.exists() and g.path.exists() and _files(tmp_path) == [g.path.name]
    assert res.failures == {"stale-address": 1}
    assert f"replaces the unshrunk {first_path}" in display.notes[-1][1]
    replaced_paths_are_announced(display.notes)
    assert g.to_dict()["shrunk"] is True and g.to_dict()["found_at_s"] <= g.to_dict()["reduced_at_s"]


def test_another_chunk_can_finish_a_first_sight(tmp_path):
    run, display = _campaign(tmp_path)
    run._sighted("c0", {"repro": _repro("reference", 5)})
    time.sleep(0.02)
    run._sighted("c1", {"repro": _repro("reference", 4, seed=1)})  # the same failure: no second file or line
    assert len(display.notes) == 1 and len(_files(tmp_path)) == 1
    first_at = run.result.findings[next(iter(run.result.findings))].found_at_s
    run._found(_repro("reference", 3, "numerical", seed=1), 2, "c1")
    [f] = run.result.findings.values()
    assert f.shrunk and f.count == 2 and f.found_at_s == first_at and _files(tmp_path) == [f.path.name]
    _adds_up(run.result)
    # c0's own shrunk repro comes later: a smaller one replaces the file, nothing counts twice
    run._found(_repro("reference", 1, "numerical"), 4, "c0")
    [g] = run.result.findings.values()
    assert g is f and g.count == 2 and len(g.repro["steps"]) == 1 and _files(tmp_path) == [g.path.name]
    _adds_up(run.result)
    replaced_paths_are_announced(display.notes)


def test_a_first_sight_survives_its_worker_dying_while_shrinking(tmp_path):
    run, display = _campaign(tmp_path)
    run._sighted("c0", {"repro": _repro("reference", 5)})
    unshrunk = next(iter(run.result.findings.values())).path
    crash = _repro("worker-died:SIGABRT", 2, "crash")
    run._found(crash, None, "c0")
    by_cls = {f.cls: f for f in run.result.findings.values()}
    assert set(by_cls) == {UNDIAGNOSED, "crash"}
    assert by_cls[UNDIAGNOSED].path == unshrunk and unshrunk.exists() and not by_cls[UNDIAGNOSED].shrunk
    _adds_up(run.result)
    text = "\n".join(summary_lines(run.result))
    assert "5 (unshrunk)" in text and str(unshrunk) in text


def test_a_death_while_diagnosing_finishes_the_first_sight(tmp_path):
    run, _ = _campaign(tmp_path)
    run._sighted("c0", {"repro": _repro("reference", 5)})
    run._found(_repro("reference", 2, "crash"), None, "c0")  # crash_repro keeps the diagnosed failure's key
    [f] = run.result.findings.values()
    assert f.cls == "crash" and f.shrunk and _files(tmp_path) == [f.path.name]
    _adds_up(run.result)


def test_run_says_it_at_once_then_shrinks(tmp_path, capsys, monkeypatch):
    """``mla-fuzz run`` against a mutant: the first-sight line comes while the corpus holds only
    the unshrunk repro, which replays to the same oracle; the finished finding keeps the
    first-sight time, earlier than its final repro was written."""
    display = record_display(monkeypatch)
    corpus, report = tmp_path / "corpus", tmp_path / "r.json"
    code, out, err = _run(["run", "--mutant", "shared-lazy-sched", "--graph", "emulated", "--examples", "30",
                           "--seed", "0", "--corpus", str(corpus), "--json", str(report)], capsys)
    rep = json.loads(report.read_text())
    assert code == 1, out + err
    found = [(t, text, files) for t, text, files in display.notes if "FOUND" in text]
    assert len(found) == 1, display.notes
    seen_at, text, files = found[0]
    [(first_path, snap)] = files.items()
    assert snap["listing"] == [Path(first_path).name]  # nothing else yet: shrinking had not ended
    first = json.loads(snap["content"])
    assert first["search"]["unshrunk"] is True and first["diagnosis"] is None

    [f] = rep["failures"]
    final = Path(f["path"])
    assert f["shrunk"] is True and final.exists() and not Path(first_path).exists()
    assert sorted(p.name for p in corpus.glob("*.json")) == [final.name]
    assert rep["shrink_runs"] > 0
    assert f["found_at_s"] <= f["reduced_at_s"]
    assert seen_at <= final.stat().st_mtime + 0.01  # (file times lag the clock by up to a tick)
    assert f["found_at_s"] <= final.stat().st_mtime - cli._COMMAND_START + 0.01
    replaced_paths_are_announced(display.notes)
    # live counts never ran ahead of what was searched
    assert all(c <= rep["examples"] and s <= rep["steps"] for c, s in display.counts)

    # the unshrunk repro, as it was at first sight, replays to the same failure
    saved = tmp_path / "first.json"
    saved.write_text(snap["content"])
    load_repro(saved)
    code, out, _ = _run(["replay", str(saved), "--json", str(tmp_path / "rp.json")], capsys)
    assert code == 1 and "unshrunk" in out, out
    assert json.loads((tmp_path / "rp.json").read_text())["outcomes"][0]["oracle"] == f["oracle"]


def test_declined_scenarios_are_not_searched_examples(tmp_path, fakes, capsys, monkeypatch):
    """A backend that declines a third of the scenarios: the report's examples and coverage,
    and the live counts on the way, count only the scenarios it took (the declined ones are
    under ``unsupported``)."""
    display = record_display(monkeypatch)
    report = tmp_path / "r.json"
    code, out, err = _run(["run", "--backend", "cli_fakes:DecliningBackend", "--graph", "eager", "--examples", "12",
                           "--seed", "0", "--workers", "1", "--json", str(report)], capsys)
    rep = json.loads(report.read_text())
    assert code == 0, out + err
    assert rep["unsupported"].get("16-token pages", 0) > 0
    assert 0 < rep["examples"] <= 12
    pages = rep["coverage"]["page_size"]
    assert "16" not in pages and sum(pages.values()) == rep["examples"]
    assert display.counts and all(c <= rep["examples"] for c, _ in display.counts)

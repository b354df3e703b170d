"""The command line against the real Triton backend and a mutant (interpreted kernels,
emulated graphs): a mutant campaign's repro replays (exit 1) and the clean backend passes
it (exit 0); the detection matrix command catches a mutant with its expected diagnosis."""
from __future__ import annotations

import json

from mla_fuzz.harness.loading import load_backend
from mla_fuzz.harness.mutants import ALL, EXPECTED
from mla_fuzz.harness.mutants.heldout import HELDOUT, HELDOUT_EXPECTED
from mla_fuzz.harness.repro import load_repro
from cli_helpers import run_cli as _run

# Caught at its first capture (an ``.item()`` inside the captured forward): the cheapest
# mutant to find under the interpreter, so the test measures the command, not the search.
MUTANT = "item-in-capture"


def test_mutant_repro_replays_and_clean_backend_passes(tmp_path, capsys):
    corpus, report = tmp_path / "corpus", tmp_path / "report.json"
    code, out, _ = _run(["run", "--mutant", MUTANT, "--graph", "emulated", "--examples", "5", "--seed", "0",
                         "--corpus", str(corpus), "--json", str(report), "--quiet"], capsys)
    assert code == 1, out
    files = sorted(corpus.glob("*.json"))
    assert len(files) == 1
    data = load_repro(files[0])
    assert data["backend"] == f"mutant:{MUTANT}"
    assert data["diagnosis"]["cls"] in EXPECTED[MUTANT]
    assert json.loads(report.read_text())["failures"][0]["path"] == str(files[0])

    code, out, _ = _run(["replay", str(files[0])], capsys)
    assert code == 1 and "STILL FAILS" in out and f"diagnosis: {data['diagnosis']['cls']}" in out
    code, out, _ = _run(["replay", "--backend", "triton", str(files[0])], capsys)
    assert code == 0 and "PASSES" in out, out


def test_mutants_matrix_command(tmp_path, capsys):
    assert MUTANT in ALL
    out_json = tmp_path / "matrix.json"
    code, out, err = _run(["mutants", "--only", MUTANT, "--no-clean", "--graph", "emulated", "--examples", "5",
                           "--json", str(out_json)], capsys)
    assert code == 0, out + err
    m = json.loads(out_json.read_text())
    assert [r["name"] for r in m["rows"]] == [MUTANT]
    row = m["rows"][0]
    assert row["caught"] and row["matches"] and row["examples_to_detect"] >= 1
    # the finding's own words: the failing oracle's message, one line
    assert row["oracle"] and row["message"] and "\n" not in row["message"], row
    assert MUTANT in out and "yes" in out
    # time to the first finding counts from the command's start: after the row was handed
    # to a worker, no later than the row's end (shrunk and diagnosed) and the whole command
    assert isinstance(row["seconds_to_detect"], float), row
    assert 0 <= row["row_started_s"] <= row["seconds_to_detect"] <= row["seconds"] <= m["wall_s"]
    assert f"FOUND at example {row['examples_to_detect']}" in err and "first sight s" in out


def test_mutants_unknown_name_is_usage_error(capsys):
    code, _, err = _run(["mutants", "--only", "no-such-mutant"], capsys)
    assert code == 2 and "no-such-mutant" in err and len(err.strip().splitlines()) == 1


def test_mutants_heldout_set_runs_apart_from_the_public_one(tmp_path, capsys):
    # the held-out mutants stay out of ALL (the matrix never sees them), each with its expected classes
    assert not set(HELDOUT) & set(ALL) and set(HELDOUT_EXPECTED) == set(HELDOUT)
    name = sorted(HELDOUT)[0]
    assert load_backend(f"mutant:{name}") is HELDOUT[name]  # run/replay/repro refs resolve too
    out_json = tmp_path / "heldout.json"
    code, out, err = _run(["mutants", "--set", "heldout", "--only", name, "--no-clean", "--graph", "emulated",
                           "--examples", "2", "--json", str(out_json)], capsys)
    # two examples may or may not catch it: either way the row is run and reported
    assert code in (0, 1), out + err
    m = json.loads(out_json.read_text())
    assert m["set"] == "heldout" and [r["name"] for r in m["rows"]] == [name]
    row = m["rows"][0]
    assert row["backend"] == f"mutant:{name}" and row["expected"] == sorted(HELDOUT_EXPECTED[name])
    assert row["error"] is None and row["examples"] >= 1, row
    assert name in out and "(heldout set)" in err


def test_mutants_bad_set_is_usage_error(capsys):
    code, _, err = _run(["mutants", "--set", "secret"], capsys)
    assert code == 2 and "--set" in err and "secret" in err and len(err.strip().splitlines()) == 1
    # --only is checked against the chosen set: a public mutant is not a held-out one
    code, _, err = _run(["mutants", "--set", "heldout", "--only", MUTANT], capsys)
    assert code == 2 and MUTANT in err and "heldout" in err and len(err.strip().splitlines()) == 1


def test_detection_benchmark_cold_then_warm(tmp_path, load_benchmark, capsys):
    det = load_benchmark("detection")
    out_json = tmp_path / "det.json"
    code = det.main(["--graph", "emulated", "--only", MUTANT, "--examples", "3", "--out", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    doc = json.loads(out_json.read_text())
    assert doc["format"] == "mla-fuzz-detection-bench/1" and doc["settings"]["graph"] == "emulated"
    assert doc["versions"]["torch"] and doc["versions"]["python"] and doc["machine"]["cpus"] >= 1
    for name in ("cold", "warm"):
        [row] = doc["passes"][name]["rows"]
        assert row["caught"] and row["examples_to_detect"] >= 1, row
        # from the command's own process start: within the command's wall time, before its end
        assert isinstance(row["seconds_to_detect"], float) and 0 < row["seconds_to_detect"] <= row["seconds"]
        assert row["seconds"] <= row["wall_s"] and f"--only {MUTANT}" in row["command"]
    assert doc["passes"]["cold"]["rows"][0]["cache_files_before"] == 0  # a fresh Triton cache


def test_detection_benchmark_measures_mutants_side_by_side(tmp_path, load_benchmark, capsys):
    det = load_benchmark("detection")
    out_json = tmp_path / "det.json"
    names = [MUTANT, "noncontig-context-lens"]
    code = det.main(["--graph", "emulated", "--only", ",".join(names), "--examples", "3", "--passes", "warm",
                     "--parallel", "2", "--out", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["parallel"] == 2 and list(doc["passes"]) == ["warm"]
    rows = doc["passes"]["warm"]["rows"]
    assert [r["name"] for r in rows] == names  # in the order asked, whichever finished first
    assert all(r["caught"] and r["diagnosis"] in EXPECTED[r["name"]] for r in rows), rows


def test_detection_benchmark_medians_are_over_caught_rows(load_benchmark):
    det = load_benchmark("detection")
    rows = [{"name": "a", "caught": True, "seconds_to_detect": 3.0, "examples_to_detect": 4, "seconds": 9.0},
            {"name": "b", "caught": True, "seconds_to_detect": 1.0, "examples_to_detect": 2, "seconds": 5.0},
            {"name": "c", "caught": False, "seconds_to_detect": None, "examples_to_detect": None, "seconds": 60.0}]
    s = det.summarize(rows)
    assert s["caught"] == 2 and s["not_caught"] == ["c"]
    assert s["median_seconds_to_detect"] == 2.0 and s["median_examples_to_detect"] == 3.0
    assert s["median_seconds_final"] == 7.0 and s["max_seconds_to_detect"] == 3.0


def test_detection_benchmark_keeps_a_row_cut_after_its_first_sight(tmp_path, load_benchmark, capsys):
    """A command cut by --row-timeout while shrinking still counts as caught, at the first
    sight it announced; one cut before any sight is a row that says it timed out."""
    det = load_benchmark("detection")
    out_json = tmp_path / "det.json"
    # nan-zero-len is seen within a few examples and then shrunk for up to a minute
    code = det.main(["--graph", "emulated", "--only", "nan-zero-len", "--passes", "warm", "--row-timeout", "30",
                     "--out", str(out_json)])
    out, err = capsys.readouterr()
    [row] = json.loads(out_json.read_text())["passes"]["warm"]["rows"]
    if row.get("exit_code") is None:  # cut, as on this 2-core machine
        assert row["error"] == "timed out after 30 s" and row["caught"] and row["timed_out_after_sight"], row
        assert 0 < row["seconds_to_detect"] < 30 and row["examples_to_detect"] >= 1
    else:  # a fast machine shrank it within the 30 s
        assert row["caught"] and row["seconds"] <= 30
    assert code == 0, out + err


def test_mutants_at_both_sizes_gives_a_row_per_size(tmp_path, capsys):
    out_json = tmp_path / "m.json"
    code, out, err = _run(["mutants", "--only", MUTANT, "--spec", "both", "--graph", "emulated", "--examples", "2",
                           "--no-clean", "--json", str(out_json)], capsys)
    assert code == 0, out + err
    doc = json.loads(out_json.read_text())
    assert doc["spec"] == "both"
    got = [(r["name"], r["spec"], r["caught"]) for r in doc["rows"]]
    assert got == [(MUTANT, "tiny", True), (MUTANT, "deepseek-v3", True)], got
    assert all(r["diagnosis"] in EXPECTED[MUTANT] for r in doc["rows"])
    # each row is named with its size, in the table and in the live lines
    assert f"{MUTANT} (deepseek-v3)" in out and f"{MUTANT} (tiny)" in out
    assert f"{MUTANT} (tiny): FOUND at example" in err

"""The command line against the real Triton backend and a mutant (interpreted kernels,
emulated graphs): a mutant campaign's repro replays (exit 1) and the clean backend passes
it (exit 0); the detection matrix command catches a mutant with its expected diagnosis."""
from __future__ import annotations

import json

from mla_fuzz.harness.mutants import ALL, EXPECTED
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
    assert MUTANT in out and "yes" in out


def test_mutants_unknown_name_is_usage_error(capsys):
    code, _, err = _run(["mutants", "--only", "no-such-mutant"], capsys)
    assert code == 2 and "no-such-mutant" in err and len(err.strip().splitlines()) == 1

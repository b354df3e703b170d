"""The README's mutation-matrix table is the GPU json it names, row for row, and covers every
mutant a GPU run can see (the rest are the interpreter-only ones and those not yet run on a
GPU, named in the text)."""
import json
import re
from pathlib import Path

from mla_fuzz.harness.mutants import ALL, EXPECTED, INTERPRETER_ONLY, NOT_YET_ON_GPU

ROOT = Path(__file__).resolve().parents[2]


def test_readme_matrix_is_the_json_it_names():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<!-- matrix:begin -->"):readme.index("<!-- matrix:end -->")]
    path = re.search(r"\((benchmarks/results/[^)]+\.json)\)", block).group(1)
    data = json.loads((ROOT / path).read_text())
    rows = {r[0].strip("` "): [c.strip() for c in r[1:]]
            for r in (line.strip("|").split("|") for line in block.splitlines() if line.startswith("| `"))}
    assert set(rows) == {m["mutant"] for m in data["matrix"]} == set(ALL) - INTERPRETER_ONLY - NOT_YET_ON_GPU
    for m in data["matrix"]:
        caught, examples, seconds, diagnosis, steps, agrees = rows[m["mutant"]]
        assert caught == ("yes" if m["caught"] else "NO") and examples == str(m["examples_to_detect"])
        assert seconds == str(m["seconds_to_detect"]) and diagnosis == m["diagnosis"]
        assert steps == str(m["shrunk_steps"]) and agrees == ("yes" if m.get("emulated_agrees") else "no")
        assert m["diagnosis"] in EXPECTED[m["mutant"]]
    for name in INTERPRETER_ONLY | NOT_YET_ON_GPU:
        assert f"`{name}`" in block

"""The example backends (examples/) as a user runs them: ``mla-fuzz run`` finds nothing in
them, and with their limits undeclared what they cannot take is counted as unsupported,
never reported as a finding. (The 60 s campaigns of issue 40 are quoted from the CLI; here a
few examples each keep CI short.)"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mla_fuzz.harness.fuzz import fuzz
from mla_fuzz.mla_ref import Capabilities

EXAMPLES = {
    "reference": "mla_fuzz.examples.reference_backend:ReferenceBackend",
    "triton": "mla_fuzz.examples.triton_decode:TritonDecodeBackend",
    "sglang": "mla_fuzz.examples.sglang_style:SGLangStyleBackend",
}
# what a backend cannot take but a draw may contain (the limits); lse and schedule are
# conventions, kept when the declaration is "removed"
LIMITS = ("kv_dtypes", "q_dtypes", "next_n", "mtp", "page_sizes", "empty_rows", "sparse", "layer",
          "max_seq_len", "heads")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_passes_a_campaign(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CLI sets it up itself
    r = subprocess.run([sys.executable, "-m", "mla_fuzz.harness.cli", "run", "--backend", EXAMPLES[name],
                        "--examples", "6", "--seed", "3", "--quiet", "--graph", "emulated",
                        "--corpus", str(tmp_path / "c"), "--json", str(tmp_path / "r.json")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["failures"] == [] and rep["examples"] >= 6
    assert "capabilities:" in r.stderr
    assert rep["unsupported"] == {}, rep["unsupported"]  # declared: nothing outside is drawn


def _undeclared(ref: str):
    from mla_fuzz.harness.loading import load_backend
    cls = load_backend(ref)
    declared = cls.capabilities
    conventions = {f.name: getattr(declared, f.name) for f in dataclasses.fields(Capabilities)
                   if f.name not in LIMITS}
    return type(cls.__name__ + "Undeclared", (cls,), {"capabilities": Capabilities(**conventions)})


@pytest.mark.parametrize("name", ["triton", "sglang"])
def test_example_without_its_limits_declares_unsupported_not_findings(name, monkeypatch):
    import mla_fuzz.harness.loading as loading
    cls = _undeclared(EXAMPLES[name])
    real = loading.load_backend
    monkeypatch.setattr("mla_fuzz.harness.fuzz.load_backend", lambda ref: cls if ref == "undeclared" else real(ref))
    drawn = []  # scenarios the search drew (the hook sees each once, before its first step)
    r = fuzz("undeclared", spec="tiny", graph_mode="emulated", examples=10, seed=5,
             on_step=lambda cfg, steps, shrinking=False: None if steps else drawn.append(cfg))
    assert not r.failed, r.repro and (r.repro["failure"], r.repro["diagnosis"])
    declined = sum(r.unsupported.values())
    assert declined > 0 and all("plain NotImplementedError" not in k for k in r.unsupported)
    # a scenario the backend declined is not a searched example: the count is what ran
    assert r.examples + declined == len(drawn) and 0 < r.examples <= 10
    assert sum(r.coverage["kv_dtype"].values()) == r.examples  # coverage counts the same examples

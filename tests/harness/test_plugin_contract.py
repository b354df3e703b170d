"""The plug-in contract, tried as a third-party author would: backends in ``contract_fakes``
that each break one rule. Every finding must be the right kind, name the author's file and
line, and nothing the backend declines may become a finding."""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import contract_fakes
from mla_fuzz.harness.executor import run_steps
from mla_fuzz.harness.fuzz import fuzz
from mla_fuzz.harness.loading import load_backend
from mla_fuzz.harness.repro import replay_repro
from mla_fuzz.harness.scenario import ScenarioConfig
from mla_fuzz.mla_ref import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent.parent


def _cfg(**kw) -> ScenarioConfig:
    base = dict(spec=ModelSpec.tiny(num_heads=4).to_dict(), kv_dtype="fp16", q_dtype="fp16", page_size=16,
                capture_sizes=[1, 2], max_pages_per_seq=4)
    base.update(kw)
    return ScenarioConfig(**base)


_BATCH = {"seed": 3, "seq_lens": [5], "q_lens": [1], "max_decode_len": 1}


def _raise_line() -> int:
    src, start = inspect.getsourcelines(contract_fakes.RaisesInForward.forward)
    return start + next(i for i, line in enumerate(src) if "RAISE-LINE" in line)


@pytest.mark.parametrize("mode", ["emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backend_error_inside_capture_names_the_authors_line(mode):
    """An exception raised by the backend inside a capture is a backend-error at the
    backend's own file:line, not a host-sync (under CUDA the capture wraps it twice)."""
    cls = load_backend("contract_fakes:RaisesInForward")
    steps = [{"op": "capture", "size": 2, "batch": _BATCH, "warmups": 0, "share": False}]
    f = run_steps(cls, _cfg(), steps, graph_mode=mode, device="cuda" if mode == "cuda" else "cpu")
    assert f is not None and f.oracle == "backend-error", f
    assert f"contract_fakes.py:{_raise_line()}" in f.message
    assert "ValueError: this forward cannot take two rows" in f.message


def test_host_read_in_capture_is_host_sync_at_the_read():
    """A host read inside a capture stays host-sync, and names where the read is."""
    class ReadsHost(contract_fakes.OpBackend):
        def forward(self, q, kv_cache, md, out=None):
            int(md["sl"].max())  # HOST-READ
            return super().forward(q, kv_cache, md, out)

    steps = [{"op": "capture", "size": 1, "batch": _BATCH, "warmups": 0, "share": False}]
    f = run_steps(ReadsHost, _cfg(), steps, graph_mode="emulated", device="cpu")
    assert f is not None and f.oracle == "host-sync", f
    line = inspect.getsourcelines(ReadsHost.forward)[1] + 1
    assert f"test_plugin_contract.py:{line}" in f.message


def test_raw_triton_launch_under_emulation_says_to_register_a_custom_op():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, tl.load(x_ptr + i))

    class RawTriton(contract_fakes.OpBackend):
        def forward(self, q, kv_cache, md, out=None):
            o, lse = super().forward(q, kv_cache, md, out)
            scratch = torch.empty(4, device=q.device)
            _copy[(1,)](torch.zeros(4, device=q.device), scratch, N=4)
            return o, lse

    steps = [{"op": "capture", "size": 1, "batch": _BATCH, "warmups": 0, "share": False}]
    f = run_steps(RawTriton, _cfg(), steps, graph_mode="emulated", device="cpu")
    assert f is not None and f.oracle == "custom-op", f
    assert "torch.library.custom_op" in f.message and "--graph cuda" in f.message
    assert "test_plugin_contract.py:" in f.message


@pytest.mark.parametrize("name, field", [("WrongOutDtype", "out.dtype")])
def test_contract_violation_is_one_line_naming_the_field(name, field):
    cls = load_backend(f"contract_fakes:{name}")
    f = run_steps(cls, _cfg(), [{"op": "eager", "batch": _BATCH, "pad_to": None, "poison": False}], "emulated")
    assert f is not None and f.oracle == "contract" and f.evidence["field"] == field
    assert "expected torch.float16" in f.message and "\n" not in f.message


def test_missing_lse_when_declared_is_a_contract_finding():
    class Forgets(contract_fakes.OpBackend):
        def forward(self, q, kv_cache, md, out=None):
            return super().forward(q, kv_cache, md, out)[0]

    f = run_steps(Forgets, _cfg(), [{"op": "eager", "batch": _BATCH, "pad_to": None, "poison": False}], "emulated")
    assert f is not None and f.oracle == "contract" and "lse=None" in f.message


@pytest.mark.parametrize("name", ["NoLse", "StridedLse", "OpBackend"])
def test_valid_outputs_pass_every_oracle(name):
    """No lse (declared), a base-2 lse in q's dtype through a strided size-1 dim, and the
    plain backend: capture, replays of other batches (padded, poisoned), eager steps."""
    cls = load_backend(f"contract_fakes:{name}")
    b2 = {"seed": 5, "seq_lens": [17, 1], "q_lens": [1, 1], "max_decode_len": 1}
    steps = [{"op": "capture", "size": 2, "batch": _BATCH, "warmups": 1, "share": True},
             {"op": "replay", "size": 2, "batch": b2, "poison": True},
             {"op": "replay", "size": 2, "batch": _BATCH, "poison": False},
             {"op": "eager", "batch": b2, "pad_to": 2, "poison": True}]
    assert run_steps(cls, _cfg(), steps, "emulated") is None


def test_unsupported_inputs_are_counted_never_findings():
    r = fuzz("contract_fakes:DeclinesFP8", spec="tiny", graph_mode="emulated", examples=15, seed=4)
    assert not r.failed, r.repro and r.repro["failure"]
    assert r.unsupported.get("fp8 KV caches are not supported", 0) > 0
    assert any("plain NotImplementedError" in k for k in r.unsupported)


def test_declared_capabilities_bound_every_draw():
    """With capabilities declared, nothing outside them is drawn, so nothing is declined."""
    r = fuzz("contract_fakes:StridedLse", spec="tiny", graph_mode="emulated", examples=12, seed=5)
    assert not r.failed and not r.unsupported
    assert set(r.coverage["next_n"]) == {"1"} and "mtp" not in r.coverage
    assert set(r.coverage["kv_dtype"]) <= set(r.capabilities["kv_dtypes"])
    # on CPU, Triton's interpreter mis-computes bf16: third-party backends get fp16 (harness.interpreter)
    assert r.capabilities["q_dtypes"] == ["fp16"] and "bf16" not in r.coverage["kv_dtype"]


def test_narrowing_keeps_inside_the_declaration():
    r = fuzz("contract_fakes:OpBackend", spec="tiny", graph_mode="emulated", examples=8, seed=6,
             narrow={"kv_dtypes": ["fp16"], "next_n": [2], "page_sizes": [4]})
    assert not r.failed
    assert set(r.coverage["kv_dtype"]) == {"fp16"} and set(r.coverage["next_n"]) == {"2"}
    assert set(r.coverage["page_size"]) == {"4"}


def _run(args, tmp_path, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mla_fuzz.harness.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_constructor_mismatch_is_exit_2_naming_the_signature(tmp_path):
    r = _run(["run", "--backend", "contract_fakes:BadConstructor", "--budget", "5s"], tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "__init__(self, spec, *, device, max_batch, capture_sizes, graph_safe, **extra)" in lines[0]
    assert "contract_fakes.py:" in lines[0] and "cannot take" in lines[0]


def test_constructor_that_raises_is_exit_2_naming_its_line(tmp_path):
    r = _run(["run", "--backend", "contract_fakes:RaisingConstructor", "--budget", "20s", "--graph", "emulated",
              "--corpus", str(tmp_path / "c")], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[mla-fuzz]")]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1, r.stderr
    line = (TESTS / "contract_fakes.py").read_text().splitlines()
    where = next(i + 1 for i, ln in enumerate(line) if "the constructor's own error" in ln)
    assert f"contract_fakes.py:{where}" in errors[0] and "does not fit" in errors[0], errors[0]
    assert "cannot be built" in errors[0]
    assert not list((tmp_path / "c").glob("*.json"))  # a set-up error is not a finding


def test_narrowing_outside_the_declaration_is_exit_2(tmp_path):
    r = _run(["run", "--backend", "contract_fakes:StridedLse", "--next-n", "2", "--budget", "5s"], tmp_path)
    assert r.returncode == 2 and "next-n 2: the backend supports 1 only" in r.stderr, r.stderr


def test_one_frequent_failure_does_not_hide_a_rare_one(tmp_path):
    """Both errors of ``FrequentAndRare`` are reported by one 30 s campaign: once the frequent
    one is known, later chunks search past it."""
    r = _run(["run", "--backend", "contract_fakes:FrequentAndRare", "--budget", "30s", "--seed", "1",
              "--chunk", "10", "--quiet", "--graph", "emulated", "--corpus", str(tmp_path / "c"),
              "--json", str(tmp_path / "r.json")], tmp_path, timeout=400)
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    messages = [f["message"] for f in rep["failures"]]
    assert any("frequent:" in m for m in messages) and any("rare:" in m for m in messages), messages
    assert all(f["class"] == "backend-error" for f in rep["failures"])
    # each repro names the author's line and replays to the same error
    for f in rep["failures"]:
        data = json.loads(Path(f["path"]).read_text())
        assert "contract_fakes.py:" in data["failure"]["site"]
        sys.path.insert(0, str(TESTS))
        again = replay_repro(data)
        assert again.failed and again.failure.message.split(" (at ")[0] == data["failure"]["message"].split(" (at ")[0]


@pytest.mark.parametrize("strict", [False, True])
def test_strided_views_of_the_cache_are_not_contiguity_findings(strict):
    """By default only views of the metadata count (vLLM #42135's class); a kernel reading a
    strided V view of the cache is fine. ``strict_contiguity`` keeps the old, strict audit."""
    cls = load_backend("contract_fakes:StridedValueView")
    steps = [{"op": "capture", "size": 1, "batch": _BATCH, "warmups": 0, "share": False},
             {"op": "replay", "size": 1, "batch": _BATCH, "poison": True}]
    f = run_steps(cls, _cfg(), steps, "emulated", strict_contiguity=strict)
    if strict:
        assert f is not None and f.oracle == "contiguity" and "contract_fakes::decode_v argument #2" in f.message
    else:
        assert f is None, f


def test_docs_render_the_declared_oracles():
    """The oracle table in the docs is ``ORACLES`` rendered (python -m mla_fuzz.harness.oracles FILE)."""
    from mla_fuzz.harness.oracles import ORACLES, render_into
    for doc in ("docs/design.md", "docs/backends.md", "README.md"):
        text = (ROOT / doc).read_text()
        assert render_into(text) == text, f"{doc}: stale oracle table; run python -m mla_fuzz.harness.oracles {doc}"
    # every phased oracle has its executor method
    from mla_fuzz.harness.executor import ScenarioRunner
    for o in ORACLES:
        if o.phases:
            assert hasattr(ScenarioRunner, "_oracle_" + o.name.replace("-", "_")), o.name


def _pytest(args, tmp_path, extra_env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--pyargs", "mla_fuzz.harness.suite", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_pytest_plugin_on_cpu_as_documented(tmp_path):
    """The README's plugin command on a CPU machine: the interpreter is set up like the CLI's,
    capabilities are honoured (fixed scenarios outside them are skipped, with the reason),
    failures' repros go to --mla-corpus."""
    r = _pytest(["--mla-backend=contract_fakes:StridedLse", "--mla-graph=emulated", "--mla-examples", "4",
                 "--mla-corpus", str(tmp_path / "corpus"), "-rs"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "outside the backend's capabilities" in r.stdout  # e.g. the MTP scenarios for an mtp='none' backend
    assert " passed" in r.stdout


def test_pytest_plugin_writes_repros_to_the_corpus(tmp_path):
    r = _pytest(["--mla-backend=contract_fakes:WrongOutDtype", "--mla-graph=emulated", "--mla-examples", "2",
                 "--mla-corpus", str(tmp_path / "corpus"), "-x"], tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "contract:" in r.stdout and list((tmp_path / "corpus").glob("contract-*.json"))


@pytest.mark.parametrize("args, text", [
    (["--mla-backend=no_such_module:X"], "ERROR: --mla-backend no_such_module:X: backend 'no_such_module:X': cannot import"),
    (["--mla-backend=contract_fakes:BadConstructor"], "cannot take"),
    pytest.param(["--mla-graph=cuda"], "ERROR: --mla-graph cuda: no CUDA device is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
])
def test_pytest_plugin_usage_errors_are_one_line(args, text, tmp_path):
    r = _pytest(args, tmp_path)
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage-error exit code
    assert text in r.stderr and "Traceback" not in r.stderr + r.stdout, r.stderr

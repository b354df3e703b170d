"""The GPU running out of memory is the environment's doing while tasks share the GPU (not a
finding: the task runs again with fewer beside it) and the backend's own once it runs alone.
Proven on CPU with test doubles that raise ``torch.OutOfMemoryError`` (``contract_fakes``)."""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import contract_fakes
from mla_fuzz.harness import blame
from mla_fuzz.harness.blame import DeviceOutOfMemory
from mla_fuzz.harness.executor import run_steps
from mla_fuzz.harness.loading import load_backend
from mla_fuzz.harness.scenario import ScenarioConfig
from mla_fuzz.harness.throttle import OomThrottle
from mla_fuzz.mla_ref import ModelSpec

TESTS = Path(__file__).resolve().parent.parent

_CFG = dict(spec=ModelSpec.tiny(num_heads=4).to_dict(), kv_dtype="fp16", q_dtype="fp16", page_size=16,
            capture_sizes=[1, 2], max_pages_per_seq=4)
_STEPS = [{"op": "capture", "size": 2, "batch": {"seed": 3, "seq_lens": [5, 7], "q_lens": [1, 1],
                                                 "max_decode_len": 1}, "warmups": 0, "share": False}]


def _oom_line() -> int:
    src, start = inspect.getsourcelines(contract_fakes.OomAlways.check)
    return start + next(i for i, line in enumerate(src) if "OOM-LINE" in line)


def test_throttle_halves_the_cap_and_runs_the_last_retry_alone():
    t = OomThrottle()
    assert t.allows(15)
    line = t.ran_out({"op": "fuzz", "id": "c3", "chunk": 3, "seed": 9}, 8)
    assert t.cap == 4 and "chunk 3 (seed 9)" in line and "8 task(s)" in line and "not a finding" in line
    assert t.allows(3) and not t.allows(4)
    assert t.next_retry(4) is None  # no room yet
    again = t.next_retry(2)
    assert again["id"] == "c3" and again["oom_retries"] == 1 and "alone" not in again
    t.ran_out(again, 3)
    t.ran_out({"op": "fuzz", "id": "c5", "chunk": 5}, 2)
    assert t.cap == 1
    assert t.next_retry(1) is None
    first = t.next_retry(0)
    assert first["id"] == "c3" and first["alone"] is True and first["oom_retries"] == 2
    # a matrix row and a warmup scenario are named for what they are
    assert "row mutant:nan-zero-len ran out" in t.ran_out({"op": "fuzz", "id": "m1", "backend": "mutant:nan-zero-len"}, 1)
    assert "warmup scenario 'tiny: short'" in t.ran_out({"op": "warmup", "id": "w-0", "name": "tiny: short"}, 1)


def test_a_step_out_of_memory_is_the_environment_unless_alone(monkeypatch):
    cls = load_backend("contract_fakes:OomAlways")
    monkeypatch.setattr(blame, "OOM_IS_ENVIRONMENT", True)  # a pool's worker, beside others
    with pytest.raises(DeviceOutOfMemory, match=r"step 0 \(capture\): OutOfMemoryError: CUDA out of memory"):
        run_steps(cls, ScenarioConfig(**_CFG), _STEPS, "emulated")
    monkeypatch.setattr(blame, "OOM_IS_ENVIRONMENT", False)  # alone, or in-process: the default
    f = run_steps(cls, ScenarioConfig(**_CFG), _STEPS, "emulated")
    assert f is not None and f.oracle == "backend-error", f
    assert f"contract_fakes.py:{_oom_line()}" in f.message and "out of memory" in f.message


# Out of GPU memory as other layers than torch's allocator word it (what the worker sees when
# a Triton launch, a graph's instantiation or a library's workspace does not fit)
_WORDINGS = [(RuntimeError, "Triton Error [CUDA]: out of memory"),
             (RuntimeError, "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
             (RuntimeError, "CUDA driver error: out of memory"),
             (RuntimeError, "cuModuleLoadData failed: CUDA_ERROR_OUT_OF_MEMORY"),
             (RuntimeError, "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")]


@pytest.mark.parametrize("error", _WORDINGS, ids=lambda e: e[1][:24])
def test_every_wording_of_out_of_memory_is_the_environment_beside_others(monkeypatch, error):
    monkeypatch.setattr(contract_fakes.OomAlways, "error", error)
    monkeypatch.setattr(blame, "OOM_IS_ENVIRONMENT", True)
    with pytest.raises(DeviceOutOfMemory, match=r"step 0 \(capture\): "):
        run_steps(load_backend("contract_fakes:OomAlways"), ScenarioConfig(**_CFG), _STEPS, "emulated")
    # and never a lost CUDA context: the process goes on after an out-of-memory error
    assert not blame.is_cuda_error(f"{error[0].__name__}: {error[1]}")


def test_other_device_errors_are_not_out_of_memory():
    for text in ("out of resource: shared memory, Required: 262144, Hardware limit: 232448",
                 "CUDA error: an illegal memory access was encountered", "backend ran out of its workspace"):
        assert blame.find_oom(RuntimeError(text)) is None, text
    assert blame.is_cuda_error("RuntimeError: CUDA error: an illegal memory access was encountered")


def _run(args, tmp_path, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mla_fuzz.harness.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _campaign(backend: str, examples: int, seed: int, tmp_path):
    """A two-worker emulated campaign of two chunks; the process and its JSON report."""
    r = _run(["run", "--backend", f"contract_fakes:{backend}", "--examples", str(examples), "--chunk",
              str(examples // 2), "--workers", "2", "--seed", str(seed), "--graph", "emulated", "--quiet",
              "--corpus", str(tmp_path / "c"), "--json", str(tmp_path / "r.json")], tmp_path)
    return r, (json.loads((tmp_path / "r.json").read_text()) if (tmp_path / "r.json").exists() else None)


def test_a_campaign_runs_an_out_of_memory_chunk_again_and_finds_nothing(tmp_path):
    r, rep = _campaign("OomOnce", 12, 4, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    # each worker process ran out once: both chunks ran again, and every example was searched
    assert rep["failures"] == [] and rep["errors"] == [] and rep["oom_retries"] >= 1
    assert rep["examples"] >= 12
    assert "GPU out of memory:" in r.stdout and "not findings" in r.stdout


def test_an_out_of_memory_that_repeats_alone_is_the_backends_finding(tmp_path):
    r, rep = _campaign("OomAlways", 8, 2, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert rep["oom_retries"] >= 1 and rep["errors"] == []
    assert [f["class"] for f in rep["failures"]] == ["backend-error"], rep["failures"]
    f = rep["failures"][0]
    assert "OutOfMemoryError" in f["message"] and f"contract_fakes.py:{_oom_line()}" in f["message"]


def test_a_matrix_row_out_of_memory_runs_again_and_is_not_caught(monkeypatch):
    from mla_fuzz.harness.worker_env import worker_envs
    from mla_fuzz.harness.matrix import run_matrix

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    notes = []
    rows = run_matrix(["contract_fakes:OomOnce", "contract_fakes:OomOnce"], {}, graph="emulated", spec="tiny",
                      examples=3, seed=0, worker_envs=worker_envs(2, "emulated"), case_timeout=300.0,
                      on_note=notes.append)
    assert len(rows) == 2
    for row in rows:
        assert not row["caught"] and row["error"] is None and row["diagnosis"] is None, row
    assert sum(r["oom_retries"] for r in rows) == 2  # one per worker process
    assert any("ran out of GPU memory" in n and "not a finding" in n for n in notes), notes


def test_a_failure_seen_before_running_out_of_memory_is_shrunk_by_the_rerun(tmp_path):
    r = _run(["run", "--backend", "contract_fakes:OomWhileShrinking", "--examples", "30", "--workers", "1",
              "--seed", "1", "--graph", "emulated", "--quiet", "--corpus", str(tmp_path / "c"),
              "--json", str(tmp_path / "r.json")], tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["oom_retries"] == 1 and rep["errors"] == [], rep
    [f] = rep["failures"]
    # one finding, seen once before the out-of-memory error, finished by the rerun: shrunk, diagnosed
    assert f["class"] == "backend-error" and "three rows are one too many" in f["message"], f
    assert f["count"] == 1 and rep["failures_by_class"] == {"backend-error": 1}, rep
    assert not Path(f["path"]).name.startswith("unshrunk-") and Path(f["path"]).exists()
    assert not list((tmp_path / "c").glob("unshrunk-*.json"))
    data = json.loads(Path(f["path"]).read_text())
    assert len(data["steps"]) <= 2 and data["diagnosis"]["cls"] == "backend-error"


def test_in_process_an_out_of_memory_error_is_the_backends():
    """``fuzz()`` called in a process of its own (the pytest plugin does): nothing else holds
    the GPU, so running out of memory is a finding at the backend's line, never an escape."""
    from mla_fuzz.harness.fuzz import fuzz
    assert blame.OOM_IS_ENVIRONMENT is False
    report = fuzz("contract_fakes:OomAlways", spec="tiny", graph_mode="emulated", examples=10, seed=0,
                  shrink_seconds=10)
    assert report.failed and report.repro["diagnosis"]["cls"] == "backend-error"
    assert f"contract_fakes.py:{_oom_line()}" in report.repro["failure"]["message"]


def test_the_harness_running_out_of_memory_is_never_a_finding_nor_a_harness_bug(monkeypatch):
    """The harness's own tensors (reference, KV pools) not fitting says nothing about the
    backend: an environment error even when the task has the GPU to itself, never
    ``backend-error`` and never "mla-fuzz itself failed"."""
    from mla_fuzz.harness import world

    def full(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 448.00 MiB.")
    monkeypatch.setattr(world.World, "reset_cache", full)
    assert blame.OOM_IS_ENVIRONMENT is False
    with pytest.raises(DeviceOutOfMemory, match=r"step 0: mla-fuzz's own allocation: OutOfMemoryError"):
        run_steps(load_backend("contract_fakes:OpBackend"), ScenarioConfig(**_CFG), _STEPS, "emulated")


def test_an_out_of_memory_error_of_a_task_that_ran_alone_is_not_run_again():
    from mla_fuzz.harness.pool import Event
    msg = {"t": "error", "kind": "oom", "error": "out of GPU memory: step 0: ..."}
    assert OomThrottle.retries(Event("error", 0, {"id": "m1", "op": "fuzz"}, msg))
    assert not OomThrottle.retries(Event("error", 0, {"id": "m1", "op": "fuzz", "alone": True}, msg))
    assert not OomThrottle.retries(Event("error", 0, {"id": "m1", "op": "fuzz"}, {**msg, "kind": "internal"}))

"""A campaign survives a backend that, by case, aborts, hangs, raises in build and inside a
capture, returns wrong outputs and (on a GPU) makes an illegal memory access: each is its own
finding with a replayable repro, no worker or temp file is left behind, the report adds up."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent


def _campaign(tmp_path, graph: str, budget: str, workers: str):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), TMPDIR=str(tmp))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mla_fuzz.harness.cli", "run", "--backend", "contract_fakes:Chaos",
                        "--graph", graph, "--budget", budget, "--seed", "7", "--workers", workers, "--chunk", "8",
                        "--case-timeout", "6", "--quiet", "--corpus", str(tmp_path / "corpus"),
                        "--json", str(tmp_path / "r.json")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    return r, json.loads((tmp_path / "r.json").read_text()), tmp, time.monotonic() - t0


def _workers_left(tmp: Path) -> list[int]:
    """Worker processes of this campaign still alive (found by the TMPDIR it gave them)."""
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"mla_fuzz.harness.worker" in cmd and f"TMPDIR={tmp}".encode() in env.split(b"\0"):
            left.append(int(proc.name))
    return left


def _check(r, rep, tmp, want: set):
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and rep["errors"] == [], rep["errors"]
    kinds = set()
    for f in rep["failures"]:
        data = json.loads(Path(f["path"]).read_text())
        key = data["failure"].get("key") or data["failure"]["oracle"]
        kinds.add("abort" if "SIGABRT" in key else "ima" if "cuda-context-lost" in key else
                  "hang" if f["class"] == "hang" else
                  "build" if "CHAOS" not in key and "KeyError" in key else
                  "forward" if "ValueError" in key else f["class"])
    assert want <= kinds, (kinds, [f["message"][:120] for f in rep["failures"]])
    assert len(rep["failures"]) == len({f["signature"] for f in rep["failures"]})
    # the report adds up
    assert sum(rep["coverage"]["kv_dtype"].values()) == rep["examples"]
    assert sum(rep["coverage"]["op"].values()) == rep["steps"]
    assert sum(f["count"] for f in rep["failures"]) == sum(rep["failures_by_class"].values())
    # nothing left behind
    time.sleep(1)
    left = [p.name for p in tmp.iterdir() if not p.name.startswith(("torchinductor_", ".triton"))]  # torch's caches
    assert left == [], left
    assert _workers_left(tmp) == []


def test_chaos_campaign_on_cpu(tmp_path):
    r, rep, tmp, _ = _campaign(tmp_path, "emulated", "90s", "2")
    _check(r, rep, tmp, {"abort", "hang", "build", "forward"})
    # every repro replays to its own failure in a fresh process
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    for f in rep["failures"]:
        out = subprocess.run([sys.executable, "-m", "mla_fuzz.harness.cli", "replay", f["path"]], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and "STILL FAILS" in out.stdout, (f["path"], out.stdout[-1500:], out.stderr[-800:])


@pytest.mark.gpu
def test_chaos_campaign_on_a_gpu(tmp_path):
    r, rep, tmp, _ = _campaign(tmp_path, "cuda", "120s", "4")
    _check(r, rep, tmp, {"abort", "hang", "build", "forward", "ima"})


def test_a_cuda_error_surfacing_in_harness_code_ends_the_worker():
    """Kernels run asynchronously: an illegal access made by one step can surface in a later
    step's harness code (allocating the next scenario's cache). That is a lost context (the
    worker exits, the campaign records a crash), never an error of the search."""
    from mla_fuzz.harness.blame import CudaContextLost
    from mla_fuzz.harness.machine import _lost_context

    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("while allocating the KV cache") from inner
    except ValueError as outer:
        with pytest.raises(CudaContextLost, match="step 3: RuntimeError: CUDA error: an illegal memory access"):
            _lost_context(outer, 3)
    _lost_context(ValueError("a shape mismatch"), 3)  # anything else is left to the caller

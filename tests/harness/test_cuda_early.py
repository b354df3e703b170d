"""``harness.cuda_early``: a GPU worker's head start on its CUDA context. With a GPU, the
context it retains is the one torch then computes in; without one it records why and leaves
the process as it was (torch meets and reports the absence itself)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import json, sys
from mla_fuzz.harness import cuda_early
cuda_early.open_primary_context().join(120)
import torch
out = dict(cuda_early.RESULT, available=torch.cuda.is_available())
if out["available"]:
    import ctypes
    x = torch.arange(6.0, device="cuda").reshape(2, 3)
    out["sum"] = float((x @ x.T).sum())
    cur = ctypes.c_void_p()
    ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(cur))
    out["torch_context"] = cur.value
else:
    x = torch.arange(6.0).reshape(2, 3)
    out["sum"] = float((x @ x.T).sum())
print(json.dumps(out))
"""


def _probe(visible: str | None) -> dict:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_without_a_visible_gpu_the_head_start_records_why_and_changes_nothing():
    out = _probe("")
    assert out["error"] and out["context"] is None, out
    assert out["available"] is False
    assert out["sum"] == 83.0  # [[0,1,2],[3,4,5]] times its transpose: 5 + 14 + 14 + 50


@pytest.mark.gpu
def test_the_context_made_early_is_the_one_torch_computes_in():
    out = _probe("0")
    assert out["error"] is None and out["context"], out
    assert out["available"] is True
    assert out["torch_context"] == out["context"], out
    assert out["sum"] == 83.0, out  # as on the CPU

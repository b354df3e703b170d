"""Properties every MLA decode backend must have under CUDA-graph replay.

Parameterised by the plugin's ``--mla-backend`` / ``--mla-graph``. The first tests are
canonical scenario shapes that broke real engines in 2026 (each a few steps); the last
is an open-ended fuzz search. Every failure message carries the diagnosis and the path
of a repro file that ``mla-fuzz replay`` re-runs. A canonical scenario outside what the
backend declares (its ``capabilities``) is skipped with the reason; a bf16 scenario runs
in fp16 where the backend (or, on CPU, Triton's interpreter) has no bf16.
"""
from __future__ import annotations

import json

import pytest

from mla_fuzz.harness.diagnosis import diagnose
from mla_fuzz.harness.executor import run_steps
from mla_fuzz.harness.fuzz import fuzz, resolve_mode
from mla_fuzz.harness.graphs import default_device
from mla_fuzz.harness.loading import load_backend, supports_layer
from mla_fuzz.harness.repro import make_repro, write_repro
from mla_fuzz.harness.scenario import ScenarioConfig, outside_capabilities
from mla_fuzz.mla_ref import ModelSpec


def _cfg(spec: str, caps, **kw) -> ScenarioConfig:
    s = ModelSpec.from_name(spec)
    big = s.num_heads > 16
    base = dict(spec=s.to_dict(), page_size=64 if big else 16, max_pages_per_seq=4 if big else 6,
                capture_sizes=[2, 4], next_n=1, seed=3)
    base.update(kw)
    kv = base.get("kv_dtype", "bf16")
    if kv == "bf16" and not ("bf16" in caps.kv_dtypes and "bf16" in caps.q_dtypes):
        kv = "fp16" if "fp16" in caps.kv_dtypes and "fp16" in caps.q_dtypes else kv
    base["kv_dtype"] = kv
    base["q_dtype"] = kv if kv not in ("fp8", "fp8_e4m3") else ("bf16" if "bf16" in caps.q_dtypes else "fp16")
    if caps.page_sizes is not None and base["page_size"] not in caps.page_sizes:
        seq = base["page_size"] * base["max_pages_per_seq"]
        base["page_size"] = caps.page_sizes[-1]
        base["max_pages_per_seq"] = max(1, -(-seq // base["page_size"]))
    return ScenarioConfig(**base)


def _draw(seed, seq_lens, q_lens=None, mdl=None):
    q_lens = q_lens or [1 if s else 0 for s in seq_lens]
    return {"seed": seed, "seq_lens": seq_lens, "q_lens": q_lens, "max_decode_len": mdl or max(q_lens + [1])}


def _check(backend_ref, mode, cfg, steps, caps, corpus):
    why = outside_capabilities(cfg, steps, caps)
    if why is not None:
        pytest.skip(why)
    cls = load_backend(backend_ref)
    mode = resolve_mode(mode)
    dev = default_device(mode)
    failure = run_steps(cls, cfg, steps, mode, dev)
    if failure is None:
        return
    diag = diagnose(cls, cfg, steps, failure, mode, dev)
    path = write_repro(make_repro(backend_ref, mode, cfg, steps, failure, diag), corpus)
    pytest.fail(f"{diag.cls}: {diag.explanation}\nrepro: {path}", pytrace=False)


def _seq(cfg, *lens):
    return [min(x, cfg.max_seq_len) for x in lens]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "fp8_e4m3"])
def test_replay_with_longer_batch_than_captured(mla_backend_ref, mla_graph_mode, mla_spec, mla_capabilities, mla_corpus, kv_dtype):
    """Capture with short rows, replay rows that cross pages and splits (stale plan/addresses);
    with the per-tensor FP8 cache, the layer's scale also changes after the capture (a scale
    tensor re-created per build keeps the capture-time value)."""
    cfg = _cfg(mla_spec, mla_capabilities, kv_dtype=kv_dtype)
    steps = [{"op": "capture", "size": 4, "batch": _draw(1, _seq(cfg, 1, 2))},
             {"op": "replay", "size": 4, "batch": _draw(2, _seq(cfg, cfg.max_seq_len, 17, 40)), "poison": False},
             {"op": "replay", "size": 4, "batch": _draw(3, _seq(cfg, 5, cfg.max_seq_len - 1, 33, 64)),
              "poison": True}]
    if kv_dtype == "fp8_e4m3":
        for step, scale in zip(steps, (1.0, 0.5, 2.0)):
            step["batch"]["k_scale"] = scale
    _check(mla_backend_ref, mla_graph_mode, cfg, steps, mla_capabilities, mla_corpus)


def test_warmup_then_capture_then_replay(mla_backend_ref, mla_graph_mode, mla_spec, mla_capabilities, mla_corpus):
    """Warmup with dummy lengths must not freeze the plan into the capture (vLLM #42444)."""
    cfg = _cfg(mla_spec, mla_capabilities)
    steps = [{"op": "warmup", "size": 2, "batch": _draw(1, [1, 1])},
             {"op": "capture", "size": 2, "batch": _draw(2, [1, 1])},
             {"op": "replay", "size": 2, "batch": _draw(3, _seq(cfg, cfg.max_seq_len, 30)), "poison": False}]
    _check(mla_backend_ref, mla_graph_mode, cfg, steps, mla_capabilities, mla_corpus)


@pytest.mark.parametrize("next_n,mdl", [(2, 1), (4, 2), (3, 3)])
def test_mtp_mixed_query_lengths(mla_backend_ref, mla_graph_mode, mla_spec, mla_capabilities, mla_corpus, next_n, mdl):
    """MTP with max_decode_len <= next_n and mixed q_lens, eager and replayed (vLLM #42135)."""
    cfg = _cfg(mla_spec, mla_capabilities, next_n=next_n)
    q = [mdl, 1, min(mdl, 2)][:3]
    steps = [{"op": "eager", "batch": _draw(4, _seq(cfg, 20, 3, 50), q, mdl), "pad_to": 4, "poison": True},
             {"op": "capture", "size": 4, "batch": _draw(5, [5, 5], [1, 1], 1)},
             {"op": "replay", "size": 4, "batch": _draw(6, _seq(cfg, 40, 9, 64), q, mdl), "poison": True}]
    _check(mla_backend_ref, mla_graph_mode, cfg, steps, mla_capabilities, mla_corpus)


def test_zero_length_rows_and_poisoned_padding(mla_backend_ref, mla_graph_mode, mla_spec, mla_capabilities, mla_corpus):
    """seq_len 0 rows give out 0 / lse -inf; NaN padding never reaches real rows."""
    cfg = _cfg(mla_spec, mla_capabilities)
    steps = [{"op": "eager", "batch": _draw(7, [0, 12, 0]), "pad_to": 4, "poison": True},
             {"op": "capture", "size": 4, "batch": _draw(8, [3])},
             {"op": "replay", "size": 4, "batch": _draw(9, _seq(cfg, 0, 64, 1)), "poison": True}]
    _check(mla_backend_ref, mla_graph_mode, cfg, steps, mla_capabilities, mla_corpus)


@pytest.mark.parametrize("fp8_out", [False, True])
def test_layer_step_with_padding(mla_backend_ref, mla_graph_mode, mla_spec, mla_capabilities, mla_corpus, fp8_out):
    """A whole layer step (cache write + attention + FP8 output quantisation) under padding."""
    if not supports_layer(load_backend(mla_backend_ref)):
        pytest.skip("backend has no write_kv: layer scenarios do not apply")
    cfg = _cfg(mla_spec, mla_capabilities, layer=True, fp8_out=fp8_out, next_n=2)
    steps = [{"op": "capture", "size": 4, "batch": _draw(10, [2, 2], [1, 1], 1)},
             {"op": "replay", "size": 4, "batch": _draw(11, _seq(cfg, 30, 2), [2, 1], 2), "poison": True},
             {"op": "replay", "size": 4, "batch": _draw(12, _seq(cfg, 7, 31, 64), [1, 2, 2], 2), "poison": False}]
    _check(mla_backend_ref, mla_graph_mode, cfg, steps, mla_capabilities, mla_corpus)


def test_fuzz_search(mla_backend_ref, mla_graph_mode, mla_spec, mla_capabilities, mla_corpus, mla_examples,
                     mla_max_seq_len):
    """Open-ended search: no oracle fires in ``--mla-examples`` scenarios."""
    report = fuzz(mla_backend_ref, spec=mla_spec, graph_mode=mla_graph_mode, examples=mla_examples, seed=0,
                  max_seq_len=mla_max_seq_len)
    if report.failed:
        path = write_repro(report.repro, mla_corpus)
        d = report.repro["diagnosis"]
        pytest.fail(f"{d['cls']}: {d['explanation']}\nrepro: {path}\nsteps: "
                    f"{json.dumps(report.repro['steps'])}", pytrace=False)
    assert report.examples > 0

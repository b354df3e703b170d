"""Steps as engines run them (issue #44 item 6): one build, several attention layers, each with
its own KV cache and queries, every layer's output kept until the step ends.

The clean backend passes such steps on every data path, eagerly and under an emulated graph;
state shared across the layers of one step is caught and named (``layer-state``), the failing
layer named in the message; a repro written before ``layers`` existed replays as one layer.
The search's own detection of the three multi-layer mutants is in
``tests/quality/test_mutation_matrix.py`` (it runs every mutant of ``harness.mutants.ALL``).
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_fuzz.harness.diagnosis import diagnose
from mla_fuzz.harness.executor import ScenarioRunner, run_steps
from mla_fuzz.harness.mutants import ALL, EXPECTED
from mla_fuzz.harness.render import config_line
from mla_fuzz.harness.repro import check_repro, replay_repro
from mla_fuzz.harness.scenario import ScenarioConfig, scenario_coverage
from mla_fuzz.harness.strategies import LAYERS, LAYERS_LONG, LONG_LAYERS_FROM, configs
from mla_fuzz.harness.world import World
from mla_fuzz.kernels import TritonMLABackend
from mla_fuzz.mla_ref import ModelSpec

TINY = ModelSpec.tiny(num_heads=4)
PATHS = {"attention": {}, "layer": {"layer": True}, "layer+fp8_out": {"layer": True, "fp8_out": True},
         "sparse": {"sparse": True, "topk": 5}, "sparse+indexer": {"sparse": True, "topk": 5, "indexer": True}}


def _cfg(layers: int = 2, **kw) -> ScenarioConfig:
    return ScenarioConfig(spec=TINY.to_dict(), page_size=4, capture_sizes=[1, 2], max_pages_per_seq=8,
                          layers=layers, seed=11, **kw)


def _batch(seed: int, seq_lens, q_lens=None) -> dict:
    q_lens = q_lens or [1 if s else 0 for s in seq_lens]
    return {"seed": seed, "seq_lens": list(seq_lens), "q_lens": list(q_lens), "max_decode_len": 1}


# a short capture on a build its warmup shares, a longer replay with poisoned padding, an eager
# step padded and poisoned: the graph lifecycle, each step running every layer
STEPS = [{"op": "capture", "size": 2, "batch": _batch(3, [5]), "warmups": 1, "share": True},
         {"op": "replay", "size": 2, "batch": _batch(4, [30, 9]), "poison": True},
         {"op": "replay", "size": 2, "batch": _batch(5, [17]), "poison": True},
         {"op": "eager", "batch": _batch(6, [20, 0]), "pad_to": 2, "poison": True}]


@pytest.mark.parametrize("mode", ["eager", "emulated"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_clean_backend_passes_multi_layer_steps(path, mode):
    assert run_steps(TritonMLABackend, _cfg(2, **PATHS[path]), STEPS, mode) is None


def test_clean_backend_passes_three_layers_fp8_e4m3():
    # one k_scale per step, shared by the layers (DecodeBatch carries one)
    steps = [dict(s, batch=dict(s["batch"], k_scale=k)) for s, k in zip(STEPS, (1.0, 0.5, 2.0, 0.3))]
    assert run_steps(TritonMLABackend, _cfg(3, kv_dtype="fp8_e4m3"), steps, "emulated") is None


def test_every_layer_has_its_own_cache_and_queries_layer_0_as_before():
    one, three = World(_cfg(1), "cpu"), World(_cfg(3, layer=True), "cpu")
    # layer 0 is the single-layer world, byte for byte (older repros replay the same)
    assert torch.equal(one.kv_cache.view(torch.uint8), three.kv_cache.view(torch.uint8))
    caches = three.kv_caches
    assert len(caches) == 3 and all(c.untyped_storage().data_ptr() == three.kv_pool.untyped_storage().data_ptr()
                                    for c in caches)
    assert not torch.equal(caches[0], caches[1]) and not torch.equal(caches[1], caches[2])
    q = [three.new_q(2) for _ in range(3)]
    for i, qi in enumerate(q):
        three.fill_q(qi, _batch(7, [3]), 1, False, layer=i)
    q0 = one.new_q(2)
    one.fill_q(q0, _batch(7, [3]), 1, False)
    assert torch.equal(q0, q[0]) and not torch.equal(q[0], q[1])
    w = three.layer_weights
    assert w[0] is three.weights and not torch.equal(w[0].q_b_proj, w[1].q_b_proj)
    # poisoning reaches every layer's unused pages
    three.reset_cache(True, {1, 2})
    for c in caches:
        assert torch.isnan(c[0].float()).all() and not torch.isnan(c[1].float()).any()


def test_shared_output_buffer_is_reported_naming_the_layer():
    cfg = _cfg(2)
    steps = [{"op": "eager", "batch": _batch(6, [20, 9]), "pad_to": None, "poison": False}]
    f = run_steps(ALL["shared-output-buffer"], cfg, steps, "emulated")
    assert f is not None and f.oracle == "reference"
    assert f.message.startswith("layer 1 of 2: eager out vs reference"), f.message
    assert f.evidence["layer"] == 0 and f.evidence["shared_outputs"] == [(0, 1)]
    d = diagnose(ALL["shared-output-buffer"], cfg, steps, f, "emulated")
    assert d.cls == "layer-state" and "layers 1 and 2 share memory" in d.explanation
    # one layer: nothing to see, and the clean backend passes the two-layer step
    assert run_steps(ALL["shared-output-buffer"], _cfg(1), steps, "emulated") is None
    assert run_steps(TritonMLABackend, cfg, steps, "emulated") is None


@pytest.mark.parametrize("name, path", [("pool-rebased-block-table", "layer"),
                                        ("indexer-once-per-step", "sparse+indexer")])
def test_layer_state_mutants_need_several_layers(name, path):
    cls = ALL[name]
    assert run_steps(cls, _cfg(1, **PATHS[path]), STEPS, "emulated") is None
    f = run_steps(cls, _cfg(3, **PATHS[path]), STEPS, "emulated")
    assert f is not None and f.message.startswith("layer "), f
    # each layer alone passes: the diagnosis names the mechanism
    for i in range(3):
        assert run_steps(cls, _cfg(3, **PATHS[path]), STEPS[: f.step + 1], "emulated", layers=(i,)) is None
    assert diagnose(cls, _cfg(3, **PATHS[path]), STEPS[: f.step + 1], f, "emulated").cls in EXPECTED[name]


def test_a_bug_of_one_layer_is_not_called_layer_state():
    # a bug every layer has alone keeps its own class in a multi-layer scenario
    cfg = _cfg(2)
    steps = [{"op": "eager", "batch": _batch(1, [9, 0]), "pad_to": None, "poison": False}]
    f = run_steps(ALL["nan-zero-len"], cfg, steps, "emulated")
    assert f is not None and f.message.startswith("layer 1 of 2: ")
    assert diagnose(ALL["nan-zero-len"], cfg, steps, f, "emulated").cls == "padding-leak"


def test_one_layer_runs_alone():
    runner = ScenarioRunner(TritonMLABackend, _cfg(3, layer=True), "emulated", layers=(2,))
    try:
        runner.apply(STEPS[-1])
        assert runner.active == (2,) and list(runner.stack) == [2]
    finally:
        runner.close()
    with pytest.raises(ValueError, match="layers must be indices"):
        ScenarioRunner(TritonMLABackend, _cfg(2), "emulated", layers=(2,))


def test_config_layers_validated_recorded_and_shown():
    for bad in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="config.layers"):
            _cfg(bad).validate()
    d = _cfg(3).to_dict()
    assert d["layers"] == 3 and ScenarioConfig.from_dict(d).layers == 3
    assert ("layers", "3") in scenario_coverage(_cfg(3))
    assert "3 layers per step" in config_line(d) and "layers" not in config_line(_cfg(1).to_dict())


def _old_repro() -> dict:
    """A repro as written before ``layers`` existed (no such config key)."""
    cfg = _cfg(1, layer=True).to_dict()
    del cfg["layers"]
    return {"format": "mla-fuzz-repro/1", "backend": "mutant:padded-slot-write", "graph_mode": "emulated",
            "config": cfg, "steps": [{"op": "eager", "batch": _batch(2, [7]), "pad_to": 2, "poison": False}],
            "failure": {"oracle": "integrity", "step": 0, "message": "recorded", "key": "integrity"},
            "diagnosis": {"cls": "cache-corruption", "explanation": "recorded"}, "search": {}, "versions": {}}


def test_old_repro_without_layers_replays_as_one_layer(tmp_path, capsys):
    data = _old_repro()
    check_repro(data)
    assert ScenarioConfig.from_dict(data["config"]).layers == 1
    again = replay_repro(data)
    assert again.failed and again.diagnosis.cls == "cache-corruption"
    assert not replay_repro(data, backend="triton", diagnose_failure=False).failed
    from mla_fuzz.harness import cli
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    code = cli.main(["replay", str(path)])
    out = capsys.readouterr().out
    assert code == 1 and "STILL FAILS at step 0: [integrity]" in out, out


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_layers_are_drawn_last_and_fewer_for_long_scenarios(data):
    cfg = data.draw(configs(TINY, max_seq_len=16384, vary_heads=False))
    assert cfg.layers in (LAYERS_LONG if cfg.max_seq_len >= LONG_LAYERS_FROM else LAYERS)
    cfg.validate()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["attention", "layer", "sparse+indexer"])
def test_gpu_deepseek_v3_long_multi_layer_steps_pass(cuda_device, path):
    # DeepSeek-V3 size under real CUDA graphs: two layers, 8k-token rows in a shared pool
    from mla_fuzz.harness.strategies import pool_for
    kw = dict(PATHS[path])
    if "topk" in kw:
        kw["topk"] = 2048
    cfg = ScenarioConfig(spec=ModelSpec.deepseek_v3().to_dict(), page_size=64, capture_sizes=[1, 4],
                         max_pages_per_seq=128, pool_pages=pool_for(4, 8192, 64), layers=2, seed=3, **kw)
    steps = [{"op": "capture", "size": 4, "batch": _batch(3, [64]), "warmups": 1, "share": True},
             {"op": "replay", "size": 4, "batch": _batch(4, [8192, 5000, 1]), "poison": True},
             {"op": "eager", "batch": _batch(5, [8000, 64]), "pad_to": 4, "poison": True}]
    assert run_steps(TritonMLABackend, cfg, steps, "cuda", "cuda") is None

"""The layer path's weights: drawn from ``ScenarioConfig.weights_seed`` (a few sets, each drawn
once per process) or, for older repro files, from the scenario seed; every scenario gets its
own copy."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_fuzz.harness.scenario import ScenarioConfig
from mla_fuzz.harness.strategies import WEIGHT_SEEDS, configs
from mla_fuzz.harness.world import World
from mla_fuzz.mla_ref import MLALayerWeights, ModelSpec

TINY = ModelSpec.tiny(num_heads=4)


def _cfg(**kw) -> ScenarioConfig:
    return ScenarioConfig(**{"spec": TINY.to_dict(), "page_size": 4, "capture_sizes": [1, 2], "max_pages_per_seq": 8,
                             "layer": True, "seed": 11, **kw})


def _same(a: MLALayerWeights, b: MLALayerWeights) -> bool:
    return all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))


def test_an_older_repro_without_weights_seed_gets_the_weights_of_its_seed():
    w = World(_cfg(), "cpu").weights
    assert _same(w, MLALayerWeights.random(TINY, 11, dtype=torch.bfloat16))
    assert not _same(w, MLALayerWeights.random(TINY, 1, dtype=torch.bfloat16))


def test_weights_come_from_weights_seed_and_each_scenario_owns_its_copy():
    a, b = World(_cfg(weights_seed=1), "cpu"), World(_cfg(weights_seed=1, seed=12), "cpu")
    drawn = MLALayerWeights.random(TINY, 1, dtype=torch.bfloat16)
    assert _same(a.weights, drawn) and _same(b.weights, drawn)
    # a backend writing into its weights changes no other scenario's, before or after it
    a.weights.q_a_proj.fill_(float("nan"))
    assert _same(b.weights, drawn)
    assert _same(World(_cfg(weights_seed=1), "cpu").weights, drawn)


def test_scenarios_of_several_layers_rotate_their_own_copy():
    w = World(_cfg(weights_seed=0, layers=2), "cpu")
    assert _same(w.layer_weights[0], MLALayerWeights.random(TINY, 0, dtype=torch.bfloat16))
    assert not torch.equal(w.layer_weights[0].o_proj, w.layer_weights[1].o_proj)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_drawn_configs_name_one_of_the_weight_sets(data):
    cfg = data.draw(configs(TINY, max_seq_len=64, sparse_ok=True))
    assert cfg.weights_seed == cfg.seed % WEIGHT_SEEDS
    assert ScenarioConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.gpu
def test_gpu_weights_are_the_bytes_drawn_on_the_device(cuda_device):
    """The set kept in host memory and copied to the GPU is what ``MLALayerWeights.random``
    draws for the GPU itself (same seed, same bytes)."""
    w = World(_cfg(weights_seed=1), cuda_device).weights
    drawn = MLALayerWeights.random(TINY, 1, dtype=torch.bfloat16, device=cuda_device)
    assert all(t.device.type == "cuda" for t in vars(w).values())
    assert _same(w, drawn)

"""Long sequences in a shared KV pool: what the search draws, what the world allocates, and
what the coverage says about it (issue: reach where engine bugs live)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_fuzz.examples.reference_backend import ReferenceBackend
from mla_fuzz.harness.campaign import merge_coverage
from mla_fuzz.harness.fuzz import default_max_seq_len, fuzz
from mla_fuzz.harness.render import coverage_parts
from mla_fuzz.harness.scenario import ScenarioConfig, validate_step
from mla_fuzz.harness.strategies import batch_draws, configs, pool_for, short_bound, token_budget
from mla_fuzz.harness.world import World
from mla_fuzz.mla_ref import ModelSpec

TINY = ModelSpec.tiny(num_heads=4)
SPLIT_FROM = 1024  # the fake planner below splits a request from this many keys on


def test_the_pool_is_shared_by_the_rows_not_sized_for_every_row_at_full_length():
    cfg = ScenarioConfig(spec=TINY.to_dict(), page_size=64, capture_sizes=[1, 8], max_pages_per_seq=256,
                         pool_pages=pool_for(8, 16384, 64))
    world = World(cfg, "cpu")
    tokens = world.kv_cache.shape[0] * world.kv_cache.shape[1]
    # two rows at full length plus per-row slack, not 8 rows of 16k tokens
    assert 2 * 16384 <= tokens <= 2 * 16384 + (2 * 8 + 4) * 64
    legacy = ScenarioConfig(spec=TINY.to_dict(), page_size=64, capture_sizes=[1, 8], max_pages_per_seq=256)
    assert legacy.num_blocks == 1 + 8 * 256 + 3  # older repro files keep their pool (and their pages)
    # one long row and short ones fit together; a batch over the pool is refused with its numbers
    validate_step({"op": "capture", "size": 8, "batch": {"seed": 0, "seq_lens": [16384, 16384, 512, 7],
                                                          "q_lens": [1, 1, 1, 1]}}, cfg)
    with pytest.raises(ValueError, match=r"needs \d+ pages of 64 tokens but the KV pool has \d+"):
        validate_step({"op": "capture", "size": 8, "batch": {"seed": 0, "seq_lens": [16384] * 3,
                                                              "q_lens": [1] * 3}}, cfg)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_drawn_batch_fits_the_pool_on_distinct_pages(data):
    cfg = data.draw(configs(TINY, max_seq_len=4096, vary_heads=False))
    rows = data.draw(st.sampled_from(cfg.capture_sizes))
    short = data.draw(st.booleans())
    draw = data.draw(batch_draws(cfg, rows, top=short_bound(cfg) if short else None))
    assert max(draw["seq_lens"]) <= (short_bound(cfg) if short else cfg.max_seq_len)
    assert sum(draw["seq_lens"]) <= token_budget(cfg) + rows * cfg.next_n
    validate_step({"op": "capture", "size": rows, "batch": draw}, cfg)
    world = World(cfg, "cpu")
    batch = world.make_batch(draw, rows)
    owned = []
    for b, L in enumerate(draw["seq_lens"]):
        owned += batch.block_table[b, :-(-L // cfg.page_size)].tolist()
    assert len(owned) == len(set(owned)), "two requests share a page"
    assert 0 not in owned, "a real request was given the null block"
    assert all(1 <= p < world.num_blocks for p in owned)


def test_scenario_lengths_reach_the_campaign_bound_and_defaults_follow_the_device():
    seen = set()

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(cfg=configs(ModelSpec.deepseek_v3(), max_seq_len=32768, vary_heads=False, page_sizes=(64,)))
    def collect(cfg):
        seen.add(cfg.max_seq_len)
        assert cfg.num_blocks * cfg.page_size <= max(2 * cfg.max_seq_len, cfg.max_batch * 512) + (
            2 * cfg.max_batch + 4) * cfg.page_size

    collect()
    assert max(seen) == 32768 and min(seen) <= 64
    assert default_max_seq_len("deepseek-v3", "cuda") >= 16384
    assert default_max_seq_len("tiny", "cpu") <= 512 and default_max_seq_len("deepseek-v3", torch.device("cpu")) <= 256


def test_longest_is_kept_as_a_maximum_when_coverage_merges():
    into = {"longest": {"300": 1}, "op": {"replay": 2}}
    merge_coverage(into, {"longest": {"4096": 1}, "op": {"replay": 1}})
    merge_coverage(into, {"longest": {"17": 1}})
    assert into == {"longest": {"4096": 1}, "op": {"replay": 3}}
    assert dict(coverage_parts(into))["longest"] == "4096 tokens"


class SplittingReference(ReferenceBackend):
    """The reference backend with a planner's answer: a request of ``SPLIT_FROM`` keys or more
    is cut into ``ceil(seq_len / SPLIT_FROM)`` pieces."""

    def build(self, batch):
        self._real = batch.seq_lens.tolist()
        return super().build(batch)

    def kv_splits(self, metadata):
        return [-(-s // SPLIT_FROM) for s in self._real]


def test_search_draws_long_rows_replays_longer_than_captured_and_counts_splits():
    steps_seen: list = []  # one list of steps per scenario

    def on_step(cfg, steps, shrinking=False):
        if not steps:
            steps_seen.append([])
            return
        steps_seen[-1][:] = list(steps)

    report = fuzz(f"{__name__}:SplittingReference", spec="tiny", graph_mode="emulated", examples=24, seed=3,
                  max_seq_len=4096, on_step=on_step, shrink=False)
    assert not report.failed, report.repro
    cov = report.coverage
    longest = int(next(iter(cov["longest"])))
    all_lens = [s for sc in steps_seen for st_ in sc for s in st_["batch"]["seq_lens"]]
    assert longest == max(all_lens) and longest > 2048
    # a replay of rows longer than any its graph's capture saw
    grew = False
    for sc in steps_seen:
        captured: dict = {}
        for st_ in sc:
            top = max(st_["batch"]["seq_lens"])
            if st_["op"] == "capture":
                captured[st_["size"]] = top
            elif st_["op"] == "replay" and top > captured.get(st_["size"], top):
                grew = True
    assert grew
    # the split counts add up to what the steps held: every real row of every eager/replay step
    checked = [st_ for sc in steps_seen for st_ in sc if st_["op"] in ("eager", "replay")]
    rows = sum(len(st_["batch"]["seq_lens"]) for st_ in checked)
    split = sum(1 for st_ in checked for s in st_["batch"]["seq_lens"] if s > SPLIT_FROM)
    assert cov["split"]["rows"] == rows and cov["split"]["rows split"] == split > 0
    assert 0 < cov["split"]["scenarios split tiny"] <= cov["spec"]["tiny"] == report.examples
    assert "scenarios tiny" in dict(coverage_parts(cov))["split"]


class BadSplitsReference(ReferenceBackend):
    """``kv_splits`` answering something that is not one int per row."""

    def kv_splits(self, metadata):
        return "many"


def test_a_kv_splits_that_answers_garbage_is_a_contract_finding_naming_its_line():
    report = fuzz(f"{__name__}:BadSplitsReference", spec="tiny", graph_mode="emulated", examples=5, seed=0,
                  shrink=False)
    failure = report.repro["failure"]
    assert failure["oracle"] == "contract" and report.repro["diagnosis"]["cls"] == "contract"
    assert "BadSplitsReference.kv_splits(metadata) (at tests/harness/test_long_sequences.py:" in failure["message"]
    assert "got str" in failure["message"]

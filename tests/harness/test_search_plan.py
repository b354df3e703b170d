"""The search's plan: the opening book first, then blocks rotating through the data paths,
so every path the backend takes gets its share whatever runs Hypothesis draws in; and the
opening book's programs are valid scenarios whose simplest draw is the hard shape."""
from collections import Counter

from hypothesis import find, given, settings, strategies as st

from mla_fuzz.harness.book import BOOK, BOOK_EXAMPLES
from mla_fuzz.harness.fuzz import fuzz
from mla_fuzz.harness.machine import PATH_BLOCK, plan_blocks
from mla_fuzz.harness.oracles import compare_close, take_closeness
from mla_fuzz.harness.scenario import validate_step
from mla_fuzz.harness.strategies import PATHS, batch_draws, configs, paths_allowed, scenario_lengths, token_budget
from mla_fuzz.mla_ref import ModelSpec

import torch

TINY = ModelSpec.tiny()


def test_plan_spends_exactly_the_examples_book_first():
    for n in (1, 3, 8, 9, 100, 437):
        plan = plan_blocks(PATHS, seed=5, max_examples=n)
        assert sum(b[2] for b in plan) == n
        book = [b for b in plan if b[0] is not None]
        assert plan[:len(book)] == book  # the openings come before any random block
        assert [b[0].name for b in book] == [o.name for o in BOOK][:len(book)]
        assert all(b[2] <= BOOK_EXAMPLES for b in book)


def test_every_path_gets_its_share():
    for seed in range(6):
        for paths in (PATHS, paths_allowed(True, False), paths_allowed(False, True), ("attention",)):
            share = Counter()
            for _opening, path, examples, _ in plan_blocks(paths, seed, 1000):
                share[path] += examples
            assert set(share) == set(paths)
            fair = 1000 / len(paths)
            # blocks are at most 4 * PATH_BLOCK: no path is more than one block from its share
            assert all(abs(v - fair) <= 4 * PATH_BLOCK for v in share.values()), (seed, share)


def test_the_seed_changes_the_pairing_and_fixes_it():
    first = [(o.name if o else None, p) for o, p, _, _ in plan_blocks(PATHS, 0, 60)]
    assert first == [(o.name if o else None, p) for o, p, _, _ in plan_blocks(PATHS, 0, 60)]
    seeds = {tuple(p for _, p, _, _ in plan_blocks(PATHS, s, 8)) for s in range(4)}
    assert len(seeds) == 4  # each seed opens on another path
    block_seeds = [b[3] for b in plan_blocks(PATHS, 0, 200)]
    assert len(set(block_seeds)) == len(block_seeds)


def test_the_simplest_book_config_is_the_hard_shape():
    cfg = find(configs(TINY, max_seq_len=512, sparse_ok=True, book=True), lambda c: True)
    assert cfg.max_seq_len >= max(scenario_lengths(512))
    assert len(cfg.capture_sizes) >= 2
    assert cfg.next_n == 4
    plain = find(configs(TINY, max_seq_len=512, sparse_ok=True), lambda c: True)
    assert plain.max_seq_len < cfg.max_seq_len and plain.next_n == 1


def test_long_batches_shrink_to_the_longest_rows():
    cfg = find(configs(TINY, max_seq_len=512, book=True), lambda c: True)
    b = find(batch_draws(cfg, 3, min_rows=3, long=True), lambda b: True)
    assert len(b["seq_lens"]) == 3
    share = min(cfg.max_seq_len, token_budget(cfg) // 3)
    assert b["seq_lens"] == [share] * 3  # every row real, each an equal share of the pool
    assert share > cfg.max_seq_len // 4


@settings(max_examples=40, deadline=None)
@given(data=st.data(), path=st.sampled_from(PATHS))
def test_book_programs_are_valid_scenarios(data, path):
    cfg = data.draw(configs(TINY, max_seq_len=512, sparse_ok=True, book=True, path=path))
    opening = data.draw(st.sampled_from(BOOK))

    def batches(rows, short=False, long=False, mdl=None):
        from mla_fuzz.harness.strategies import short_bound
        return batch_draws(cfg, rows, min_rows=rows, top=short_bound(cfg) if short else None, long=long,
                           max_decode_len=None if mdl is None else min(mdl, cfg.next_n))

    steps = opening.program(data.draw, cfg, batches)
    assert steps[0]["op"] == "capture" and any(s["op"] == "replay" for s in steps)
    captured = set()
    for step in steps:
        validate_step(step, cfg)
        if step["op"] == "capture":
            captured.add(step["size"])
        if step["op"] == "replay":
            assert step["size"] in captured
    assert cfg.path.split("+")[0] == path.split("+")[0]
    if opening.name == "eager-between":
        # "a padded, poisoned eager forward": rows fewer than the graph size it is padded to
        [eager] = [s for s in steps if s["op"] == "eager"]
        assert eager["poison"] and len(eager["batch"]["seq_lens"]) < eager["pad_to"], eager


def test_closeness_notes_how_near_a_passing_comparison_came():
    take_closeness()
    e = torch.ones(4, 8)
    assert compare_close(e + 0.05, e, 0.1, 0.0) is None
    assert abs(take_closeness() - 0.5) < 1e-6
    assert take_closeness() == 0.0  # taken, so reset
    assert compare_close(e + 0.5, e, 0.1, 0.0) is not None


def test_a_short_campaign_draws_every_path():
    # 24 examples: the four openings (two examples each) and a block per path
    report = fuzz("triton", graph_mode="emulated", examples=24, seed=3, shrink=False)
    assert not report.failed, report.repro and report.repro["failure"]
    paths = Counter()
    for value, n in report.coverage["path"].items():
        paths[value.split("+indexer")[0]] += n
    assert set(paths) == set(PATHS) and min(paths.values()) >= 2, paths
    assert sum(paths.values()) == report.examples


def test_nothing_of_a_campaign_outlives_it():
    """A worker runs fuzz call after fuzz call: the scenarios of a finished call (their KV
    pools, weights and graphs: GBs at DeepSeek-V3 size) must be garbage once it returns, a
    found failure's included."""
    import gc

    from mla_fuzz.harness.executor import ScenarioRunner
    from mla_fuzz.harness.machine import Campaign
    from mla_fuzz.harness.world import World

    def alive() -> tuple:
        gc.collect()
        objs = gc.get_objects()
        return tuple(sum(isinstance(o, t) for o in objs) for t in (Campaign, ScenarioRunner, World))

    before = alive()
    found = fuzz("mutant:example-seq-lens-fresh", graph_mode="emulated", examples=6, seed=0, shrink_seconds=5)
    assert found.failed
    fuzz("triton", graph_mode="emulated", examples=3, seed=1, shrink=False)
    assert alive() == before


def test_a_finished_scenario_is_freed_without_a_garbage_collection():
    """Hypothesis keeps each finished example's state machine (and its failures' tracebacks)
    in reference cycles, which only a full collection frees, and Python collects by object
    counts, not by memory: a scenario's tensors (a 375 MB weight copy at DeepSeek-V3 size)
    must go when its example ends, or a long shrink fills the GPU."""
    import gc

    from mla_fuzz.harness.world import World

    gc.collect()
    gc.disable()
    try:
        found = fuzz("mutant:example-seq-lens-fresh", graph_mode="emulated", examples=6, seed=0, shrink_seconds=5)
        clean = fuzz("triton", graph_mode="emulated", examples=4, seed=1, shrink=False)
        worlds = sum(isinstance(o, World) for o in gc.get_objects())
    finally:
        gc.enable()
    assert found.failed and not clean.failed and clean.examples == 4
    assert worlds == 0

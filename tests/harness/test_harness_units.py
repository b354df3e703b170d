"""Unit tests of the fuzzer's building blocks that need no backend: oracles, audit,
scenario validation, the simulated engine, repro files."""
import json
from dataclasses import dataclass

import pytest
import torch

from mla_fuzz.harness.audit import OpAudit, OpLog, tensor_fields
from mla_fuzz.harness.oracles import compare_bitwise, compare_close, nonfinite_rows
from mla_fuzz.harness.repro import ReproError, load_repro, write_repro
from mla_fuzz.harness.scenario import ScenarioConfig, validate_step
from mla_fuzz.harness.world import POISON_BYTE, World, token_positions
from mla_fuzz.mla_ref import ModelSpec


def test_compare_close_reports_count_worst_index_and_rows():
    e = torch.zeros(3, 2, 4)
    a = e.clone()
    a[1, 0, 2] = 0.5
    a[2, 1, 3] = 0.1
    m = compare_close(a, e, atol=0.05, rtol=0.0)
    assert m.count == 2 and m.total == 24
    assert m.max_abs == pytest.approx(0.5) and m.max_abs_at == (1, 0, 2)
    assert m.rows == [1, 2]
    text = m.describe("out", 0.05, 0.0)
    assert "2 / 24" in text and "(1, 0, 2)" in text and "[1, 2]" in text


def test_compare_close_nan_is_never_close_but_equal_infinities_are():
    e = torch.tensor([[float("-inf"), 1.0]])
    assert compare_close(e.clone(), e, 0.0, 0.0) is None
    a = torch.tensor([[float("-inf"), float("nan")]])
    m = compare_close(a, e, 1.0, 1.0)
    assert m is not None and m.count == 1 and m.rows == [0]


def test_compare_bitwise_sees_one_ulp_and_signed_zero():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert compare_bitwise(x, x.clone()) is None
    y = x.clone()
    y.view(torch.int16)[2, 5] += 1
    m = compare_bitwise(y, x)
    assert m is not None and m.count == 1 and m.rows == [2]
    z = torch.zeros(2, 2)
    nz = z.clone()
    nz[1, 1] = -0.0
    assert compare_bitwise(nz, z).rows == [1]


def test_nonfinite_rows():
    x = torch.zeros(4, 3)
    x[2, 1] = float("inf")
    x[3, 0] = float("nan")
    assert nonfinite_rows(x) == [2, 3]


def test_tensor_fields_walks_dataclasses_dicts_lists():
    @dataclass
    class Inner:
        plan: torch.Tensor | None

    @dataclass
    class Meta:
        seq: torch.Tensor
        sched: Inner
        extra: dict

    t1, t2, t3 = torch.zeros(2), torch.ones(3), torch.arange(4)
    found = tensor_fields(Meta(t1, Inner(t2), {"bufs": [t3, None]}))
    assert set(found) == {"seq", "sched.plan", "extra.bufs.0"}
    assert found["sched.plan"] is t2


def test_op_audit_logs_custom_ops_with_contiguity():
    lib = torch.library.Library("mla_fuzz_unit", "FRAGMENT")  # noqa: F841 - keeps namespace alive

    @torch.library.custom_op("mla_fuzz_unit::flat_sum", mutates_args=("out",))
    def flat_sum(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x.reshape(-1).sum())

    buf = torch.arange(12.0).reshape(3, 4)
    view = buf[:, :2]
    out = torch.zeros(())
    log = OpLog()
    with OpAudit(log):
        flat_sum(view, out)
        torch.mm(buf, buf.t())
    assert "mla_fuzz_unit::flat_sum" in log.custom_ops
    assert any(op.startswith("aten::mm") for op in log.ops)
    assert len(log.noncontiguous()) == 1 and "flat_sum" in log.noncontiguous()[0]
    assert view.data_ptr() in log.read_ptrs()


def test_op_audit_flags_as_strided_of_a_noncontiguous_view():
    """``as_strided`` addresses its input's storage with strides of its own: on a
    non-contiguous view that is a flat read, the hazard of oracle 5; on a contiguous one, or
    for ordinary view ops and copies of a non-contiguous view, nothing is flagged."""
    buf = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    view = buf[:, :2]
    log = OpLog()
    with OpAudit(log):
        flat = view.as_strided((8,), (1,))
        buf[:2].as_strided((6,), (1,))
        view.t().contiguous().sum()
        view[1:, :1].clone()
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # the storage, not the view's elements
    assert len(log.noncontiguous()) == 1, log.noncontiguous()
    assert "as_strided" in log.noncontiguous()[0] and "[4, 2]" in log.noncontiguous()[0]
    assert not log.kernels, "a builtin flat read is not a custom-op call"


def test_noncontig_context_lens_on_the_sparse_path_is_a_contiguity_failure():
    """The mutant's non-contiguous ``[pad, width]`` context-lens view reaches the sparse path
    through ``as_strided`` (no kernel argument is non-contiguous there), which the audit now
    names: the step fails the contiguity oracle, not the reference comparison (found as
    ``numerical`` on an H100 before, benchmarks/results/h100-2026-11-26-gpu-validate-2.json)."""
    from mla_fuzz.harness.executor import run_steps
    from mla_fuzz.harness.mutants import ALL

    cfg = _cfg(sparse=True, topk=16, capture_sizes=[1, 2, 8], next_n=2, max_pages_per_seq=8)
    batch = {"seed": 3, "seq_lens": [20, 31, 11, 0], "q_lens": [1, 1, 1, 0], "max_decode_len": 1}
    steps = [{"op": "eager", "batch": batch, "pad_to": 8, "poison": False}]
    failure = run_steps(ALL["noncontig-context-lens"], cfg, steps, graph_mode="emulated")
    assert failure is not None and failure.oracle == "contiguity", failure
    assert "as_strided" in failure.message
    assert run_steps(ALL["noncontig-context-lens"].__mro__[1], cfg, steps, graph_mode="emulated") is None


def _cfg(**kw):
    base = dict(spec=ModelSpec.tiny(4).to_dict(), page_size=4, max_pages_per_seq=4, capture_sizes=[2, 4],
                next_n=2, seed=5)
    base.update(kw)
    return ScenarioConfig(**base)


def test_config_validation_messages():
    with pytest.raises(ValueError, match="kv_dtype"):
        _cfg(kv_dtype="int4").validate()
    with pytest.raises(ValueError, match="fp8_out needs config.layer"):
        _cfg(fp8_out=True).validate()
    with pytest.raises(ValueError, match="unknown fields"):
        ScenarioConfig.from_dict({**_cfg().to_dict(), "bogus": 1})


def test_step_validation():
    cfg = _cfg()
    ok = {"op": "replay", "size": 2, "batch": {"seed": 1, "seq_lens": [3], "q_lens": [1]}}
    validate_step(ok, cfg)
    with pytest.raises(ValueError, match="capture size"):
        validate_step({**ok, "size": 3}, cfg)
    with pytest.raises(ValueError, match="exceeds size"):
        validate_step({**ok, "batch": {"seed": 1, "seq_lens": [3, 3, 3], "q_lens": [1, 1, 1]}}, cfg)
    with pytest.raises(ValueError, match="max_seq_len"):
        validate_step({**ok, "batch": {"seed": 1, "seq_lens": [99], "q_lens": [1]}}, cfg)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_world_is_seeded_and_poisons_only_unused_pages(kv_dtype):
    cfg = _cfg(kv_dtype=kv_dtype)
    w1, w2 = World(cfg, "cpu"), World(cfg, "cpu")
    assert torch.equal(w1.kv_cache.view(torch.uint8), w2.kv_cache.view(torch.uint8))
    draw = {"seed": 9, "seq_lens": [5, 0, 16], "q_lens": [2, 0, 1], "max_decode_len": 2}
    b1, b2 = w1.make_batch(draw, 4), w2.make_batch(draw, 4)
    assert torch.equal(b1.block_table, b2.block_table) and torch.equal(b1.slot_mapping, b2.slot_mapping)
    used = w1.used_pages(b1)
    assert 0 not in used and len(used) == 2 + 4
    w1.reset_cache(True, used)
    raw = w1.kv_cache.view(torch.uint8)
    clean = w1.clean.view(torch.uint8)
    for p in range(w1.num_blocks):
        if p in used:
            assert torch.equal(raw[p], clean[p])
        else:
            assert bool((raw[p] == POISON_BYTE).all())
    # the new tokens' slots are the last q_len positions of each row, on that row's pages
    ps = cfg.page_size
    for b, (s, q) in enumerate(zip(draw["seq_lens"], draw["q_lens"])):
        for i in range(cfg.next_n):
            slot = int(b1.slot_mapping[b, i])
            if i >= q:
                assert slot == -1
            else:
                pos = s - q + i
                assert slot == int(b1.block_table[b, pos // ps]) * ps + pos % ps


def test_token_positions():
    cfg = _cfg()
    w = World(cfg, "cpu")
    b = w.make_batch({"seed": 1, "seq_lens": [5, 1], "q_lens": [2, 1], "max_decode_len": 2}, None)
    assert token_positions(b).tolist() == [[3, 4], [0, 0]]


def test_repro_files_are_validated(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ReproError, match="not valid JSON"):
        load_repro(bad)
    with pytest.raises(ReproError, match="no such file"):
        load_repro(tmp_path / "missing.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ReproError, match="not an mla-fuzz repro"):
        load_repro(other)



def test_replay_of_a_hand_built_repro_is_validated():
    """``replay_repro`` on a dict that did not come through ``load_repro`` (edited in a
    script) gets the same checks: a seq_len past the config's pages is a ReproError naming
    the limit, not an IndexError from inside the step."""
    from mla_fuzz.harness.repro import replay_repro
    cfg = _cfg()
    repro = {"format": "mla-fuzz-repro/1", "backend": "triton", "graph_mode": "emulated", "config": cfg.to_dict(),
             "steps": [{"op": "eager", "batch": {"seed": 1, "seq_lens": [cfg.max_seq_len + 1], "q_lens": [1],
                                                  "max_decode_len": 1}, "pad_to": None, "poison": False}]}
    with pytest.raises(ReproError, match=f"exceeds max_seq_len {cfg.max_seq_len}"):
        replay_repro(repro)
    with pytest.raises(ReproError, match="missing field 'steps'"):
        replay_repro({k: v for k, v in repro.items() if k != "steps"})

def test_repro_write_is_atomic_and_roundtrips(tmp_path):
    cfg = _cfg()
    repro = {"format": "mla-fuzz-repro/1", "backend": "triton", "graph_mode": "emulated", "config": cfg.to_dict(),
             "steps": [{"op": "eager", "batch": {"seed": 1, "seq_lens": [3], "q_lens": [1], "max_decode_len": 1},
                        "pad_to": None, "poison": False}],
             "failure": {"oracle": "reference", "step": 0, "message": "m"}, "diagnosis": {"cls": "numerical"}}
    path = write_repro(repro, tmp_path)
    assert load_repro(path)["steps"] == repro["steps"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


class _Placed(Exception):
    def __init__(self, device):
        super().__init__(str(device))
        self.device = device


def test_a_scenario_without_a_device_is_placed_where_fuzz_places_it(monkeypatch):
    """The worker's warmup and replay tasks build their runner without a device: under
    ``--graph eager`` on a GPU their tensors must go to the GPU as ``fuzz()``'s do (they went
    to the CPU, and every warmup scenario failed with 'the Triton kernels need CUDA tensors')."""
    from mla_fuzz.harness import executor, graphs
    from mla_fuzz.harness.loading import load_backend

    def world(cfg, device):
        raise _Placed(device)

    monkeypatch.setattr(executor, "World", world)
    cfg = ScenarioConfig(spec=ModelSpec.tiny(num_heads=1).to_dict(), kv_dtype="bf16", q_dtype="bf16",
                         page_size=4, next_n=1, capture_sizes=[1], max_pages_per_seq=2)
    for gpu, mode, want in [(True, "eager", "cuda"), (False, "eager", "cpu"), (True, "emulated", "cpu")]:
        monkeypatch.setattr(graphs, "cuda_available", lambda gpu=gpu: gpu)
        assert graphs.default_device(mode) == want
        with pytest.raises(_Placed) as placed:
            executor.ScenarioRunner(load_backend("triton"), cfg, mode)
        assert placed.value.device == torch.device(want), (gpu, mode)

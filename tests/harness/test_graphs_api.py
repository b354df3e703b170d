"""The runner API: make_runner, modes, options, outputs, eager baseline, closing; and the
cuda runner's GPU-only guarantees (sync-debug restore, private pools, memory release)."""
import pytest
import torch

from mla_fuzz.harness.graphs import (MODES, CaptureError, ReplayError, cuda_available, make_runner)


def test_unknown_mode_lists_the_choices():
    with pytest.raises(ValueError) as ei:
        make_runner("graphs")
    for m in ("eager", "cuda", "emulated", "auto"):
        assert repr(m) in str(ei.value)
    assert "'graphs'" in str(ei.value)
    assert set(MODES) == {"eager", "cuda", "emulated", "auto"}


@pytest.mark.skipif(cuda_available(), reason="checks the no-CUDA message")
def test_cuda_mode_without_cuda_is_a_clear_value_error():
    with pytest.raises(ValueError, match="needs a CUDA device.*emulated"):
        make_runner("cuda")


def test_auto_resolves_to_an_available_mode():
    r = make_runner("auto")
    assert r.mode == ("cuda" if cuda_available() else "emulated")
    assert make_runner("auto", device="cpu").mode == "emulated"
    assert make_runner("auto", poison_empty=True).poison_empty  # options of either mode pass


def test_bad_device_and_options_raise_value_error():
    with pytest.raises(ValueError, match="device"):
        make_runner("emulated", device=3)
    with pytest.raises(ValueError, match="device"):
        make_runner("emulated", device="not-a-device")
    with pytest.raises(ValueError, match="record_ops"):
        make_runner("emulated", record_ops=False)
    with pytest.raises(ValueError, match="no options"):
        make_runner("eager", poison_empty=True)


def test_capture_error_is_a_runtime_error_subclass_not_a_bare_one():
    x = torch.ones(2)
    with pytest.raises(CaptureError) as ei:
        make_runner("emulated").capture(lambda: x * x.sum().item())
    assert type(ei.value) is CaptureError and isinstance(ei.value, RuntimeError)


@pytest.mark.parametrize("mode", ["eager", "emulated"])
def test_output_structures(mode):
    x = torch.ones(2)
    r = make_runner(mode)
    assert isinstance(r.capture(lambda: x + 1).outputs, torch.Tensor)
    g = r.capture(lambda: [x + 1, x + 2])
    assert isinstance(g.outputs, list) and len(g.replay()) == 2
    g = r.capture(lambda: (x + 1,))
    assert isinstance(g.outputs, tuple)
    assert r.capture(lambda: None).outputs is None
    with pytest.raises(ValueError, match="tuple/list of tensors"):
        r.capture(lambda: 3)
    with pytest.raises(ValueError, match="int"):
        r.capture(lambda: (x, 3))


def test_eager_replay_reruns_python():
    calls = []

    class B:
        pass

    b = B()
    b.t = torch.tensor([1.0])

    def fn():
        calls.append(1)
        return b.t * 2

    r = make_runner("eager")
    assert r.mode == "eager"
    g = r.capture(fn)
    assert len(calls) == 1 and g.ops is None
    b.t = torch.tensor([5.0])          # rebinding IS seen without a graph
    assert g.replay().tolist() == [10.0]
    assert len(calls) == 2 and g.outputs.tolist() == [10.0]


@pytest.mark.parametrize("mode", ["eager", "emulated"])
def test_replay_after_close_raises_and_close_is_idempotent(mode):
    x = torch.ones(2)
    with make_runner(mode).capture(lambda: x * 2) as g:
        g.replay()
    assert g.closed and g.outputs is None
    g.reset()
    with pytest.raises(ReplayError, match="closed"):
        g.replay()


def test_warmup_calls_fn_n_times():
    calls = []
    r = make_runner("emulated")
    out = r.warmup(lambda: calls.append(1) or torch.ones(1), 3)
    assert len(calls) == 3 and out.tolist() == [1.0]
    with pytest.raises(ValueError, match="n:"):
        r.warmup(lambda: None, -1)


# --- cuda runner (GPU) -------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_capture_restores_sync_debug_mode_and_uses_private_pools():
    r = make_runner("cuda")
    x = torch.ones(4, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    g1 = r.capture(lambda: x * 2)
    assert torch.cuda.get_sync_debug_mode() == before
    with pytest.raises(CaptureError):
        r.capture(lambda: x * x.sum().item())
    assert torch.cuda.get_sync_debug_mode() == before
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    g2 = r.capture(lambda: x * 3)
    assert g1._graph.pool() != g2._graph.pool()
    assert g1.ops == ["aten::mul"] and g2.ops == ["aten::mul"]
    assert g1.replay().tolist() == [2.0] * 4 and g2.replay().tolist() == [3.0] * 4
    g1.close()
    g2.close()


@pytest.mark.gpu
def test_cuda_many_captures_release_memory():
    r = make_runner("cuda")
    x = torch.ones(1 << 16, device="cuda")
    r.warmup(lambda: (x * 2).sum(), 1)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    base_reserved = torch.cuda.memory_reserved()
    for i in range(100):
        g = r.capture(lambda: ((x * 2) + i).sum())
        assert g.replay().item() == (2 + i) * (1 << 16)
        g.close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Each graph held ~0.5 MiB of intermediates: 100 leaked graphs would show as ~50 MiB.
    assert torch.cuda.memory_allocated() <= base + (1 << 20)
    assert torch.cuda.memory_reserved() <= base_reserved + (8 << 20)


@pytest.mark.gpu
def test_cuda_record_ops_off_gives_none():
    r = make_runner("cuda", record_ops=False)
    x = torch.ones(2, device="cuda")
    g = r.capture(lambda: x + 1)
    assert g.ops is None
    assert g.replay().tolist() == [2.0, 2.0]
    g.close()

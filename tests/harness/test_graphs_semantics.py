"""CUDA-graph semantics that must hold in both graph modes.

Every test runs on ``emulated`` over CPU tensors; with a GPU (``-m gpu``) the same test also
runs under ``cuda`` and ``emulated`` on CUDA tensors side by side. Expected values are
written by hand from the semantics (what a graph replays), never computed by the runner.
"""
import gc
import weakref

import pytest
import torch

from mla_fuzz.harness.graphs import CaptureError, make_runner

MODES = [
    pytest.param(("emulated", "cpu"), id="emulated-cpu"),
    pytest.param(("emulated", "cuda"), id="emulated-cuda", marks=pytest.mark.gpu),
    pytest.param(("cuda", "cuda"), id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=MODES)
def rd(request):
    """(runner, device) for one graph mode."""
    mode, dev = request.param
    device = torch.device(dev)
    return make_runner(mode, device=device), device


# --- toy custom ops: a planner writing a plan buffer, a decode reading it ----------------

@torch.library.custom_op("graphs_test::plan", mutates_args=("plan",))
def _plan(lens: torch.Tensor, plan: torch.Tensor) -> None:
    plan.copy_(torch.cumsum(lens, 0, dtype=plan.dtype))


@torch.library.custom_op("graphs_test::decode", mutates_args=())
def _decode(x: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    # Several aten ops inside: the emulator must still record exactly one op.
    y = x * plan.to(x.dtype)
    return y + 1


class LazyState:
    """Scheduler state with plan=None until the first call, like FlashMLA's metadata."""

    def __init__(self, n, device):
        self.n, self.device, self.plan = n, device, None

    def forward(self, lens, x):
        if self.plan is None:
            self.plan = torch.zeros(self.n, dtype=torch.int32, device=self.device)
            torch.ops.graphs_test.plan(lens, self.plan)
        return torch.ops.graphs_test.decode(x, self.plan)


def _t(values, device, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device=device)


def _cpu(t):
    return t.detach().cpu()


# --- inputs: in place vs rebinding -----------------------------------------------------

def test_inplace_update_of_captured_input_is_seen(rd):
    runner, dev = rd
    x = _t([1.0, 2.0, 3.0], dev)
    g = runner.capture(lambda: x * 10 + 1)
    x.copy_(_t([4.0, 5.0, 6.0], dev))
    assert _cpu(g.replay()).tolist() == [41.0, 51.0, 61.0]
    x.add_(1)
    assert _cpu(g.replay()).tolist() == [51.0, 61.0, 71.0]


def test_rebinding_after_capture_is_not_seen(rd):
    runner, dev = rd

    class Builder:
        pass

    b = Builder()
    b.seq_lens = _t([3, 4], dev, torch.int32)
    g = runner.capture(lambda: b.seq_lens * 2)
    b.seq_lens = _t([7, 9], dev, torch.int32)  # fresh tensor: the graph keeps the old address
    gc.collect()
    assert _cpu(g.replay()).tolist() == [6, 8]
    b.seq_lens.fill_(100)
    assert _cpu(g.replay()).tolist() == [6, 8]


def test_capture_does_not_mutate_preexisting_tensors(rd):
    # A CUDA capture records kernels without running them: the emulator rolls its writes back.
    runner, dev = rd
    counter = _t([0.0, 0.0], dev)
    out = torch.zeros(2, device=dev)

    def fn():
        counter.add_(1)
        out.copy_(counter * 5)
        return out

    g = runner.capture(fn)
    assert _cpu(counter).tolist() == [0.0, 0.0]
    assert _cpu(out).tolist() == [0.0, 0.0]
    assert _cpu(g.replay()).tolist() == [5.0, 5.0]
    assert _cpu(g.replay()).tolist() == [10.0, 10.0]
    assert _cpu(counter).tolist() == [2.0, 2.0]


# --- laziness --------------------------------------------------------------------------

def test_lazy_state_planned_in_warmup_is_frozen(rd):
    runner, dev = rd
    lens = _t([1, 2, 3], dev, torch.int32)
    x = _t([1.0, 1.0, 1.0], dev)
    st = LazyState(3, dev)
    fn = lambda: st.forward(lens, x)  # noqa: E731
    runner.warmup(fn, 1)  # plans with lens [1, 2, 3] -> plan [1, 3, 6]
    g = runner.capture(fn)  # plan already set: the planner is not captured
    lens.copy_(_t([5, 5, 5], dev, torch.int32))
    x.copy_(_t([2.0, 2.0, 2.0], dev))
    assert _cpu(g.replay()).tolist() == [3.0, 7.0, 13.0]  # 2 * [1, 3, 6] + 1: frozen plan
    if g.ops is not None:
        assert "graphs_test::plan" not in g.ops
        assert "graphs_test::decode" in g.ops


def test_lazy_state_fresh_at_capture_replans_each_replay(rd):
    runner, dev = rd
    lens = _t([1, 2, 3], dev, torch.int32)
    x = _t([1.0, 1.0, 1.0], dev)
    st = LazyState(3, dev)
    g = runner.capture(lambda: st.forward(lens, x))
    lens.copy_(_t([5, 5, 5], dev, torch.int32))
    x.copy_(_t([2.0, 2.0, 2.0], dev))
    assert _cpu(g.replay()).tolist() == [11.0, 21.0, 31.0]  # 2 * [5, 10, 15] + 1
    lens.copy_(_t([0, 1, 0], dev, torch.int32))
    assert _cpu(g.replay()).tolist() == [1.0, 3.0, 3.0]
    if g.ops is not None:
        assert g.ops.index("graphs_test::plan") < g.ops.index("graphs_test::decode")


def test_custom_op_is_one_op_not_its_implementation(rd):
    runner, dev = rd
    x = _t([1.0, 2.0], dev)
    plan = _t([3, 4], dev, torch.int32)
    g = runner.capture(lambda: torch.ops.graphs_test.decode(x, plan))
    if g.ops is not None:
        assert g.ops == ["graphs_test::decode"]
    x.fill_(2.0)
    assert _cpu(g.replay()).tolist() == [7.0, 9.0]


# --- host syncs ------------------------------------------------------------------------

HOST_READS = {
    "item": lambda x: x.sum().item(),
    "int": lambda x: int(x[0]),
    "bool": lambda x: bool(x[0] > 0),
    "tolist": lambda x: x.tolist(),
    "nonzero": lambda x: torch.nonzero(x),
    "where1": lambda x: torch.where(x > 1),
    "bool_mask_index": lambda x: x[x > 1],
    "masked_select": lambda x: torch.masked_select(x, x > 1),
    "unique": lambda x: torch.unique(x),
    "equal": lambda x: torch.equal(x, x),
    "numpy": lambda x: x.numpy(),
    "bincount": lambda x: torch.bincount(x.long()),
    "repeat_interleave": lambda x: torch.repeat_interleave(x.long()),
}


# Seen on an H200 (torch 2.11): torch.equal on CUDA tensors during capture is not caught
# by PyTorch's sync debug mode (a prototype that "does not yet detect all synchronizing
# operations") and returns a value computed from nothing. The emulator refuses it — the
# stricter verdict, and the right one for a graph that must not depend on host reads.
CUDA_UNDETECTED = {"equal"}


@pytest.mark.parametrize("kind", sorted(HOST_READS))
def test_host_read_during_capture_raises(rd, kind):
    runner, dev = rd
    x = _t([0.0, 1.0, 2.0, 3.0], dev)
    if runner.mode == "cuda" and kind in CUDA_UNDETECTED:
        g = runner.capture(lambda: HOST_READS[kind](x) and x * 2)  # documents the gap: no error
        g.close()
        return
    with pytest.raises(CaptureError) as ei:
        runner.capture(lambda: HOST_READS[kind](x) and x * 2)
    assert runner.mode in str(ei.value)
    if runner.mode == "emulated":
        assert "aten::" in str(ei.value) or "Tensor." in str(ei.value)  # names the op


def test_device_to_host_copy_raises_on_a_device_capture(rd):
    runner, dev = rd
    x = _t([1.0, 2.0], dev)
    if dev.type == "cpu":
        # The CPU is the device here: .cpu() is a no-op, not a transfer, and is allowed.
        g = runner.capture(lambda: x.cpu() * 2)
        assert g.replay().tolist() == [2.0, 4.0]
        return
    with pytest.raises(CaptureError):
        runner.capture(lambda: x.cpu() + 1)


def test_host_read_inside_custom_op_raises(rd):
    runner, dev = rd

    x = _t([1.0, 2.0], dev)
    with pytest.raises(CaptureError):
        runner.capture(lambda: torch.ops.graphs_test.branchy(x))


@torch.library.custom_op("graphs_test::branchy", mutates_args=())
def _branchy(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if x.max().item() > 1 else x.clone()


def test_runner_usable_after_failed_capture(rd):
    runner, dev = rd
    x = _t([1.0, 2.0], dev)
    with pytest.raises(CaptureError):
        runner.capture(lambda: x * x.sum().item())
    g = runner.capture(lambda: x * 3)
    x.fill_(5.0)
    assert _cpu(g.replay()).tolist() == [15.0, 15.0]


def test_exception_in_fn_becomes_capture_error_with_cause(rd):
    runner, dev = rd
    x = _t([1.0], dev)

    def fn():
        y = x * 2
        raise KeyError("contract check failed")

    with pytest.raises(CaptureError) as ei:
        runner.capture(fn)
    assert isinstance(ei.value.__cause__, KeyError)
    assert "contract check failed" in str(ei.value)


# --- memory: allocation, views, write-back ---------------------------------------------

def test_tensors_allocated_in_capture_keep_their_storage(rd):
    runner, dev = rd
    x = _t([1.0, 2.0, 3.0], dev)

    def fn():
        tmp = torch.empty(3, device=dev)
        tmp.copy_(x)
        y = tmp * 2           # intermediate
        return y + 1, tmp

    g = runner.capture(fn)
    ptrs = [t.data_ptr() for t in g.outputs]
    for k in range(3):
        x.add_(1)
        out, tmp = g.replay()
        assert [t.data_ptr() for t in (out, tmp)] == ptrs
        assert _cpu(out).tolist() == [2 * (v + k + 1) + 1 for v in (1.0, 2.0, 3.0)]


def test_views_made_in_capture_still_alias_after_replay(rd):
    runner, dev = rd
    x = _t([1.0, 2.0], dev)

    def fn():
        base = torch.zeros(2, 3, device=dev)
        col = base[:, 2]
        col.copy_(x)
        return base, col

    g = runner.capture(fn)
    x.copy_(_t([7.0, 8.0], dev))
    base, col = g.replay()
    assert torch._C._is_alias_of(col, base)
    assert _cpu(base).tolist() == [[0.0, 0.0, 7.0], [0.0, 0.0, 8.0]]
    assert _cpu(col).tolist() == [7.0, 8.0]


def test_out_of_place_results_written_back_for_downstream_ops(rd):
    runner, dev = rd
    a = _t([[1.0, 2.0], [3.0, 4.0]], dev)

    def fn():
        h = a @ a          # fresh tensor, read by the next two ops
        s = h.sum(1)
        return h, s / 2

    g = runner.capture(fn)
    a.copy_(_t([[0.0, 1.0], [1.0, 0.0]], dev))
    h, s = g.replay()
    assert _cpu(h).tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert _cpu(s).tolist() == [0.5, 0.5]


def test_poison_empty_makes_uninitialised_reads_nan(rd):
    runner, dev = rd
    runner = make_runner(runner.mode, device=dev, poison_empty=True)
    x = _t([1.0, 2.0], dev)

    def fn():
        buf = torch.empty(4, device=dev)
        buf[:2].copy_(x)
        idx = torch.empty(2, dtype=torch.int32, device=dev)
        return buf, idx

    g = runner.capture(fn)
    buf, idx = g.replay()
    b = _cpu(buf)
    assert b[:2].tolist() == [1.0, 2.0] and torch.isnan(b[2:]).all()
    assert _cpu(idx).tolist() == [2**31 - 1] * 2
    buf[2:].fill_(0.0)  # scribbled: the next replay poisons again
    assert torch.isnan(_cpu(g.replay()[0])[2:]).all()


def test_random_ops_draw_fresh_numbers_each_replay(rd):
    runner, dev = rd
    torch.manual_seed(0)
    g = runner.capture(lambda: torch.rand(64, device=dev))
    a = _cpu(g.replay()).clone()
    b = _cpu(g.replay()).clone()
    assert not torch.equal(a, b)
    assert ((a >= 0) & (a < 1)).all() and ((b >= 0) & (b < 1)).all()


def test_close_releases_what_the_graph_kept_alive(rd):
    runner, dev = rd
    probe = torch.ones(1 << 10, device=dev)
    probe_ref = weakref.ref(probe)
    g = runner.capture(lambda: probe * 2)
    del probe
    gc.collect()
    # Freed memory would go to the next same-sized allocation; the graph must keep it.
    decoy = torch.full((1 << 10,), 7.0, device=dev)
    assert _cpu(g.replay())[:2].tolist() == [2.0, 2.0]
    del decoy
    if runner.mode == "emulated":
        assert probe_ref() is not None
    g.close()
    g.close()  # idempotent
    gc.collect()
    assert g.outputs is None
    if runner.mode == "emulated":  # the cuda runner keeps the storage, not the object
        assert probe_ref() is None

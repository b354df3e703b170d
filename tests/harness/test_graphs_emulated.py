"""Emulator internals on the CPU: op classes, metadata snapshots, the host/device split,
unsupported inputs, the Triton launch guard, and the CUDA op log's vocabulary."""
import torch
import pytest
import triton
import triton.language as tl

from mla_fuzz.harness.graphs import CaptureError, EmulatedRunner, make_runner
from mla_fuzz.harness.graphs import toy_ops  # noqa: F401  (registers the mla_fuzz_toy ops)
from mla_fuzz.harness.graphs.opclass import ALLOC, EXEC, META, VIEW, classify, host_read_reason
from mla_fuzz.harness.graphs.oplog import CudaOpLog

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")


def kinds(graph):
    return [(r.name, r.kind) for r in graph.recorded]


def test_op_classes_from_schemas():
    aten = torch.ops.aten
    assert classify(aten.view.default).kind == VIEW
    assert classify(aten.slice.Tensor).kind == VIEW
    assert classify(aten.unbind.int).kind == VIEW
    assert classify(aten.t_.default).kind == META
    assert classify(aten.set_.source_Tensor).kind == META
    assert classify(aten.empty.memory_format).kind == ALLOC
    assert classify(aten.empty_strided.default).kind == ALLOC
    info = classify(aten.add_.Tensor)
    assert info.kind == EXEC and info.mutable
    assert classify(aten.mm.default).kind == EXEC and not classify(aten.mm.default).mutable
    assert classify(aten.add.out).mutable
    assert classify(torch.ops.mla_fuzz_toy.plan.default).mutable
    assert not classify(torch.ops.mla_fuzz_toy.plan.default).builtin


def test_recorded_kinds_and_skips():
    x = torch.arange(6.0)

    def fn():
        v = x.view(2, 3)          # view: skipped on replay
        buf = torch.empty(2, 3)   # alloc: persists
        torch.mul(v, 2, out=buf)  # out=: re-run
        return buf.sum(0)         # functional: written back

    g = make_runner("emulated").capture(fn)
    assert kinds(g) == [("aten::view", VIEW), ("aten::empty", ALLOC), ("aten::mul", EXEC),
                        ("aten::sum", EXEC)]
    x.fill_(1.0)
    assert g.replay().tolist() == [4.0, 4.0, 4.0]


def test_unsafe_view_output_aliasing_its_input_is_treated_as_view():
    x = torch.arange(4.0)
    g = make_runner("emulated").capture(lambda: torch.ops.aten._unsafe_view(x * 2, [2, 2]))
    assert kinds(g) == [("aten::mul", EXEC), ("aten::_unsafe_view", VIEW)]
    x.fill_(3.0)
    assert g.replay().tolist() == [[6.0, 6.0], [6.0, 6.0]]


def test_inplace_metadata_change_in_capture_keeps_each_ops_layout():
    x = torch.arange(6.0).view(2, 3)

    def fn():
        b = x.clone()
        s0 = b.sum(1)      # recorded with b as [2, 3]
        b.t_()
        s1 = b.sum(1)      # recorded with b as [3, 2]
        return s0, s1

    g = make_runner("emulated").capture(fn)
    assert ("aten::t_", META) in kinds(g)
    x.copy_(torch.ones(2, 3))
    s0, s1 = g.replay()
    assert s0.tolist() == [3.0, 3.0] and s1.tolist() == [2.0, 2.0, 2.0]


def test_set_after_capture_reads_the_captured_storage():
    x = torch.tensor([1.0, 2.0])
    g = make_runner("emulated").capture(lambda: x * 10)
    x.set_(torch.tensor([5.0, 6.0, 7.0]))  # the graph still points at the old memory
    assert g.replay().tolist() == [10.0, 20.0]


def test_nested_custom_op_inner_ops_not_recorded_and_still_guarded():
    @torch.library.custom_op("graphs_emu_test::outer", mutates_args=())
    def outer(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mla_fuzz_toy.decode(x, torch.ones(x.shape, dtype=torch.int32)) * 2

    @torch.library.custom_op("graphs_emu_test::outer_sync", mutates_args=())
    def outer_sync(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mla_fuzz_toy.split_by_host_value(x) + 0

    x = torch.tensor([1.0, 2.0])
    g = make_runner("emulated").capture(lambda: torch.ops.graphs_emu_test.outer(x))
    assert g.ops == ["graphs_emu_test::outer"]
    x.fill_(3.0)
    assert g.replay().tolist() == [8.0, 8.0]
    with pytest.raises(CaptureError, match="inside a custom op"):
        make_runner("emulated").capture(lambda: torch.ops.graphs_emu_test.outer_sync(x))


def test_host_reads_of_host_tensors_allowed_when_device_is_elsewhere():
    # Emulating a CUDA graph: CPU tensors are host memory. Host-only work runs at capture and
    # is not recorded (as a CUDA capture would not record it), host reads are legal.
    r = EmulatedRunner(device=torch.device("cuda"))
    meta = torch.tensor([3, 1, 2])

    def fn():
        n = int(meta.max().item())
        return torch.arange(n) + meta.tolist()[0]

    g = r.capture(fn)
    assert g.ops == []
    assert g.replay().tolist() == [3, 4, 5]


@pytest.mark.parametrize("case", ["d2h", "h2d_blocking", "h2d_pageable_nonblocking", "h2d_pinned_ok",
                                  "same_device_ok", "index_put_fast_path_ok", "index_put_mask_tensor_value"])
def test_copy_and_index_put_host_read_rules(case):
    # Meta tensors stand in for device memory: the rules look at devices, not data.
    is_dev = lambda t: t.device.type == "meta"  # noqa: E731
    aten = torch.ops.aten
    dev = torch.empty(4, device="meta")
    host = torch.empty(4)
    if case == "d2h":
        r = host_read_reason(aten.copy_.default, classify(aten.copy_.default), (host, dev), {}, is_dev)
        assert r and "device memory to the host" in r
    elif case == "h2d_blocking":
        r = host_read_reason(aten.copy_.default, classify(aten.copy_.default), (dev, host), {}, is_dev)
        assert r and "blocking" in r
    elif case == "h2d_pageable_nonblocking":
        r = host_read_reason(aten.copy_.default, classify(aten.copy_.default), (dev, host, True), {}, is_dev)
        assert r and "pageable" in r
    elif case == "h2d_pinned_ok":
        pinned = _FakePinned(host)
        r = host_read_reason(aten.copy_.default, classify(aten.copy_.default), (dev, pinned, True), {}, is_dev)
        assert r is None
    elif case == "same_device_ok":
        r = host_read_reason(aten.copy_.default, classify(aten.copy_.default), (dev, dev), {}, is_dev)
        assert r is None
    else:
        mask = torch.empty(4, dtype=torch.bool, device="meta")
        op = aten.index_put_.default
        value = torch.tensor(0.0) if case == "index_put_fast_path_ok" else torch.empty(1, device="meta")
        r = host_read_reason(op, classify(op), (dev, [mask], value), {}, is_dev)
        assert (r is None) == (case == "index_put_fast_path_ok")


class _FakePinned(torch.Tensor):
    """A CPU tensor that reports itself pinned (no CUDA here to pin memory)."""

    @staticmethod
    def __new__(cls, t):
        return t.as_subclass(cls)

    def is_pinned(self, *a, **k):
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_unsupported_tensors_raise_capture_error():
    sp = torch.eye(3).to_sparse()
    with pytest.raises(CaptureError, match="strided"):
        make_runner("emulated").capture(lambda: sp * 2)


def test_nested_capture_raises():
    r = make_runner("emulated")
    x = torch.ones(2)
    with pytest.raises(CaptureError, match="nested"):
        r.capture(lambda: r.capture(lambda: x * 2).outputs)


def test_inference_mode_capture_and_replay():
    with torch.inference_mode():
        x = torch.ones(3)
        out = torch.zeros(3)

        def fn():
            out.copy_(x * 4)
            return out

        g = make_runner("emulated").capture(fn)
        assert out.tolist() == [0.0, 0.0, 0.0]
        x.fill_(2.0)
    assert g.replay().tolist() == [8.0, 8.0, 8.0]


def test_cpu_scalar_argument_of_device_op_is_baked():
    # For a device graph a 0-dim CPU tensor argument is passed by value at capture time.
    # Emulated here with device='meta' so the CPU is host memory.
    r = EmulatedRunner(device=torch.device("meta"))
    x = torch.ones(3, device="meta")
    s = torch.tensor(2.0)
    g = r.capture(lambda: x * s)
    rec = g._ops[0]
    baked = [v for v in rec.leaves if isinstance(v, torch.Tensor) and v.device.type == "cpu"]
    assert len(baked) == 1 and baked[0] is not s and baked[0].item() == 2.0


@triton.jit
def _add_one_kernel(X, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(X + offs, tl.load(X + offs) + 1)


@torch.library.custom_op("graphs_emu_test::add_one", mutates_args=("x",))
def _add_one(x: torch.Tensor) -> None:
    _add_one_kernel[(1,)](x, x.numel())


def test_triton_launch_outside_custom_op_refused_inside_one_replayed():
    r = make_runner("emulated", device=DEV)
    x = torch.zeros(4, device=DEV)
    with pytest.raises(CaptureError, match="Triton kernel '_add_one_kernel'"):
        r.capture(lambda: _add_one_kernel[(1,)](x, 4) or x)
    assert x.tolist() == [0.0] * 4  # refused before launching

    def fn():
        torch.ops.graphs_emu_test.add_one(x)
        return x

    g = r.capture(fn)
    assert g.ops == ["graphs_emu_test::add_one"]
    assert x.tolist() == [0.0] * 4  # capture's write rolled back
    g.replay()
    assert g.replay().tolist() == [2.0] * 4
    _add_one_kernel[(1,)](x, 4)  # outside a capture the guard is gone
    assert x.tolist() == [3.0] * 4


def test_cuda_op_log_vocabulary_matches_emulator():
    # The cuda runner's op names come from CudaOpLog; on the GPU the fidelity test compares
    # them with the emulator's. Same program, CPU tensors, device type 'cpu' here.
    lens = torch.tensor([1, 2, 3], dtype=torch.int32)
    x = torch.ones(3)

    def fn():
        plan = torch.empty(3, dtype=torch.int32)
        torch.ops.mla_fuzz_toy.plan(lens, plan)
        y = torch.ops.mla_fuzz_toy.decode(x, plan)
        z = torch.zeros(2, 3)
        z[1] = y
        return z.t().contiguous(), torch.rand(2)

    log = CudaOpLog("cpu")
    with log:
        fn()
    g = make_runner("emulated").capture(fn)
    assert log.names == g.ops
    # Pre-existing inputs are kept alive by storage; capture-time allocations are not.
    kept = {st.data_ptr() for st in log.kept.values()}
    assert kept == {lens.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}


def test_many_captures_release_memory():
    import gc
    import weakref

    r = make_runner("emulated")
    refs = []
    for i in range(200):
        x = torch.full((256,), float(i))
        refs.append(weakref.ref(x))
        g = r.capture(lambda: (x * 2).sum(0, keepdim=True))
        assert g.replay().item() == 512.0 * i
        g.close()
    del x
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0

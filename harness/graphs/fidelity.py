"""Fidelity harness: toy scenarios run under ``cuda`` and ``emulated``, compared bitwise.

A scenario is a function ``build(device) -> ScenarioRun`` registered with ``@scenario``.
``build`` makes a fresh little world (inputs, state objects) on ``device`` and returns the
callable(s) to capture, what to change between replays, how many replays, and optionally
an oracle of the expected outputs. ``run_scenario`` drives one mode through it:

    warmup (each fn ``warmup`` times) -> capture each fn (one graph each)
    -> for round i in range(replays): between(i, outputs); replay every graph in order;
       snapshot every output to the CPU

``compare_modes`` runs it under two modes and compares every snapshot bitwise (NaNs
included) plus the capture verdict (both succeed, or both raise ``CaptureError``) and the
recorded op names. The emulator is only trusted in CI because these agree on a GPU.

Extending: the Triton backend's scenarios register the same way from any module::

    from mla_fuzz.harness.graphs.fidelity import ScenarioRun, scenario

    @scenario(description="...")
    def my_backend_replay(device):
        ...
        return ScenarioRun(fn=..., between=..., replays=3)

and are picked up by ``all_scenarios()`` once that module is imported (pass its import
path in ``MLA_FUZZ_FIDELITY_MODULES``, comma-separated, or import it before calling).

Values are small integers in floating point wherever a matmul or reduction is involved,
so results are exact whatever the kernel's summation order: a mismatch is a semantic
difference, never rounding.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import make_runner
from .base import output_tensors
from .errors import CaptureError
from .toy_ops import LazyPlanState

Oracle = Callable[[int], Sequence[torch.Tensor]]


@dataclass
class ScenarioRun:
    """What ``build(device)`` returns.

    - ``fn``: the zero-arg callable to capture, or a sequence of them (one graph each,
      captured and replayed in order).
    - ``between(i, outputs)``: called before replay round ``i`` (``outputs``: list with each
      graph's ``outputs``), to mutate inputs in place, rebind attributes, scribble...
    - ``replays``: number of replay rounds (each replays every graph once).
    - ``warmup``: eager calls of each ``fn`` before its capture.
    - ``expect(i)``: the expected outputs after round ``i``, flattened over graphs, as
      tensors (compared bitwise after casting to the produced dtype, on the CPU).
    """

    fn: Union[Callable[[], Any], Sequence[Callable[[], Any]]]
    between: Optional[Callable[[int, list], None]] = None
    replays: int = 3
    warmup: int = 0
    expect: Optional[Oracle] = None

    @property
    def fns(self) -> List[Callable[[], Any]]:
        return list(self.fn) if isinstance(self.fn, (list, tuple)) else [self.fn]


@dataclass(frozen=True)
class Scenario:
    """A registered scenario. ``capture_error``: every graph mode must raise
    ``CaptureError`` at capture. ``devices``: device types it applies to.
    ``runner_options``: passed to ``make_runner`` (e.g. ``poison_empty``)."""

    name: str
    build: Callable[[torch.device], ScenarioRun]
    description: str
    capture_error: bool = False
    devices: Tuple[str, ...] = ("cpu", "cuda")
    runner_options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ScenarioResult:
    """One mode's run: ``rounds[i]`` = CPU copies of all outputs after round ``i``;
    ``ops`` = each graph's ``ops``; ``error`` = the ``CaptureError`` if capture failed;
    ``expect_failures`` = messages for outputs that differ from the oracle."""

    scenario: str
    mode: str
    rounds: List[List[torch.Tensor]] = field(default_factory=list)
    ops: List[Optional[List[str]]] = field(default_factory=list)
    error: Optional[CaptureError] = None
    expect_failures: List[str] = field(default_factory=list)


@dataclass
class FidelityReport:
    """Outcome of ``compare_modes``: ``ok`` and the list of ``differences``."""

    scenario: str
    modes: Tuple[str, str]
    differences: List[str]

    @property
    def ok(self) -> bool:
        return not self.differences


SCENARIOS: Dict[str, Scenario] = {}


def scenario(name: Optional[str] = None, *, description: Optional[str] = None,
             capture_error: bool = False, devices: Sequence[str] = ("cpu", "cuda"),
             runner_options: Optional[Dict[str, Any]] = None):
    """Decorator registering ``build(device) -> ScenarioRun`` under ``name`` (default: the
    function's name). Raises ValueError on a duplicate name."""
    def register(build: Callable[[torch.device], ScenarioRun]):
        key = name or build.__name__
        if key in SCENARIOS:
            raise ValueError(f"scenario name {key!r} is already registered")
        desc = description or (build.__doc__ or "").strip().split("\n")[0]
        SCENARIOS[key] = Scenario(key, build, desc, capture_error, tuple(devices),
                                  dict(runner_options or {}))
        return build
    return register


def all_scenarios(device_type: Optional[str] = None) -> List[Scenario]:
    """Registered scenarios (after importing ``MLA_FUZZ_FIDELITY_MODULES``), optionally only
    those applying to ``device_type``."""
    for mod in filter(None, (m.strip() for m in os.environ.get("MLA_FUZZ_FIDELITY_MODULES", "").split(","))):
        importlib.import_module(mod)
    return [s for s in SCENARIOS.values() if device_type is None or device_type in s.devices]


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def run_scenario(sc: Scenario, mode: str, device: Union[str, torch.device]) -> ScenarioResult:
    """Run ``sc`` under ``mode`` (``"cuda" | "emulated" | "eager"``) on ``device``."""
    device = torch.device(device)
    runner = make_runner(mode, device=device, **sc.runner_options)
    run = sc.build(device)
    result = ScenarioResult(sc.name, runner.mode)
    graphs = []
    try:
        for f in run.fns:
            if run.warmup:
                runner.warmup(f, run.warmup)
            try:
                graphs.append(runner.capture(f))
            except CaptureError as e:
                result.error = e
                return result
        result.ops = [g.ops for g in graphs]
        for i in range(run.replays):
            if run.between is not None:
                run.between(i, [g.outputs for g in graphs])
            outs: List[torch.Tensor] = []
            for g in graphs:
                outs.extend(output_tensors(g.replay()))
            result.rounds.append([_snapshot(t) for t in outs])
            if run.expect is not None:
                result.expect_failures.extend(
                    _compare_lists(result.rounds[-1], [_snapshot(t) for t in run.expect(i)],
                                   f"round {i} vs oracle", cast=True))
    finally:
        for g in graphs:
            g.close()
    return result


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaN == NaN with the same payload, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    ab = a.contiguous().reshape(-1).view(torch.uint8)
    bb = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


def _compare_lists(got: List[torch.Tensor], want: List[torch.Tensor], what: str,
                   cast: bool = False) -> List[str]:
    if len(got) != len(want):
        return [f"{what}: {len(got)} outputs vs {len(want)}"]
    diffs = []
    for k, (g, w) in enumerate(zip(got, want)):
        if cast and w.dtype != g.dtype:
            w = w.to(g.dtype)
        if not bitwise_equal(g, w):
            diffs.append(f"{what}: output {k} differs:\n    {g.tolist() if g.numel() <= 64 else g.shape}"
                         f"\n vs {w.tolist() if w.numel() <= 64 else w.shape}")
    return diffs


def compare_results(a: ScenarioResult, b: ScenarioResult, compare_ops: bool = True) -> FidelityReport:
    """Differences between two modes' results of the same scenario (empty = faithful)."""
    diffs: List[str] = []
    if (a.error is None) != (b.error is None):
        diffs.append(f"capture verdict: {a.mode} {'raised ' + repr(a.error) if a.error else 'captured'}"
                     f", {b.mode} {'raised ' + repr(b.error) if b.error else 'captured'}")
    else:
        if len(a.rounds) != len(b.rounds):
            diffs.append(f"rounds: {len(a.rounds)} vs {len(b.rounds)}")
        for i, (ra, rb) in enumerate(zip(a.rounds, b.rounds)):
            diffs.extend(_compare_lists(ra, rb, f"round {i} {a.mode} vs {b.mode}"))
        if compare_ops:
            for k, (oa, ob) in enumerate(zip(a.ops, b.ops)):
                if oa is not None and ob is not None and oa != ob:
                    diffs.append(f"graph {k} ops: {a.mode} {oa} vs {b.mode} {ob}")
    return FidelityReport(a.scenario, (a.mode, b.mode), diffs)


def compare_modes(sc: Scenario, device: Union[str, torch.device],
                  modes: Tuple[str, str] = ("cuda", "emulated"),
                  compare_ops: bool = True) -> FidelityReport:
    """Run ``sc`` under both ``modes`` on ``device`` and compare bitwise."""
    ra = run_scenario(sc, modes[0], device)
    rb = run_scenario(sc, modes[1], device)
    return compare_results(ra, rb, compare_ops=compare_ops)


# --------------------------------------------------------------------------------------
# The scenarios. Each builds its world on `device`; oracles are written from the
# CUDA-graph semantics by hand (never by calling the code under test).
# --------------------------------------------------------------------------------------

def _ar(n: int, device, dtype=torch.float32) -> torch.Tensor:
    return torch.arange(n, dtype=dtype, device=device)


class _State:
    """A plain attribute bag standing in for a metadata builder or backend."""


@scenario(description="in-place update of a captured input before each replay is seen")
def inplace_input_seen(device):
    x = _ar(6, device)

    def between(i, outs):
        x.add_(10)

    return ScenarioRun(fn=lambda: x * 2 + 1, between=between,
                       expect=lambda i: [(_ar(6, "cpu") + 10 * (i + 1)) * 2 + 1])


@scenario(description="attribute rebound to a fresh tensor after capture is not seen (stale address)")
def rebind_attribute_stale(device):
    st = _State()
    st.buf = torch.full((4,), 1.0, device=device)

    def between(i, outs):
        st.buf = torch.full((4,), float(i + 2), device=device)  # old tensor dropped

    return ScenarioRun(fn=lambda: st.buf * 3, between=between,
                       expect=lambda i: [torch.full((4,), 3.0)])


@scenario(description="copying into the persistent buffer (the fix for stale addresses) is seen")
def persistent_buffer_copy(device):
    st = _State()
    st.buf = torch.full((4,), 1.0, device=device)

    def between(i, outs):
        st.buf.copy_(torch.full((4,), float(i + 2), device=device))

    return ScenarioRun(fn=lambda: st.buf * 3, between=between,
                       expect=lambda i: [torch.full((4,), 3.0 * (i + 2))])


_PLAN_LENS = [[1, 2, 3, 4], [4, 3, 2, 1], [2, 2, 2, 2], [5, 0, 1, 3]]


def _plan_world(device):
    lens = torch.tensor(_PLAN_LENS[0], dtype=torch.int32, device=device)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], device=device)
    st = LazyPlanState(4, device)

    def between(i, outs):
        lens.copy_(torch.tensor(_PLAN_LENS[i + 1], dtype=torch.int32, device=device))
        x.add_(1)

    return lens, x, st, between


def _plan_expect(lens_list, i):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]) + (i + 1)
    plan = torch.cumsum(torch.tensor(lens_list), 0).float()
    return [x * plan + 1]


@scenario(description="laziness: warmup plans, capture skips the planner, replay uses the frozen plan")
def lazy_planner_frozen_by_warmup(device):
    lens, x, st, between = _plan_world(device)
    return ScenarioRun(fn=lambda: st.forward(lens, x), between=between, warmup=1,
                       expect=lambda i: _plan_expect(_PLAN_LENS[0], i))


@scenario(description="fresh lazy state at capture: the planner is captured and re-plans every replay")
def lazy_planner_in_graph(device):
    lens, x, st, between = _plan_world(device)
    return ScenarioRun(fn=lambda: st.forward(lens, x), between=between,
                       expect=lambda i: _plan_expect(_PLAN_LENS[i + 1], i))


@scenario(description="a tensor allocated in capture is filled by captured ops each replay")
def alloc_in_capture(device):
    x = _ar(5, device)

    def fn():
        buf = torch.empty(5, device=device)
        buf.copy_(x)
        buf.mul_(2)
        return buf

    return ScenarioRun(fn=fn, between=lambda i, o: x.add_(1),
                       expect=lambda i: [(_ar(5, "cpu") + i + 1) * 2])


@scenario(description="zeros() in capture is re-zeroed by every replay (no accumulation)")
def zeros_refilled_each_replay(device):
    x = _ar(4, device)

    def fn():
        acc = torch.zeros(4, device=device)
        acc.add_(x)
        acc.add_(x)
        return acc

    return ScenarioRun(fn=fn, between=lambda i, o: x.add_(1),
                       expect=lambda i: [2 * (_ar(4, "cpu") + i + 1)])


@scenario(description="a graph that increments its input: capture leaves it alone, each replay adds 1")
def graph_mutates_input(device):
    counter = torch.zeros(3, device=device)

    def fn():
        counter.add_(1)
        return counter

    return ScenarioRun(fn=fn, expect=lambda i: [torch.full((3,), float(i + 1))])


@scenario(description="a slice of an input is scaled in place by the graph: views of inputs write through")
def view_of_input_written(device):
    x = torch.ones(5, device=device)

    def fn():
        x[1:3].mul_(2)
        return x

    def expect(i):
        e = torch.ones(5)
        e[1:3] = 2.0 ** (i + 1)
        return [e]

    return ScenarioRun(fn=fn, expect=expect)


@scenario(description="views made during capture still alias their base after replay")
def view_alias_of_capture_buffer(device):
    x = _ar(2, device)

    def fn():
        buf = torch.zeros(2, 3, device=device)
        col = buf[:, 1]
        col.copy_(x)
        return buf, col

    def expect(i):
        buf = torch.zeros(2, 3)
        buf[:, 1] = _ar(2, "cpu") + 3 * (i + 1)
        return [buf, buf[:, 1].clone()]

    return ScenarioRun(fn=fn, between=lambda i, o: x.add_(3), expect=expect)


@scenario(description="out-of-place chain (matmul, relu, sum) written back into captured intermediates")
def out_of_place_chain(device):
    a = torch.tensor([[1.0, 2.0, 0.0], [3.0, -1.0, 2.0]], device=device)
    w = torch.tensor([[1.0, 0.0], [2.0, 1.0], [-1.0, 3.0]], device=device)

    def fn():
        return torch.relu(a @ w - 2).sum(0)

    def between(i, o):
        a.copy_(torch.tensor([[i + 1.0, 0.0, 1.0], [2.0, i + 2.0, -1.0]], device=device))

    def expect(i):
        aa = torch.tensor([[i + 1.0, 0.0, 1.0], [2.0, i + 2.0, -1.0]])
        ww = torch.tensor([[1.0, 0.0], [2.0, 1.0], [-1.0, 3.0]])
        return [torch.relu(aa @ ww - 2).sum(0)]

    return ScenarioRun(fn=fn, between=between, expect=expect)


@scenario(description="index_put_ with an index tensor updated in place between replays")
def index_put_moving_index(device):
    idx = torch.tensor([0, 2, 4], device=device)
    vals = torch.tensor([1.0, 2.0, 3.0], device=device)

    def fn():
        out = torch.zeros(6, device=device)
        out[idx] = vals
        return out

    perms = [[1, 3, 5], [5, 0, 2], [4, 1, 3]]

    def between(i, o):
        idx.copy_(torch.tensor(perms[i], device=device))
        vals.add_(1)

    def expect(i):
        out = torch.zeros(6)
        out[torch.tensor(perms[i])] = torch.tensor([1.0, 2.0, 3.0]) + i + 1
        return [out]

    return ScenarioRun(fn=fn, between=between, expect=expect)


@scenario(description="gather with an index updated in place")
def gather_moving_index(device):
    src = torch.tensor([10.0, 20.0, 30.0, 40.0], device=device)
    idx = torch.tensor([0, 1, 2], device=device)
    tables = [[3, 3, 0], [1, 0, 2], [2, 2, 2]]

    def between(i, o):
        idx.copy_(torch.tensor(tables[i], device=device))

    return ScenarioRun(fn=lambda: torch.gather(src, 0, idx) + 0.5, between=between,
                       expect=lambda i: [torch.tensor([10.0, 20.0, 30.0, 40.0])[torch.tensor(tables[i])] + 0.5])


@scenario(description="masked_fill / where with a device mask updated in place")
def mask_updated_in_place(device):
    x = _ar(5, device) + 1
    mask = torch.tensor([True, False, True, False, False], device=device)
    masks = [[False, True, False, True, True], [True, True, True, True, True], [False] * 5]

    def between(i, o):
        mask.copy_(torch.tensor(masks[i], device=device))

    def expect(i):
        m = torch.tensor(masks[i])
        xx = _ar(5, "cpu") + 1
        return [xx.masked_fill(m, 0.0), torch.where(m, xx, -xx)]

    return ScenarioRun(fn=lambda: (x.masked_fill(mask, 0.0), torch.where(mask, x, -x)),
                       between=between, expect=expect)


@scenario(description="x[mask] = scalar in capture: PyTorch's masked_fill fast path, no host sync")
def bool_mask_fill_scalar(device):
    x = _ar(5, device) + 1
    mask = torch.tensor([True, False, True, False, False], device=device)
    masks = [[False, True, False, True, True], [True] * 5, [False] * 5]

    def fn():
        buf = x.clone()
        buf[mask] = 0.0
        return buf

    def expect(i):
        e = _ar(5, "cpu") + 1
        e[torch.tensor(masks[i])] = 0.0
        return [e]

    return ScenarioRun(fn=fn, between=lambda i, o: mask.copy_(torch.tensor(masks[i], device=device)),
                       expect=expect)


@scenario(description="int32 prefix sum (an indptr) recomputed from lengths updated in place")
def cumsum_indptr(device):
    lens = torch.tensor([3, 0, 2, 5], dtype=torch.int32, device=device)
    new = [[1, 1, 1, 1], [0, 0, 7, 0], [2, 4, 6, 8]]

    def fn():
        indptr = torch.zeros(5, dtype=torch.int32, device=device)
        indptr[1:] = torch.cumsum(lens, 0, dtype=torch.int32)
        return indptr

    def expect(i):
        e = torch.zeros(5, dtype=torch.int32)
        e[1:] = torch.cumsum(torch.tensor(new[i], dtype=torch.int32), 0, dtype=torch.int32)
        return [e]

    return ScenarioRun(fn=fn, between=lambda i, o: lens.copy_(torch.tensor(new[i], dtype=torch.int32, device=device)),
                       expect=expect)


@scenario(description="dtype casts (fp32 -> fp16 -> int32) and bf16 arithmetic")
def dtype_casts(device):
    x = torch.tensor([1.5, -2.25, 3.0, 100.0], device=device)

    def fn():
        h = x.to(torch.float16) * 2
        return h.to(torch.int32), (x.to(torch.bfloat16) + 1).to(torch.float32)

    def expect(i):
        xx = torch.tensor([1.5, -2.25, 3.0, 100.0]) * (2 ** (i + 1))
        return [(xx.to(torch.float16) * 2).to(torch.int32), (xx.to(torch.bfloat16) + 1).to(torch.float32)]

    return ScenarioRun(fn=fn, between=lambda i, o: x.mul_(2), expect=expect)


@scenario(description="a Python float read at capture is baked into the graph")
def python_scalar_baked(device):
    st = _State()
    st.scale = 2.0
    x = _ar(4, device)

    def between(i, o):
        st.scale = 5.0 + i

    return ScenarioRun(fn=lambda: x * st.scale, between=between,
                       expect=lambda i: [_ar(4, "cpu") * 2.0])


@scenario(description="a host-side branch taken at capture is frozen")
def host_branch_frozen(device):
    st = _State()
    st.use_a = True
    a = torch.ones(3, device=device)
    b = torch.full((3,), 7.0, device=device)

    def fn():
        return (a if st.use_a else b) + 1

    def between(i, o):
        st.use_a = not st.use_a
        a.add_(1)

    return ScenarioRun(fn=fn, between=between, expect=lambda i: [torch.full((3,), float(i + 3))])


@scenario(description="outputs scribbled on between replays are overwritten by the replay")
def outputs_overwritten(device):
    x = _ar(4, device)

    def between(i, outs):
        outs[0].fill_(-7.0)

    return ScenarioRun(fn=lambda: x + 1, between=between, expect=lambda i: [_ar(4, "cpu") + 1])


@scenario(description="a functional custom op (fresh output) re-run on updated inputs")
def custom_op_functional(device):
    x = torch.tensor([1.0, 2.0, 3.0], device=device)
    plan = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)

    def between(i, o):
        plan.add_(1)
        x.mul_(-1)

    def expect(i):
        xx = torch.tensor([1.0, 2.0, 3.0]) * (-1) ** (i + 1)
        return [xx * (torch.tensor([1.0, 2.0, 3.0]) + i + 1) + 1]

    return ScenarioRun(fn=lambda: torch.ops.mla_fuzz_toy.decode(x, plan), between=between,
                       expect=expect)


@scenario(description="a custom op writing a persistent out buffer (mutates_args)")
def custom_op_mutating_out(device):
    x = torch.tensor([1.0, 2.0, 3.0], device=device)
    plan = torch.tensor([2, 2, 2], dtype=torch.int32, device=device)
    out = torch.zeros(3, device=device)

    def fn():
        torch.ops.mla_fuzz_toy.decode_out(x, plan, out)
        return out

    return ScenarioRun(fn=fn, between=lambda i, o: x.add_(1),
                       expect=lambda i: [(torch.tensor([1.0, 2.0, 3.0]) + i + 1) * 2 + 1])


@scenario(description="two graphs chained through a shared buffer, replayed in order")
def two_graphs_chained(device):
    x = _ar(3, device)
    mid = torch.zeros(3, device=device)

    def g1():
        mid.copy_(x * 2)
        return mid

    def g2():
        return mid + 1

    return ScenarioRun(fn=[g1, g2], between=lambda i, o: x.add_(1),
                       expect=lambda i: [(_ar(3, "cpu") + i + 1) * 2, (_ar(3, "cpu") + i + 1) * 2 + 1])


@scenario(description="a non-contiguous [:B, :L] view of a 2-D buffer read by the graph")
def noncontiguous_2d_view(device):
    buf = _ar(12, device).view(4, 3)

    def fn():
        v = buf[:2, :2]
        return v.sum(1), v * 1

    def expect(i):
        b = (_ar(12, "cpu") + 100 * (i + 1)).view(4, 3)
        return [b[:2, :2].sum(1), b[:2, :2].clone()]

    return ScenarioRun(fn=fn, between=lambda i, o: buf.add_(100), expect=expect)


@scenario(description="a flat 1-D buffer viewed as (B, L): the contiguity fix")
def flat_buffer_view(device):
    flat = _ar(12, device)

    def fn():
        return flat[:6].view(2, 3) * 2

    return ScenarioRun(fn=fn, between=lambda i, o: flat.add_(1),
                       expect=lambda i: [((_ar(12, "cpu") + i + 1)[:6].view(2, 3)) * 2])


@scenario(description="out= into a tensor allocated (empty, size 0) in capture and resized by the op")
def out_arg_resized(device):
    x = _ar(3, device)

    def fn():
        o = torch.empty(0, device=device)
        torch.mul(x, 3, out=o)
        return o

    return ScenarioRun(fn=fn, between=lambda i, o: x.add_(1),
                       expect=lambda i: [(_ar(3, "cpu") + i + 1) * 3])


@scenario(description="uninitialised memory read under poison_empty is NaN on every replay",
          runner_options={"poison_empty": True})
def poison_empty_partial_write(device):
    x = _ar(4, device) + 1

    def fn():
        buf = torch.empty(4, device=device)
        buf[:2].copy_(x[:2])
        return buf

    def expect(i):
        e = torch.full((4,), float("nan"))
        e[:2] = _ar(2, "cpu") + 1 + (i + 1)
        return [e]

    return ScenarioRun(fn=fn, between=lambda i, o: x.add_(1), expect=expect)


@scenario(description="host read .item() in capture", capture_error=True)
def host_read_item(device):
    x = _ar(4, device)
    return ScenarioRun(fn=lambda: x * (x.sum().item() > 0))


@scenario(description="host read .tolist() in capture", capture_error=True)
def host_read_tolist(device):
    x = _ar(4, device)
    return ScenarioRun(fn=lambda: torch.full((4,), float(len([v for v in x.tolist() if v > 1])), device=device))


@scenario(description="data-dependent shape: nonzero in capture", capture_error=True)
def host_read_nonzero(device):
    x = _ar(4, device)
    return ScenarioRun(fn=lambda: torch.nonzero(x).float())


@scenario(description="data-dependent shape: boolean-mask indexing in capture", capture_error=True)
def host_read_bool_mask_index(device):
    x = _ar(4, device)
    return ScenarioRun(fn=lambda: x[x > 1] * 2)


@scenario(description="device-to-host copy .cpu() in capture", capture_error=True, devices=("cuda",))
def host_read_cpu_copy(device):
    x = _ar(4, device)
    return ScenarioRun(fn=lambda: x.cpu() + 1)


@scenario(description=".item() inside a custom op's implementation", capture_error=True)
def host_read_inside_custom_op(device):
    x = _ar(4, device)
    return ScenarioRun(fn=lambda: torch.ops.mla_fuzz_toy.split_by_host_value(x))

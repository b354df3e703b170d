"""Fidelity scenarios over the real Triton backend (and two mutants), registered with
``harness.graphs.fidelity`` so the GPU check compares ``cuda`` and ``emulated`` on them.

Each scenario captures ``backend.forward`` (or the layer step) for one batch, then before
each replay rebuilds a *different* batch the way an engine does, and states its oracle
as an eager forward: of the new batch when the backend keeps its addresses (in-place
metadata), of the capture-time metadata when it rebinds (stale), of the frozen plan
when planning was lazy. The two graph modes must agree bitwise with each other.

Import this module (or list it in ``MLA_FUZZ_FIDELITY_MODULES``) to register them.
"""
from __future__ import annotations


from mla_fuzz.harness.layer import MLADecodeLayer
from mla_fuzz.kernels import TritonMLABackend
from mla_fuzz.mla_ref import ModelSpec

from .executor import nan_fill_uninitialised
from .graphs.fidelity import ScenarioRun, scenario
from .mutants import HostSplitDecision, ItemInCapture, SharedLazySched
from .scenario import ScenarioConfig
from .world import World

_SIZES = [4]


def _draw(seed: int, seq_lens, q_lens=None, mdl=None) -> dict:
    q_lens = q_lens or [1 if s else 0 for s in seq_lens]
    return {"seed": seed, "seq_lens": list(seq_lens), "q_lens": list(q_lens),
            "max_decode_len": mdl or max(q_lens + [1])}


# Batches replayed after the capture batch: longer rows (new pages, new splits), a
# zero-length row, fewer rows than captured (padding), MTP widths below next_n.
_ROUNDS = [
    _draw(11, [90, 17, 1]),
    _draw(12, [9, 0, 96, 33]),
    _draw(13, [64]),
]
_MTP_ROUNDS = [
    _draw(21, [40, 9, 2], [2, 1, 2], 2),
    _draw(22, [96, 31], [3, 1], 3),
    _draw(23, [5, 0, 50], [1, 0, 1], 1),
]


class _Engine:
    """World + backend + persistent inputs; ``step(draw)`` builds like an engine does."""

    def __init__(self, device, backend_cls=TritonMLABackend, kv_dtype="bf16", next_n=1, graph_safe=True,
                 layer=False, fp8_out=False):
        self.cfg = ScenarioConfig(spec=ModelSpec.tiny(8).to_dict(), kv_dtype=kv_dtype, page_size=16,
                                  next_n=next_n, capture_sizes=_SIZES, max_pages_per_seq=6, layer=layer,
                                  fp8_out=fp8_out, seed=7)
        self.world = World(self.cfg, device)
        self.backend = backend_cls(self.world.spec, device=device, max_batch=max(_SIZES), capture_sizes=_SIZES,
                                   graph_safe=graph_safe, next_n_max=max(next_n, 1), max_blocks_per_seq=6,
                                   page_size=16)
        self.layer = MLADecodeLayer(self.world.spec, self.world.weights, self.backend) if layer else None
        self.fp8_out = fp8_out
        self.q = self.world.new_q(max(_SIZES))
        self.hidden, self.positions = self.world.new_hidden(max(_SIZES))
        self.md = None

    def step(self, draw: dict, poison: bool = False):
        batch = self.world.make_batch(draw, max(_SIZES))
        self.md = self.backend.build(batch)
        self.world.fill_q(self.q, draw, batch.batch_size, poison)
        self.world.fill_hidden(self.hidden, self.positions, batch, draw, poison)
        return self.md

    def forward_with(self, md):
        kv = self.world.kv_cache
        if self.layer is not None:
            return (self.layer(self.hidden, self.positions, kv, md, fp8_out=self.fp8_out),)
        return self.backend.forward(self.q, kv, md)

    def graph_fn(self):
        # Bound at capture time, as a graph-captured engine's forward is: `self.md` is
        # read here once, so rebinding it later is invisible to a replay.
        md = self.md
        return lambda: self.forward_with(md)


def _in_place(device, rounds, **kw):
    eng = _Engine(device, **kw)
    eng.step(_draw(1, [3, 3]))
    return ScenarioRun(
        fn=eng.graph_fn(),
        between=lambda i, outs: eng.step(rounds[i], poison=True),
        replays=len(rounds),
        # new metadata was written into the same buffers: replay == eager of the new batch
        expect=lambda i: [t.clone() for t in eng.forward_with(eng.md)])


@scenario(description="Triton backend, bf16: rebuilt in place, replay equals eager of each new batch")
def triton_inplace_bf16(device):
    return _in_place(device, _ROUNDS)


@scenario(description="Triton backend, FP8 cache: rebuilt in place, replay equals eager of each new batch")
def triton_inplace_fp8(device):
    return _in_place(device, _ROUNDS, kv_dtype="fp8")


@scenario(description="Triton backend, MTP next_n=3 with mixed q_lens and max_decode_len < next_n")
def triton_inplace_mtp(device):
    return _in_place(device, _MTP_ROUNDS, next_n=3)


@scenario(description="Triton layer step with per-tensor FP8 output and NaN-poisoned padding")
def triton_layer_fp8_out(device):
    return _in_place(device, _MTP_ROUNDS, next_n=3, layer=True, fp8_out=True)


@scenario(description="Triton backend that allocates fresh metadata per build: replay reads the capture-time batch")
def triton_rebound_metadata_stale(device):
    eng = _Engine(device, graph_safe=False)
    cap_md = eng.step(_draw(1, [70, 3]))
    return ScenarioRun(
        fn=eng.graph_fn(),
        between=lambda i, outs: eng.step(_ROUNDS[i]),
        replays=len(_ROUNDS),
        # q is updated in place (seen), the metadata was rebound (not seen)
        expect=lambda i: [t.clone() for t in eng.forward_with(cap_md)])


# A frozen plan that no longer matches the lengths makes the kernels read partial rows
# nobody wrote this run; with poison_empty (and the NaN fill in the oracle) those reads
# are NaN in every mode instead of whatever the allocator left there.
@scenario(description="shared lazy scheduler state: warmup plans, capture skips the planner, replays reuse it",
          runner_options={"poison_empty": True})
def triton_lazy_sched_frozen(device):
    eng = _Engine(device, backend_cls=SharedLazySched)
    cap_md = eng.step(_draw(1, [96, 80]))
    eng.forward_with(cap_md)  # warmup on the same build: plans the shared state
    frozen = [t.clone() for t in (cap_md.part_info, cap_md.num_splits, cap_md.split_offsets)]

    def expect(i):
        # what a replay computes: the new batch's lengths under the warmup-time plan
        for dst, src in zip((eng.md.part_info, eng.md.num_splits, eng.md.split_offsets), frozen):
            dst.copy_(src)
        eng.md.sched.planned = True
        with nan_fill_uninitialised():
            return [t.clone() for t in eng.forward_with(eng.md)]

    return ScenarioRun(fn=eng.graph_fn(), between=lambda i, outs: eng.step(_ROUNDS[i]),
                       replays=len(_ROUNDS), expect=expect)


@scenario(description="host-decided split plan written as constants: replays keep the capture batch's plan",
          runner_options={"poison_empty": True})
def triton_host_split_frozen(device):
    eng = _Engine(device, backend_cls=HostSplitDecision)
    cap_md = eng.step(_draw(1, [96, 80]))
    cap_sched = cap_md.sched

    def expect(i):
        eng.md.sched = cap_sched
        with nan_fill_uninitialised():
            return [t.clone() for t in eng.forward_with(eng.md)]

    return ScenarioRun(fn=eng.graph_fn(), between=lambda i, outs: eng.step(_ROUNDS[i]),
                       replays=len(_ROUNDS), expect=expect)


@scenario(description="a .item() in the Triton forward path fails the capture", capture_error=True)
def triton_item_in_capture(device):
    eng = _Engine(device, backend_cls=ItemInCapture)
    eng.step(_draw(1, [3, 3]))
    return ScenarioRun(fn=eng.graph_fn(), replays=1)


TRITON_SCENARIOS = ["triton_inplace_bf16", "triton_inplace_fp8", "triton_inplace_mtp", "triton_layer_fp8_out",
                    "triton_rebound_metadata_stale", "triton_lazy_sched_frozen", "triton_host_split_frozen",
                    "triton_item_in_capture"]

"""Runs a scenario's steps against one backend and checks the oracles after each step.

``ScenarioRunner.apply(step)`` is the single entry point used both by the Hypothesis
state machine (search) and by ``harness.repro`` (deterministic replay), so a repro
re-executes exactly what the search executed.

Per step (DESIGN.md §5 oracles, numbered as there):
- eager:   forward twice on the same inputs -> (8) bitwise determinism; (2) vs reference;
           (3) real rows finite; (5) contiguity audit; (6) cache integrity.
- warmup:  an eager forward at a capture size (what engines do before capture).
- capture: build + capture of forward at size S; (7) a host read raises -> host-sync.
- replay:  new batch built into the *same* persistent buffers, graph replayed; (4) address
           audit of every metadata tensor the graph reads; (1) replay == eager bitwise on
           real rows; (2), (3), (6) as above; padding poisoned with NaN when asked.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass

import torch

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import DecodeBatch

from .audit import OpAudit, OpLog, tensor_fields
from .graphs import CaptureError, make_runner
from .loading import make_backend
from .oracles import OracleFailure, check_layer, check_out_lse, compare_bitwise, nonfinite_rows
from .scenario import ScenarioConfig
from .world import World


@dataclass
class Captured:
    size: int
    graph: object
    q: torch.Tensor
    hidden: torch.Tensor | None
    positions: torch.Tensor | None
    meta: object
    meta_ptrs: dict
    log: OpLog
    batch: DecodeBatch
    step: int


class ScenarioRunner:
    """One backend instance, one KV pool, one graph runner; steps applied in order."""

    def __init__(self, backend_cls, cfg: ScenarioConfig, graph_mode: str = "auto", device=None,
                 strict_contiguity: bool = True):
        cfg.validate()
        self.cfg = cfg
        # Graph-pool allocations are NaN-filled (deterministic-mode fill) so a kernel that
        # leaves padded output uninitialised is loud, as vLLM #37442 was in production.
        self.runner = (make_runner(graph_mode, device) if graph_mode == "eager"
                       else make_runner(graph_mode, device, poison_empty=True))
        self.mode = self.runner.mode
        if device is None:
            device = "cuda" if self.mode == "cuda" else "cpu"
        self.device = torch.device(device)
        self.world = World(cfg, self.device)
        self.spec = self.world.spec
        self.backend_cls = backend_cls
        self.backend = self._new_backend()
        self.layer = None
        if cfg.layer:
            from mla_fuzz.kernels import MLADecodeLayer
            self.layer = MLADecodeLayer(self.spec, self.world.weights, self.backend)
        self.strict_contiguity = strict_contiguity
        self.captures: dict[int, Captured] = {}
        self.index = 0

    def _new_backend(self):
        cfg = self.cfg
        return make_backend(self.backend_cls, self.spec, device=self.device, max_batch=cfg.max_batch,
                            capture_sizes=cfg.capture_sizes, graph_safe=self.mode != "eager",
                            page_size=cfg.page_size, max_blocks_per_seq=cfg.max_pages_per_seq,
                            next_n_max=cfg.next_n, num_blocks=self.world.num_blocks,
                            **({"topk_max": cfg.topk, "indexer": self.world.indexer} if cfg.sparse else {}))

    def close(self) -> None:
        for cap in self.captures.values():
            _release(cap.graph)
        self.captures.clear()

    # -- plumbing ------------------------------------------------------------------------
    def _forward(self, q, hidden, positions, meta):
        kv = self.world.kv_cache
        if self.layer is not None:
            return (self.layer(hidden, positions, kv, meta, fp8_out=self.cfg.fp8_out),)
        out, lse = self.backend.forward(q, kv, meta)
        return (out, lse)

    def _audited(self, fn, log: OpLog):
        with nan_fill_uninitialised(), OpAudit(log):
            return fn()

    def _check_contiguity(self, log: OpLog, where: str) -> None:
        if self.strict_contiguity:
            bad = log.noncontiguous()
            if bad:
                raise OracleFailure("contiguity", f"{where}: non-contiguous tensor handed to a kernel that may "
                                    f"index it flat: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""),
                                    self.index, {"noncontiguous": bad})

    def _inputs(self, pad: int, batch: DecodeBatch, draw: dict, poison: bool, q=None, hidden=None, positions=None):
        if q is None:
            q = self.world.new_q(pad)
        self.world.fill_q(q, draw, batch.batch_size, poison)
        if self.layer is not None:
            if hidden is None:
                hidden, positions = self.world.new_hidden(pad)
            self.world.fill_hidden(hidden, positions, batch, draw, poison)
        return q, hidden, positions

    def _reference(self, batch: DecodeBatch, q, hidden, positions, cache_before: torch.Tensor):
        B, dev = batch.batch_size, self.device
        bt, sl, ql = (batch.block_table.to(dev), batch.seq_lens.to(dev), batch.q_lens.to(dev))
        if self.layer is not None:
            cache = cache_before.clone()
            return (mla_ref.mla_layer_decode_absorbed(
                self.world.weights, hidden[:B], positions[:B], cache, bt, sl, batch.slot_mapping.to(dev),
                spec=self.spec, q_lens=ql, fp8_out=self.cfg.fp8_out),)
        # sparse steps: attention over exactly the selected slots (dense steps unchanged)
        indices = None
        if batch.topk_on_device:
            indices = mla_ref.indexer_topk(self.world.indexer, q[:B], cache_before, bt, sl, ql, batch.topk,
                                           spec=self.spec).to(dev)
        elif batch.is_sparse:
            indices = batch.dense_topk().to(dev)
        return mla_ref.mla_decode(q[:B], cache_before, bt, sl, spec=self.spec, q_lens=ql, indices=indices)

    def _check_reference(self, outs, ref, batch: DecodeBatch, what: str) -> None:
        B = batch.batch_size
        if self.layer is not None:
            check_layer(outs[0][:B], ref[0], what, self.index, self.cfg.fp8_out)
        else:
            check_out_lse(outs[0][:B], outs[1][:B], ref[0], ref[1], what, self.index)

    def _check_finite(self, outs, batch: DecodeBatch, what: str) -> None:
        B = batch.batch_size
        real = outs[0][:B]
        if self.layer is None:
            # Zero-length rows and padding tokens are defined as exact zeros; only NaN/inf count.
            pass
        rows = nonfinite_rows(real) if B else []
        if rows:
            raise OracleFailure("finite", f"{what}: non-finite values in real rows {rows}", self.index, {"rows": rows})

    def _check_integrity(self, before: torch.Tensor, batch: DecodeBatch, what: str) -> None:
        """Oracle 6: slots this step does not write are bitwise unchanged."""
        kv = self.world.kv_cache
        ps = self.cfg.page_size
        now = kv.view(torch.uint8).reshape(self.world.num_blocks * ps, -1)
        old = before.view(torch.uint8).reshape(self.world.num_blocks * ps, -1)
        changed = (now != old).any(dim=1)
        if self.layer is not None:
            slots = batch.slot_mapping[batch.slot_mapping >= 0].to(changed.device)
            changed[slots] = False
        if bool(changed.any()):
            idx = changed.nonzero().flatten().cpu().tolist()
            pages = sorted({s // ps for s in idx})
            raise OracleFailure("integrity", f"{what}: {len(idx)} KV slots not written by this step changed "
                                f"(first slots {idx[:6]}, pages {pages[:6]}; null block is page 0)",
                                self.index, {"slots": idx[:64], "pages": pages})

    # -- steps ---------------------------------------------------------------------------
    def apply(self, step: dict) -> None:
        """Execute one step; raise ``OracleFailure`` on any oracle violation or crash."""
        try:
            getattr(self, "_step_" + step["op"])(step)
        except OracleFailure as f:
            if f.step is None:
                f.step = self.index
            raise
        except CaptureError as exc:
            raise OracleFailure("host-sync", f"capture failed: {exc}", self.index,
                                {"traceback": traceback.format_exc(limit=8)}) from exc
        except Exception as exc:  # any backend error is a finding, with its traceback kept
            raise OracleFailure("crash", f"{type(exc).__name__}: {exc}", self.index,
                                {"traceback": traceback.format_exc(limit=12)}) from exc
        finally:
            self.index += 1

    def _eager_step(self, step: dict, pad_to, poison: bool, check: bool) -> None:
        draw = step["batch"]
        batch = self.world.make_batch(draw, pad_to)
        self.world.reset_cache(poison, self.world.used_pages(batch))
        before = self.world.kv_cache.clone()
        meta = self.backend.build(batch)
        q, hidden, positions = self._inputs(batch.padded_size, batch, draw, poison)
        log = OpLog()
        try:
            outs = [t.clone() for t in self._audited(lambda: self._forward(q, hidden, positions, meta), log)]
        finally:
            self._check_contiguity(log, f"{step['op']} forward")
        if not check:
            return
        self._check_integrity(before, batch, "eager forward")
        after = self.world.kv_cache.clone()
        self.world.kv_cache.copy_(before)
        # same NaN fill of uninitialised memory as the first run, or leftovers would differ
        again = self._audited(lambda: self._forward(q, hidden, positions, meta), OpLog())
        for a, b in zip(outs, again):
            m = compare_bitwise(b, a)
            if m is not None:
                raise OracleFailure("determinism", m.describe("eager forward run twice"), self.index,
                                    {"rows": m.rows})
        self.world.kv_cache.copy_(after)
        self._check_finite(outs, batch, "eager")
        self._check_reference(outs, self._reference(batch, q, hidden, positions, before), batch, "eager")

    def _step_eager(self, step: dict) -> None:
        self._eager_step(step, step.get("pad_to"), bool(step.get("poison")), check=True)

    def _step_warmup(self, step: dict) -> None:
        self._eager_step(step, step["size"], False, check=False)

    def _step_capture(self, step: dict) -> None:
        """Capture at size S after ``warmups`` eager forwards of the same batch. With
        ``share`` the warmups and the capture use ONE build (what vLLM does per capture
        size), else each warmup gets its own build and the capture a fresh one."""
        size, draw = step["size"], step["batch"]
        warmups, share = int(step.get("warmups", 0)), bool(step.get("share", False))
        if size in self.captures:
            _release(self.captures.pop(size).graph)
        batch = self.world.make_batch(draw, size)
        self.world.reset_cache(False)
        q, hidden, positions = self._inputs(size, batch, draw, False)
        meta = self.backend.build(batch) if share else None
        for _ in range(warmups):
            log = OpLog()
            m = meta if share else self.backend.build(batch)
            try:
                self._audited(lambda: self._forward(q, hidden, positions, m), log)
            finally:
                self._check_contiguity(log, "warmup forward")
            self.world.reset_cache(False)
        if meta is None:
            meta = self.backend.build(batch)
        log = OpLog()
        fn = lambda: self._forward(q, hidden, positions, meta)  # noqa: E731
        try:
            graph = self.runner.capture(lambda: self._audited(fn, log))
        finally:
            self._check_contiguity(log, "capture")
        read = log.read_ptrs()
        meta_ptrs = {p: t.data_ptr() for p, t in tensor_fields(meta).items() if t.data_ptr() in read}
        self.captures[size] = Captured(size, graph, q, hidden, positions, meta, meta_ptrs, log, batch, self.index)

    def _step_replay(self, step: dict) -> None:
        size, draw, poison = step["size"], step["batch"], bool(step.get("poison"))
        cap = self.captures.get(size)
        if cap is None:
            raise ValueError(f"replay of size {size} before any capture of that size")
        batch = self.world.make_batch(draw, size)
        self.world.reset_cache(poison, self.world.used_pages(batch))
        meta = self.backend.build(batch)
        if self.mode != "eager":
            self._audit_addresses(cap, meta)
        q, hidden, positions = self._inputs(size, batch, draw, poison, cap.q, cap.hidden, cap.positions)
        before = self.world.kv_cache.clone()
        if self.mode == "eager":
            # No graph: an engine in eager mode hands forward the new metadata every step.
            log = OpLog()
            replayed = [t.clone() for t in self._audited(lambda: self._forward(q, hidden, positions, meta), log)]
            self._check_contiguity(log, "eager replay")
        else:
            outs = cap.graph.replay()
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            replayed = [t.clone() for t in outs]
        self._check_integrity(before, batch, f"replay of graph {size}")
        after = self.world.kv_cache.clone()
        self.world.kv_cache.copy_(before)
        log = OpLog()
        eager = [t.clone() for t in self._audited(lambda: self._forward(q, hidden, positions, meta), log)]
        self._check_contiguity(log, "eager forward of the replayed batch")
        self.world.kv_cache.copy_(after)
        B = batch.batch_size
        self._check_finite(replayed, batch, f"replay of graph {size}")
        for name, r, e in zip(("out", "lse"), replayed, eager):
            m = compare_bitwise(r[:B], e[:B])
            if m is not None:
                raise OracleFailure("replay-eager", m.describe(f"replay of graph {size} vs eager, {name}"),
                                    self.index, {"rows": m.rows, "size": size})
        self._check_reference(eager, self._reference(batch, q, hidden, positions, before), batch,
                              f"replay step (eager forward, padded to {size})")

    def _audit_addresses(self, cap: Captured, meta) -> None:
        """Oracle 4: each metadata tensor the captured graph reads keeps its address."""
        now = tensor_fields(meta)
        for path, ptr in cap.meta_ptrs.items():
            t = now.get(path)
            if t is not None and t.data_ptr() != ptr:
                raise OracleFailure(
                    "address", f"metadata field '{path}' was at 0x{ptr:x} when graph {cap.size} was captured "
                    f"(and the graph reads it), but build() for this step returned it at 0x{t.data_ptr():x}: "
                    f"the replay keeps reading the capture-time tensor", self.index,
                    {"field": path, "size": cap.size})


@contextlib.contextmanager
def nan_fill_uninitialised():
    """PyTorch's deterministic mode fills ``empty`` tensors with NaN (ints: max value), so
    a kernel that leaves output uninitialised shows NaN every time instead of whatever the
    allocator recycled — the eager twin of the graph runners' ``poison_empty``."""
    import torch.utils.deterministic as det

    # torch._C's setter, not torch.use_deterministic_algorithms: the public one also
    # imports torch._inductor (about 5 s on first use, in every worker process).
    prev = (torch._C._get_deterministic_algorithms(), torch._C._get_deterministic_algorithms_warn_only(),
            det.fill_uninitialized_memory)
    torch._C._set_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch._C._set_deterministic_algorithms(prev[0], warn_only=prev[1])
        det.fill_uninitialized_memory = prev[2]


def _release(graph) -> None:
    for name in ("reset", "close"):
        fn = getattr(graph, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:
                pass
            return


def run_steps(backend_cls, cfg: ScenarioConfig, steps: list[dict], graph_mode: str = "auto", device=None,
              strict_contiguity: bool = True) -> OracleFailure | None:
    """Run a whole scenario; the first oracle failure (or None)."""
    runner = ScenarioRunner(backend_cls, cfg, graph_mode, device, strict_contiguity)
    try:
        for step in steps:
            runner.apply(step)
    except OracleFailure as f:
        return f
    finally:
        runner.close()
    return None

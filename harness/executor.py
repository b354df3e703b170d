"""Runs a scenario's steps against one backend and checks the oracles after each step.

``ScenarioRunner.apply(step)`` is the single entry point used both by the Hypothesis
state machine (search) and by ``harness.repro`` (deterministic replay), so a repro
re-executes exactly what the search executed.

Steps: ``eager`` (a forward, optionally padded and poisoned), ``warmup`` (an eager forward
at a capture size, unchecked, as engines do before capture), ``capture`` (build, optional
warmups, capture at size S), ``replay`` (a new batch built into the same persistent buffers,
the graph replayed, then an eager forward of the same inputs). Every forward is checked for
its output contract and metadata contiguity; after the forwards of a step the oracles of
``oracles.ORACLES`` run in their declared order (``_run_oracles``): the table is in
docs/design.md.

A forward is a step's ``config.layers`` attention layers on ONE build, as an engine's
decoder stack runs them: layer ``l`` with its own KV cache (``World.kv_caches[l]``) and
queries (in the layer path its own weights, its hidden input layer ``l - 1``'s output). A
graph captures all of them; every layer's outputs are kept, uncloned, until the last layer
ran, then cloned, so an output buffer shared across layers shows. Every oracle judges every
layer, and a failure in a multi-layer step names it ("layer 2 of 3: ...").
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass

import torch

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import DecodeBatch

from . import memory_guard
from .audit import OpAudit, OpLog, tensor_fields
from .blame import (CUSTOM_OP_DOC, DeviceOutOfMemory, InternalError, call_backend, defined_at, find_oom, first_line,
                    judge, out_of_memory)
from .graphs import default_device, make_runner
from .loading import make_backend
from .oracles import (ORACLES, OracleFailure, check_contract, check_layer, check_out_lse, compare_bitwise,
                      compare_close, nonfinite_rows, replay_tolerances)
from .scenario import ScenarioConfig
from .world import World


@dataclass
class Captured:
    size: int
    graph: object
    q: list  # one query tensor per layer run
    hidden: torch.Tensor | None
    positions: torch.Tensor | None
    meta: object
    meta_ptrs: dict
    # tensors the graph reads that the backend object holds (outside the metadata), by path
    backend_ptrs: dict
    log: OpLog
    batch: DecodeBatch
    step: int


@dataclass
class Outcome:
    """One forward's results and what the oracles need to judge them. ``outs`` is what the
    step produced (the replay's outputs, or the eager forward's), ``eager`` an eager forward
    of the same batch and inputs, ``before``/``after`` the KV cache around the step."""

    batch: DecodeBatch
    q: list | None  # one query tensor per layer run
    hidden: torch.Tensor | None
    positions: torch.Tensor | None
    meta: object
    before: torch.Tensor | None  # the KV pool (every layer's cache)
    after: torch.Tensor | None
    outs: list | None  # flat: each layer's outputs in turn (``ScenarioRunner.per_layer``)
    eager: list | None
    what: str
    size: int | None = None


class StepUnsupported(Exception):
    """The backend declined the step's input (``mla_ref.Unsupported`` or a plain
    ``NotImplementedError``): counted by the search, never a finding."""

    def __init__(self, reason: str, site: str | None, declared: bool):
        super().__init__(reason)
        self.reason = reason
        self.site = site
        self.declared = declared


def raise_if_environment_oom(exc: BaseException, where: str) -> None:
    """Raise ``DeviceOutOfMemory`` when ``exc`` is the GPU running out of memory and that is
    the environment's doing (``blame.OOM_IS_ENVIRONMENT``), not a finding."""
    oom = out_of_memory(exc)
    if oom is not None:
        raise DeviceOutOfMemory(f"{where}: {first_line(oom)}") from None


class ScenarioRunner:
    """One backend instance, one KV pool, one graph runner; steps applied in order.

    ``strict_contiguity``: judge every tensor handed to a kernel (the old, strict audit)
    instead of only those viewing the builder's metadata. ``capture_build``: let capture
    steps call the backend's ``build_for_capture`` when it has one (the diagnosis turns it
    off to tell a capture path that diverges from the replay path). ``layers``: the layer
    indices a forward runs (default all ``cfg.layers``; the diagnosis runs one alone).
    ``eager_own_build``: the eager forward that checks a replay, and the second run of an
    eager forward (the determinism oracle), get a build of their own instead of the first
    forward's (the diagnosis: does a forward change what a second forward on its build
    reads?). ``skip_oracles``: oracle names not run (the diagnosis sets ``replay-eager`` aside
    to see which side of a replay's check the reference blames)."""

    def __init__(self, backend_cls, cfg: ScenarioConfig, graph_mode: str = "auto", device=None,
                 strict_contiguity: bool = False, capture_build: bool = True, layers=None,
                 eager_own_build: bool = False, skip_oracles=()):
        cfg.validate()
        self.active = tuple(range(cfg.layers)) if layers is None else tuple(int(i) for i in layers)
        if not self.active or any(not 0 <= i < cfg.layers for i in self.active):
            raise ValueError(f"layers must be indices in [0, {cfg.layers}), got {layers!r}")
        memory_guard.install_for_interpreter()
        self.cfg = cfg
        self.caps = mla_ref.capabilities_of(backend_cls)
        # Graph-pool allocations are NaN-filled (deterministic-mode fill) so a kernel that
        # leaves padded output uninitialised is loud, as vLLM #37442 was in production.
        self.runner = (make_runner(graph_mode, device) if graph_mode == "eager"
                       else make_runner(graph_mode, device, poison_empty=True))
        self.mode = self.runner.mode
        if device is None:  # as fuzz() places a scenario: eager on a GPU runs there
            device = default_device(self.mode)
        self.device = torch.device(device)
        self.world = World(cfg, self.device)
        self.spec = self.world.spec
        self.backend_cls = backend_cls
        self.index = 0
        self.backend = self._new_backend()
        self.layer = None
        self.stack: dict = {}  # layer index -> MLADecodeLayer (the layer path)
        if cfg.layer:
            from mla_fuzz.harness.layer import MLADecodeLayer
            self.stack = {i: MLADecodeLayer(self.spec, self.world.layer_weights[i], self.backend) for i in self.active}
            self.layer = self.stack[self.active[0]]
        self.strict_contiguity = strict_contiguity
        self.capture_build = capture_build
        self.eager_own_build = eager_own_build
        self.skip_oracles = frozenset(skip_oracles)
        # with ``eager_own_build``: the metadata fields (paths) whose contents after the last
        # replay differ from what a new build of the same batch writes
        self.rewritten: list[str] = []
        # the outputs of the last replay, before any oracle looked at them (diagnosis experiment S)
        self.last_replay: list[torch.Tensor] | None = None
        self.captures: dict[int, Captured] = {}
        # coverage notes of the steps run so far ((key, value, amount)), drained by the search
        self._notes: list[tuple] = []
        # paths of tensors on the backend object that a build replaced (``_build``)
        self._rebuilt: set[str] = set()
        # pairs of layers whose outputs of the current step share memory (``_shared_outputs``)
        self._shared: list = []

    def _new_backend(self):
        cfg = self.cfg
        try:
            return self._construct()
        except Exception as exc:
            raise_if_environment_oom(exc, "building the backend")
            raise self._finding(exc) from None

    def _construct(self):
        cfg = self.cfg
        return call_backend(make_backend, self.backend_cls, self.spec, device=self.device, max_batch=cfg.max_batch,
                            capture_sizes=cfg.capture_sizes, graph_safe=self.mode != "eager",
                            page_size=cfg.page_size, max_blocks_per_seq=cfg.max_pages_per_seq,
                            next_n_max=cfg.next_n, num_blocks=self.world.num_blocks,
                            **({"topk_max": cfg.topk, "indexer": self.world.indexer} if cfg.sparse else {}))

    def _build(self, fn, batch: DecodeBatch):
        """Call the backend's ``build`` / ``build_for_capture``, noting which tensors held on
        the backend object it replaced (the address audit's evidence for state kept outside
        the metadata; a tensor a forward replaces is the forward's business)."""
        before = {p: t.data_ptr() for p, t in tensor_fields(self.backend, "backend").items()}
        meta = call_backend(fn, batch)
        after = tensor_fields(self.backend, "backend")
        self._rebuilt.update(p for p, t in after.items() if before.get(p) != t.data_ptr())
        return meta

    def take_notes(self) -> list[tuple]:
        """Coverage notes ``(key, value, amount)`` gathered since the last call (how many
        real rows the backend split, when it says: its optional ``kv_splits``)."""
        notes, self._notes = self._notes, []
        return notes

    def _note_splits(self, meta) -> None:
        """Ask the backend how it split the step just run (``kv_splits(metadata)``: pieces
        per real row; optional, for coverage only) and note it."""
        fn = getattr(self.backend, "kv_splits", None)
        if not callable(fn):
            return
        got = call_backend(fn, meta)
        try:
            pieces = [int(p) for p in got]
        except (TypeError, ValueError):
            raise OracleFailure("contract", f"{type(self.backend).__name__}.kv_splits(metadata) (at {defined_at(fn)}) "
                                f"must return one int per real row (the pieces its keys were cut into), got "
                                f"{type(got).__name__}; docs/backends.md#kv_splits-optional", self.index,
                                {"site": defined_at(fn)}) from None
        split = sum(1 for p in pieces if p > 1)
        self._notes += [("split", "rows", len(pieces)), ("split", "rows split", split)]
        if split:
            self._notes.append(("split", "steps split", 1))

    def close(self) -> None:
        """Release the graphs and let go of the scenario's tensors (KV pool, weights, the
        backend and its buffers, kept outputs). Hypothesis keeps a finished example's state
        machine, and the tracebacks of its failures, in reference cycles that only a full
        garbage collection frees, and Python collects by object counts, not by GPU memory:
        a DeepSeek-V3 shrink held 38 GiB of finished scenarios (a 375 MB weight copy each)
        and its neighbours ran out of memory. A closed runner answers only ``rewritten``."""
        for cap in self.captures.values():
            _release(cap.graph)
        self.captures.clear()
        self.world = self.backend = self.layer = None
        self.stack = {}
        self._shared = []

    # -- plumbing ------------------------------------------------------------------------
    @property
    def arity(self) -> int:
        """Tensors a forward returns per layer: 1 (the layer's output, or ``out`` of a
        backend without lse) or 2 (``out, lse``)."""
        return 1 if self.layer is not None or self.caps.lse is None else 2

    def per_layer(self, outs) -> list[tuple[int, list]]:
        """``[(layer index, that layer's outputs)]`` of a forward's flat output list."""
        k = self.arity
        return [(i, list(outs[j * k:(j + 1) * k])) for j, i in enumerate(self.active)]

    def layer_tag(self, i: int) -> str:
        """``"layer 2 of 3: "`` in a multi-layer scenario, else ``""``."""
        return f"layer {i + 1} of {self.cfg.layers}: " if self.cfg.layers > 1 else ""

    def _named(self, f: OracleFailure, i: int) -> OracleFailure:
        """``f`` with its message naming layer ``i`` (multi-layer scenarios)."""
        tag = self.layer_tag(i)
        if not tag or f.message.startswith(tag):
            return f
        g = OracleFailure(f.oracle, tag + f.message, f.step, dict(f.evidence or {}, layer=i))
        g.__cause__ = f.__cause__
        return g

    def _forward(self, q, hidden, positions, meta):
        """The backend's forward over the step's layers on one build, as one flat tuple of
        tensors: per layer ``(layer_out,)``, ``(out,)`` when it declares no lse, else ``(out,
        lse)`` with lse natural-log (a base-2 lse is converted here, inside the graph, so
        replays convert too). ``q``: one query tensor per layer. The output contract is
        checked first (``oracles.check_contract``). Each layer's outputs are kept as returned
        (no copy) until every layer ran: the caller clones them after."""
        outs = []
        h = hidden
        for i, qi in zip(self.active, q):
            kv = self.world.kv_caches[i]
            if self.layer is not None:
                h = call_backend(self.stack[i], h, positions, kv, meta, fp8_out=self.cfg.fp8_out)
                outs.append(h)
                continue
            got = call_backend(self.backend.forward, qi, kv, meta)
            try:
                out, lse = check_contract(got, qi, self.spec, self.caps, self.index)
            except OracleFailure as f:
                raise self._named(f, i) from None
            outs.append(out)
            if lse is not None:
                if self.caps.lse == "base2":
                    lse = lse * 0.6931471805599453  # log2 -> ln: ln x = log2 x * ln 2
                outs.append(lse)
        return tuple(outs)

    def _shared_outputs(self, *forwards) -> list:
        """``[(i, j)]``: layers whose outputs, as one forward returned them, overlap in memory
        (one output buffer handed to several layers); the failure's evidence."""
        pairs = set()
        for outs in forwards:
            spans = [(i, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                     for i, lo in self.per_layer(outs) for t in lo if t.numel()]
            pairs |= {(i, j) for i, a0, b0 in spans for j, a1, b1 in spans if i < j and a0 < b1 and a1 < b0}
        return sorted(pairs)

    def _audited(self, fn, log: OpLog):
        with nan_fill_uninitialised(), OpAudit(log):
            return fn()

    def _check_contiguity(self, log: OpLog, where: str, meta=None) -> None:
        """Oracle 5. By default only views of the builder's metadata count (vLLM #42135's
        class); q, the KV cache and outputs read through their strides are the kernel's
        business. ``strict_contiguity`` judges every tensor a kernel gets."""
        storages = None
        if not self.strict_contiguity:
            storages = {t.untyped_storage().data_ptr() for t in tensor_fields(meta).values()}
        bad = log.noncontiguous(storages)
        if bad:
            what = "tensor" if self.strict_contiguity else "view of the metadata build() returned"
            raise OracleFailure("contiguity", f"{where}: non-contiguous {what} handed to a kernel that may "
                                f"index it flat: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""),
                                self.index, {"noncontiguous": bad})

    def _inputs(self, pad: int, batch: DecodeBatch, draw: dict, poison: bool, q=None, hidden=None, positions=None):
        """The step's inputs, written into ``q`` (one tensor per layer run), ``hidden`` and
        ``positions`` when given (a graph's persistent inputs), else into new tensors."""
        if q is None:
            q = [self.world.new_q(pad) for _ in self.active]
        for i, qi in zip(self.active, q):
            self.world.fill_q(qi, draw, batch.batch_size, poison, layer=i)
        if self.layer is not None:
            if hidden is None:
                hidden, positions = self.world.new_hidden(pad)
            self.world.fill_hidden(hidden, positions, batch, draw, poison)
        return q, hidden, positions

    def _reference(self, batch: DecodeBatch, q, hidden, positions, cache_before: torch.Tensor, outs=None):
        """The fp64 reference of every layer run: ``[(layer index, (out, lse) or (layer_out,))]``
        from that layer's queries (the layer path: its weights and its input, layer ``l - 1``'s
        output in ``outs``, the forward judged) and its cache before the step (``cache_before``:
        the KV pool)."""
        B, dev = batch.batch_size, self.device
        bt, sl, ql = (batch.block_table.to(dev), batch.seq_lens.to(dev), batch.q_lens.to(dev))
        scale = {} if batch.k_scale is None else {"k_scale": batch.k_scale}
        refs = []
        h = hidden
        per = self.per_layer(outs) if outs is not None else [(i, None) for i in self.active]
        for (i, layer_outs), qi in zip(per, q):
            cache0 = cache_before[i]
            if self.layer is not None:
                refs.append((i, (mla_ref.mla_layer_decode_absorbed(
                    self.world.layer_weights[i], h[:B], positions[:B], cache0.clone(), bt, sl,
                    batch.slot_mapping.to(dev), spec=self.spec, q_lens=ql, fp8_out=self.cfg.fp8_out, **scale),)))
                h = layer_outs[0]  # the next layer's input: this layer's output, as the forward had it
                continue
            # sparse steps: attention over exactly the selected slots (dense steps unchanged)
            indices = None
            if batch.topk_on_device:
                indices = mla_ref.indexer_topk(self.world.indexer, qi[:B], cache0, bt, sl, ql, batch.topk,
                                               spec=self.spec, **scale).to(dev)
            elif batch.is_sparse:
                indices = batch.dense_topk().to(dev)
            refs.append((i, mla_ref.mla_decode(qi[:B], cache0, bt, sl, spec=self.spec, q_lens=ql, indices=indices,
                                               **scale)))
        return refs

    def _check_reference(self, outs, refs, batch: DecodeBatch, what: str, side: str) -> None:
        """Each layer's ``outs`` against the reference; a failure's evidence says which forward
        was checked (``checked``: ``eager`` or ``replay``), as the diagnosis asks."""
        B = batch.batch_size
        for (i, lo), (_, ref) in zip(self.per_layer(outs), refs):
            try:
                if self.layer is not None:
                    check_layer(lo[0][:B], ref[0], what, self.index, self.cfg.fp8_out)
                else:
                    check_out_lse(lo[0][:B], lo[1][:B] if len(lo) > 1 else None, ref[0], ref[1], what, self.index)
            except OracleFailure as f:
                f.evidence = dict(f.evidence or {}, checked=side)
                raise self._named(f, i) from None

    def _check_finite(self, outs, batch: DecodeBatch, what: str, side: str) -> None:
        # Zero-length rows and padding tokens are defined as exact zeros; only NaN/inf in real
        # rows count.
        B = batch.batch_size
        for i, lo in self.per_layer(outs):
            rows = nonfinite_rows(lo[0][:B]) if B else []
            if rows:
                raise OracleFailure("finite", f"{self.layer_tag(i)}{what}: non-finite values in real rows {rows}",
                                    self.index, {"rows": rows, "layer": i, "checked": side})

    def _check_integrity(self, before: torch.Tensor, batch: DecodeBatch, what: str, after: torch.Tensor) -> None:
        """Slots this step does not write are bitwise unchanged in every layer's cache (``after``
        vs ``before``: the KV pool); a layer not run (the diagnosis runs one alone) writes none."""
        ps = self.cfg.page_size
        for i in range(self.cfg.layers):
            now = after[i].view(torch.uint8).reshape(self.world.num_blocks * ps, -1)
            old = before[i].view(torch.uint8).reshape(self.world.num_blocks * ps, -1)
            changed = (now != old).any(dim=1)
            if self.layer is not None and i in self.active:
                slots = batch.slot_mapping[batch.slot_mapping >= 0].to(changed.device)
                changed[slots] = False
            if bool(changed.any()):
                idx = changed.nonzero().flatten().cpu().tolist()
                pages = sorted({s // ps for s in idx})
                raise OracleFailure("integrity", f"{self.layer_tag(i)}{what}: {len(idx)} KV slots not written by "
                                    f"this step changed (first slots {idx[:6]}, pages {pages[:6]}; null block is "
                                    f"page 0)", self.index, {"slots": idx[:64], "pages": pages, "layer": i})

    # -- steps ---------------------------------------------------------------------------
    def apply(self, step: dict) -> None:
        """Execute one step; raise ``OracleFailure`` on any oracle violation or backend error,
        ``StepUnsupported`` when the backend declines the input."""
        self._shared = []
        try:
            getattr(self, "_step_" + step["op"])(step)
        except (OracleFailure, StepUnsupported) as f:
            if isinstance(f, OracleFailure) and f.step is None:
                f.step = self.index
            raise
        except Exception as exc:
            raise_if_environment_oom(exc, f"step {self.index} ({step['op']})")
            raise self._finding(exc) from exc
        finally:
            self.index += 1

    def _finding(self, exc: BaseException) -> Exception:
        """What an exception raised by a step means (``harness.blame``): an oracle failure
        raised inside a capture (unwrapped), an unsupported input, a host read in a
        capture, a Triton launch the emulator cannot record, or the backend's own error."""
        from .blame import chain
        for e in chain(exc):
            if isinstance(e, OracleFailure):
                return e
        v = judge(exc, self.backend_cls)
        oob = next((e for e in chain(exc) if isinstance(e, memory_guard.OutOfBounds)), None)
        if oob is not None and v.site is not None:
            return OracleFailure("bounds", f"{oob} (at {v.site})", self.index,
                                 {"site": v.site, "exc_type": "OutOfBounds",
                                  "traceback": "".join(traceback.format_exception(type(oob), oob, oob.__traceback__,
                                                                                  limit=-12))})
        if v.kind == "internal":
            oom = find_oom(exc)
            if oom is not None:
                # the harness's own tensors (reference, pools) did not fit: never the backend's
                # finding nor a harness bug, whoever else holds the GPU
                raise DeviceOutOfMemory(f"step {self.index}: mla-fuzz's own allocation: {first_line(oom)}") from None
            raise InternalError(f"mla-fuzz itself failed ({v.reason}); please report it with this traceback") from exc
        where = f" (at {v.site})" if v.site else ""
        tb = "".join(traceback.format_exception(type(v.origin), v.origin, v.origin.__traceback__, limit=-12))
        evidence = {"traceback": tb, "site": v.site, "exc_type": type(v.origin).__name__}
        if v.kind == "unsupported":
            from mla_fuzz.mla_ref import Unsupported
            return StepUnsupported(v.reason, v.site, isinstance(v.origin, Unsupported))
        if v.kind == "custom-op":
            return OracleFailure("custom-op", f"{v.reason}{where}. Under --graph emulated every kernel must "
                                 f"be a dispatched op: register the launcher with torch.library.custom_op "
                                 f"(see {CUSTOM_OP_DOC}), or fuzz with --graph cuda on a GPU", self.index, evidence)
        if v.kind == "host-sync":
            return OracleFailure("host-sync", f"capture failed on a host read or sync{where}: {v.reason}",
                                 self.index, evidence)
        return OracleFailure("backend-error", f"{v.reason}{where}", self.index, evidence)

    def _eager_step(self, step: dict, pad_to, poison: bool, check: bool) -> None:
        draw = step["batch"]
        batch = self.world.make_batch(draw, pad_to)
        self.world.reset_cache(poison, self.world.used_pages(batch))
        before = self.world.kv_pool.clone()
        meta = self._build(self.backend.build, batch)
        q, hidden, positions = self._inputs(batch.padded_size, batch, draw, poison)
        log = OpLog()
        try:
            raw = self._audited(lambda: self._forward(q, hidden, positions, meta), log)
            self._shared = self._shared_outputs(raw)
            outs = [t.clone() for t in raw]  # after every layer ran: one buffer for two layers shows
            del raw
        finally:
            self._check_contiguity(log, f"{step['op']} forward", meta)
        if check:
            self._run_oracles("eager", Outcome(batch, q, hidden, positions, meta, before,
                                               self.world.kv_pool.clone(), outs, outs, "eager"))
            self._note_splits(meta)

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
        # engines keep a capture-time path (vLLM's build_for_cudagraph_capture, SGLang's
        # init_forward_metadata_capture_cuda_graph): the capture and the warmups sharing its
        # build take it; replays and eager steps take build()
        capture_build = getattr(self.backend, "build_for_capture", None)
        if not (self.capture_build and callable(capture_build)):
            capture_build = self.backend.build
        meta = self._build(capture_build, batch) if share else None
        for _ in range(warmups):
            log = OpLog()
            m = meta if share else self._build(self.backend.build, batch)
            try:
                self._audited(lambda: self._forward(q, hidden, positions, m), log)
            finally:
                self._check_contiguity(log, "warmup forward", m)
            self.world.reset_cache(False)
        if meta is None:
            meta = self._build(capture_build, batch)
        log = OpLog()
        fn = lambda: self._forward(q, hidden, positions, meta)  # noqa: E731
        try:
            graph = self.runner.capture(lambda: self._audited(fn, log))
        finally:
            self._check_contiguity(log, "capture", meta)
        read = log.read_ptrs()
        meta_ptrs = {p: t.data_ptr() for p, t in tensor_fields(meta).items() if t.data_ptr() in read}
        held = tensor_fields(self.backend, "backend")
        backend_ptrs = {p: t.data_ptr() for p, t in held.items() if t.data_ptr() in read}
        self.captures[size] = Captured(size, graph, q, hidden, positions, meta, meta_ptrs, backend_ptrs, log, batch,
                                       self.index)

    def _step_replay(self, step: dict) -> None:
        self.last_replay = None  # a replay that fails before its graph runs leaves none
        size, draw, poison = step["size"], step["batch"], bool(step.get("poison"))
        cap = self.captures.get(size)
        if cap is None:
            raise ValueError(f"replay of size {size} before any capture of that size")
        batch = self.world.make_batch(draw, size)
        self.world.reset_cache(poison, self.world.used_pages(batch))
        meta = self._build(self.backend.build, batch)
        if self.mode != "eager":
            self._run_oracles("build", Outcome(batch, None, None, None, meta, None, None, None, None, "", size))
        q, hidden, positions = self._inputs(size, batch, draw, poison, cap.q, cap.hidden, cap.positions)
        before = self.world.kv_pool.clone()
        if self.mode == "eager":
            # No graph: an engine in eager mode hands forward the new metadata every step.
            log = OpLog()
            try:
                raw = self._audited(lambda: self._forward(q, hidden, positions, meta), log)
                self._shared = self._shared_outputs(raw)
                replayed = [t.clone() for t in raw]
                del raw
            finally:  # a kernel's own entry check may raise on the very view the audit reports
                self._check_contiguity(log, "eager replay", meta)
        else:
            try:
                outs = cap.graph.replay()
            except Exception:
                # The replay itself failed (a kernel's entry check, say): when an eager forward
                # of the same batch hands a kernel a non-contiguous metadata view, that is the
                # cause to report; otherwise the replay's own error is.
                log = OpLog()
                with contextlib.suppress(Exception):
                    self._audited(lambda: self._forward(q, hidden, positions, meta), log)
                self._check_contiguity(log, f"eager forward of the batch whose replay of graph {size} failed", meta)
                raise
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            self._shared = self._shared_outputs(outs)
            replayed = [t.clone() for t in outs]
        self.last_replay = replayed
        after = self.world.kv_pool.clone()
        self.world.kv_pool.copy_(before)
        log = OpLog()
        check_meta = self._own_build(batch, meta) if self.eager_own_build else meta
        try:
            raw = self._audited(lambda: self._forward(q, hidden, positions, check_meta), log)
            self._shared = sorted(set(self._shared) | set(self._shared_outputs(raw)))
            eager = [t.clone() for t in raw]
            del raw
        finally:
            self._check_contiguity(log, "eager forward of the replayed batch", meta)
        self.world.kv_pool.copy_(after)
        self._run_oracles("replay", Outcome(batch, q, hidden, positions, meta, before, after, replayed, eager,
                                            f"replay of graph {size}", size))
        self._note_splits(meta)

    # -- the oracles run after a forward, in the order ``oracles.ORACLES`` declares ----------
    def _run_oracles(self, phase: str, o: "Outcome") -> None:
        try:
            for oracle in ORACLES:
                if phase in oracle.phases and oracle.name not in self.skip_oracles:
                    getattr(self, "_oracle_" + oracle.name.replace("-", "_"))(phase, o)
        except OracleFailure as f:
            if self._shared and phase != "build":
                f.evidence = dict(f.evidence or {}, shared_outputs=list(self._shared))
            raise

    def _oracle_integrity(self, phase: str, o: "Outcome") -> None:
        self._check_integrity(o.before, o.batch, o.what if phase == "replay" else "eager forward", o.after)

    def _own_build(self, batch: DecodeBatch, used) -> object:
        """A new build of ``batch`` for a second forward (``eager_own_build``), noting in
        ``rewritten`` the metadata fields of ``used`` (the build a forward already ran on)
        whose contents now differ from what the new build writes."""
        before = {p: t.clone() for p, t in tensor_fields(used).items()}
        meta = self._build(self.backend.build, batch)
        fresh = tensor_fields(meta)
        self.rewritten = sorted(p for p, t in before.items() if p in fresh and (
            fresh[p].shape != t.shape or fresh[p].dtype != t.dtype or not torch.equal(fresh[p], t)))
        return meta

    def _oracle_determinism(self, phase: str, o: "Outcome") -> None:
        self.world.kv_pool.copy_(o.before)
        meta = self._own_build(o.batch, o.meta) if self.eager_own_build else o.meta
        # same NaN fill of uninitialised memory as the first run, or leftovers would differ
        again = self._audited(lambda: self._forward(o.q, o.hidden, o.positions, meta), OpLog())
        self.world.kv_pool.copy_(o.after)
        for (i, first), (_, second) in zip(self.per_layer(o.outs), self.per_layer(again)):
            for a, b in zip(first, second):
                m = compare_bitwise(b, a)
                if m is not None:
                    raise OracleFailure("determinism", self.layer_tag(i) + m.describe("eager forward run twice"),
                                        self.index, {"rows": m.rows, "layer": i})

    def _oracle_finite(self, phase: str, o: "Outcome") -> None:
        self._check_finite(o.outs, o.batch, o.what, "eager" if phase == "eager" else "replay")

    def _loose(self) -> bool:
        # the backend declares that its graph may run another valid schedule than eager (a
        # split count frozen at capture): replay vs eager at the dtype tolerance, and the
        # replay held to the reference on its own
        return self.caps.schedule_may_differ and self.layer is None

    def _oracle_replay_eager(self, phase: str, o: "Outcome") -> None:
        B = o.batch.batch_size
        for (i, replayed), (_, eager) in zip(self.per_layer(o.outs), self.per_layer(o.eager)):
            for name, r, e in zip(("out", "lse"), replayed, eager):
                if self._loose():
                    atol, rtol = replay_tolerances(name, r.dtype)
                    m = compare_close(r[:B], e[:B], atol, rtol)
                    text = None if m is None else m.describe(f"{o.what} vs eager, {name}", atol, rtol)
                else:
                    m = compare_bitwise(r[:B], e[:B])
                    text = None if m is None else m.describe(f"{o.what} vs eager, {name}")
                if m is not None:
                    raise OracleFailure("replay-eager", self.layer_tag(i) + text, self.index,
                                        {"rows": m.rows, "size": o.size, "layer": i})

    def _oracle_reference(self, phase: str, o: "Outcome") -> None:
        ref = self._reference(o.batch, o.q, o.hidden, o.positions, o.before, o.eager)
        what = "eager" if phase == "eager" else f"replay step (eager forward, padded to {o.size})"
        self._check_reference(o.eager, ref, o.batch, what, "eager")
        if phase == "replay" and self._loose():
            self._check_reference(o.outs, ref, o.batch, o.what, "replay")

    def _oracle_address(self, phase: str, o: "Outcome") -> None:
        self._audit_addresses(o.size, o.meta)

    def _audit_addresses(self, size: int, meta) -> None:
        """Each tensor the captured graph reads keeps its address: the metadata's fields, and
        the tensors the backend object itself holds (a builder that keeps this step's lengths
        on ``self`` instead of in the metadata)."""
        cap = self.captures[size]
        now = tensor_fields(meta)
        for path, ptr in cap.meta_ptrs.items():
            t = now.get(path)
            if t is not None and t.data_ptr() != ptr:
                raise OracleFailure(
                    "address", f"metadata field '{path}' was at 0x{ptr:x} when graph {cap.size} was captured "
                    f"(and the graph reads it), but build() for this step returned it at 0x{t.data_ptr():x}: "
                    f"the replay keeps reading the capture-time tensor; copy_ the step's values into the "
                    f"persistent buffer instead of returning a new tensor", self.index,
                    {"field": path, "size": cap.size})
        held = tensor_fields(self.backend, "backend")
        for path, ptr in cap.backend_ptrs.items():
            t = held.get(path)
            if t is not None and t.data_ptr() != ptr and path in self._rebuilt:
                attr = "self" + path[len("backend"):]
                raise OracleFailure(
                    "address", f"the backend's attribute '{attr}' ({type(self.backend).__name__}, outside the "
                    f"metadata) was at 0x{ptr:x} when graph {cap.size} was captured (and the graph reads it), but "
                    f"build() (at {defined_at(self.backend.build)}) replaced it with a new tensor at "
                    f"0x{t.data_ptr():x}: the replay keeps reading the capture-time tensor; write the step's "
                    f"values into the existing tensor (copy_) instead", self.index, {"field": attr, "size": cap.size})


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
              strict_contiguity: bool = False, capture_build: bool = True, layers=None,
              eager_own_build: bool = False) -> OracleFailure | None:
    """Run a whole scenario; the first oracle failure (or None). A step the backend declines
    (``StepUnsupported``) ends the run as a pass: nothing wrong was seen. ``layers``: the
    layer indices each forward runs (default: all of ``cfg.layers``); ``eager_own_build``:
    as ``ScenarioRunner``'s."""
    runner = None
    try:
        runner = ScenarioRunner(backend_cls, cfg, graph_mode, device, strict_contiguity, capture_build, layers,
                                eager_own_build)
        for step in steps:
            runner.apply(step)
    except OracleFailure as f:
        return f
    except StepUnsupported:
        return None
    finally:
        if runner is not None:
            runner.close()
    return None

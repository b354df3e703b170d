"""``TritonMLABackend``: a vLLM-style metadata builder + forward over the Triton kernels.

``build`` (host side, never captured) turns a ``DecodeBatch`` into ``TritonMLAMetadata``
by *copying* into persistent device buffers allocated once in ``__init__``; ``forward``
(device work only: no ``.item()``, no ``.tolist()``, no Python branching on device values)
launches planner -> split-KV decode -> combine, so a CUDA graph captured around
``forward`` contains the planner and re-plans on every replay from the buffers the next
``build`` refreshed.

Scheduler state: each build binds a *fresh* ``SchedState`` to the persistent plan buffers,
and ``forward`` re-plans unconditionally (``force=True``) instead of FlashMLA's lazy
"plan once per state". Both, because an engine may run warmup and capture on one build
(vLLM does): with the lazy contract the warmup would plan, the capture would skip the
planner, and every replay would reuse the warmup's plan (vLLM #42444). The persistent
plan buffers also keep every address the graph reads stable across builds.

Padding: rows ``B..pad-1`` get seq_len 0, no visible keys, block-table rows of
``batch.null_block`` and slot -1; the kernels never read their pages, never write their
slots, and the combine writes their output rows as exactly 0 / lse -inf, so stale or NaN
pool memory can never reach a batch-wide reduction (vLLM #37442).

FP8: the scales live inside each cache token (FlashMLA's layout), so there are no FP8
scale buffers to keep; the FP8 path shares every metadata buffer with bf16.

fp8_e4m3 (per-tensor-scaled float8_e4m3fn, vLLM / SGLang / FlashInfer's layout): the one
scale is the engine's device tensor ``batch.k_scale``. ``build`` copies it into the persistent
``k_scale`` buffer (allocated once, like every other one) and the kernels load it from there
when they run, so a graph captured around ``forward`` decodes with the scale of the latest
build, never the capture's. Hook: ``_stage_k_scale`` (a snapshot made per build, or a host
float, is the stale-scale bug).

Small overridable methods, so a bug class is a one-method subclass (``harness/mutants``):

- stale address, fresh metadata each build (vLLM #35175): ``_stage`` (return
  ``host.to(device)`` instead of copying), ``_fill_metadata`` (swap in clones) or
  ``_scratch`` (fresh plan buffers);
- laziness, shared lazy SchedState (#42444): ``_plan`` (plan only ``if not
  md.sched.planned``, FlashMLA's contract — caught when warmup and capture share a build;
  combine with a ``_make_sched`` returning one state for all builds to share across builds);
- contiguity, 2-D ``[:B, :max_decode_len]`` view of a ``[max_batch, next_n]`` buffer
  (#42135): ``_context_lens_view``;
- uninitialised padded output leaking through the FP8 amax (#37442): ``_combine`` (leave
  rows without keys unwritten);
- padded slot write (slot -1 not skipped): ``write_kv``;
- host-side split decision baked into the graph: ``_make_sched`` (a state whose ``plan``
  writes host-computed constants) or ``_plan``;
- ``.item()`` during capture: ``_plan`` or ``_decode``;
- NaN on zero-length rows: ``_combine`` (an unguarded 0/0 merge).

Sparse top-k decode (DeepSeek-V3.2 style, vLLM #42604's ragged selection): a batch may
carry its per-token top-k selection ragged (``topk_flat [nnz]`` + ``topk_indptr``, see
``DecodeBatch``). ``build`` converts it into the kernel's fixed-stride layout in the
persistent ``topk_indices`` buffer (``[pad*next_n, topk_max]``, capacity
``max_batch * next_n_max * topk_max``) plus per-request ``topk_length [pad]`` (FlashMLA's
contract: a fixed top-k per token, ``-1`` = invalid; ``topk`` for a request with real tokens,
0 otherwise). The sparse kernel reads, for every real token, the first ``topk_length[b]``
entries of its row and masks ``-1``: so **the builder writes
-1 past every row's entries, over the whole region any row can read**, on every build —
no entry a kernel reads ever depends on an earlier step's contents (no stale tail), and no
host sync is needed in ``forward`` (the row lengths are derived on the device from
``topk_length`` and the flat context-lens buffer). Hooks, one method per bug:

- ragged buffers allocated fresh each build (stale address): ``_stage_topk``;
- an nnz-sized copy leaving the previous step's tail: ``_stage_topk``;
- ``.item()`` on nnz in the forward (host sync during capture): ``_sparse_rows``;
- on-device selection (``batch.topk`` alone): ``_run_indexer`` fills ``topk_indices`` in the
  forward with the top-k indexer (``kernels.indexer``), reading per-token context lengths
  chosen at build time by ``_indexer_context_lens`` (the flat buffer's contiguous view;
  a 2-D ``[:B, :max_decode_len]`` slice is vLLM #42135);
- sparse plan / decode / combine: ``_make_sparse_sched``, ``_plan_sparse``, ``_decode_sparse``,
  ``_combine_sparse`` (separate from the dense hooks, so a dense-path mutant stays one bug).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Sequence, Union

import torch

from mla_fuzz.mla_ref import Capabilities, DecodeBatch, ModelSpec
from mla_fuzz.mla_ref.capabilities import ALL_KV_DTYPES

from . import ops
from .config import DecodeConfig, check_spec_supported
from .routes import default_config
from .decode import alloc_partials, alloc_sparse_partials, token_context
from .indexer import indexer_topk
from .sched import SchedState

__all__ = ["TritonMLABackend", "TritonMLAMetadata", "host_context_lens"]

_KV_TORCH = {"bf16": (torch.bfloat16,), "fp16": (torch.float16,), "fp8": (torch.uint8,),
             "fp8_e4m3": (torch.float8_e4m3fn,)}


def _cache_flags(kv_dtype: str) -> dict:
    """``default_config``'s cache keywords for a kv dtype (``fp8_e4m3`` only when set, so a
    stand-in ``default_config`` written before that keyword keeps working for the rest)."""
    return dict(fp8=True) if kv_dtype == "fp8" else dict(fp8_e4m3=True) if kv_dtype == "fp8_e4m3" else dict(fp8=False)


@dataclass
class TritonMLAMetadata:
    """One step's metadata. The tensor fields are exactly the device tensors ``forward``
    (and ``write_kv``) read; in graph-safe mode each is a view at offset 0 of a persistent
    buffer, so its ``data_ptr`` is the same for every build.

    - ``seq_lens`` int32 ``[pad]``; ``block_table`` int32 ``[pad, max_blocks_per_seq]``
    - ``ctx_lens`` int32 ``[pad, max_decode_len]``: keys visible to each MTP token (0 =
      padding token), a contiguous view of a flat 1-D buffer; ``ctx_width`` int32 ``[1]``
      holds ``max_decode_len`` for the kernel (so a replay follows the current width)
    - ``slot_mapping`` int64 ``[pad, next_n]`` (-1 = do not write)
    - ``part_info`` int32 ``[num_parts + 1, 3]``, ``num_splits`` / ``split_offsets`` int32
      ``[pad]`` (``[pad*next_n]`` rows for sparse): the plan, written by the planner inside ``forward``
    - sparse only (else None): ``topk_indices`` int32 ``[pad*next_n, topk_max]`` (row r =
      token ``r % next_n`` of request ``r // next_n``; ``-1`` past the row's entries),
      ``topk_length`` int32 ``[pad]``, ``topk_starts`` int32 ``[pad*next_n]`` (row offsets into
      the flat index buffer, constant) and ``topk_rows`` int32 ``[pad*next_n]`` (entries each row
      reads, written inside ``forward``)
    - fp8_e4m3 only (else None): ``k_scale`` fp32 ``[1]``, the cache's per-tensor scale copied
      from ``batch.k_scale`` at build; the kernels load it when they run
    """

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    ctx_lens: torch.Tensor
    ctx_width: torch.Tensor
    slot_mapping: torch.Tensor
    part_info: torch.Tensor
    num_splits: torch.Tensor
    split_offsets: torch.Tensor
    num_reqs: int
    padded_size: int
    next_n: int
    max_decode_len: int
    kv_dtype: str
    page_size: int
    config: DecodeConfig
    sched: Optional[SchedState] = field(default=None, repr=False)
    topk_indices: Optional[torch.Tensor] = None
    topk_length: Optional[torch.Tensor] = None
    topk_starts: Optional[torch.Tensor] = None
    topk_rows: Optional[torch.Tensor] = None
    topk: int = 0
    topk_on_device: bool = False
    indexer_ctx: Optional[torch.Tensor] = None
    k_scale: Optional[torch.Tensor] = None

    @property
    def sparse(self) -> bool:
        return self.topk_indices is not None

    def tensors(self) -> dict:
        """``{name: tensor}`` of the device tensor fields."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}


def host_context_lens(seq_lens: torch.Tensor, q_lens: torch.Tensor, width: int, pad: int) -> torch.Tensor:
    """Keys visible to each query token, on the host: int32 ``[pad, width]``.

    Real token ``i < q_lens[b]`` sees ``seq_lens[b] - q_lens[b] + i + 1`` keys (bottom-right
    causal); padding tokens and padded rows see 0.
    """
    B = seq_lens.shape[0]
    ctx = torch.zeros(pad, width, dtype=torch.int32)
    if B and width:
        i = torch.arange(width, dtype=torch.int64)
        seq = seq_lens.to(torch.int64)[:, None]
        ql = q_lens.to(torch.int64)[:, None]
        vis = (seq - ql + i + 1).clamp(min=0)
        ctx[:B] = torch.where(i < ql, vis, torch.zeros_like(vis)).to(torch.int32)
    return ctx


class TritonMLABackend:
    """The Triton MLA decode backend (``mla_ref.contract.DecodeBackend``).

    Args:
        spec: model dims (rank, rope and fp8_group powers of two, see ``check_spec_supported``).
        device: where buffers and kernels live (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        max_batch: largest padded batch a build may ask for.
        capture_sizes: the padded sizes graphs are captured at (all ``<= max_batch``).
        graph_safe: True = persistent buffers (addresses stable across builds); False =
            fresh tensors per build (fine eagerly, stale under graphs).
        next_n_max: largest MTP ``next_n``; sizes the flat context-lens and slot buffers.
        max_blocks_per_seq: block-table columns kept per request.
        page_size: if given, every batch must use it.
        config: launch config for every batch (default: ``default_config`` per ``next_n``, kv dtype
            and padded batch size;
            sparse batches: ``default_config(spec, 1, ...)``, one (request, token) row per unit).
        topk_max: largest top-k of a sparse batch; sizes the persistent index buffer (0 = dense only).
        indexer: ``mla_ref.IndexerWeights`` for batches whose top-k is selected on the device.
    """

    name = "triton"
    #: everything the fuzzer draws, the per-tensor fp8_e4m3 cache included (opt-in: not a default)
    capabilities = Capabilities(kv_dtypes=ALL_KV_DTYPES)

    def __init__(self, spec: ModelSpec, *, device: Union[str, torch.device] = "cuda", max_batch: int,
                 capture_sizes: Sequence[int] = (), graph_safe: bool = True, next_n_max: int = 4,
                 max_blocks_per_seq: int = 256, page_size: Optional[int] = None,
                 config: Optional[DecodeConfig] = None, topk_max: int = 0, indexer=None) -> None:
        check_spec_supported(spec)
        for nm, v in (("max_batch", max_batch), ("next_n_max", next_n_max), ("max_blocks_per_seq", max_blocks_per_seq)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{nm} must be a positive int, got {v!r}")
        capture_sizes = sorted(int(c) for c in capture_sizes)
        if capture_sizes and (capture_sizes[0] < 1 or capture_sizes[-1] > max_batch):
            raise ValueError(f"capture_sizes must lie in [1, max_batch={max_batch}], got {capture_sizes}")
        if page_size is not None and (not isinstance(page_size, int) or page_size < 1):
            raise ValueError(f"page_size must be a positive int or None, got {page_size!r}")
        if not isinstance(topk_max, int) or isinstance(topk_max, bool) or topk_max < 0:
            raise ValueError(f"topk_max must be an int >= 0, got {topk_max!r}")
        self.topk_max = topk_max
        self.spec = spec
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.capture_sizes = capture_sizes
        self.graph_safe = bool(graph_safe)
        self.next_n_max = next_n_max
        self.max_blocks_per_seq = max_blocks_per_seq
        self.page_size = page_size
        self.indexer = None if indexer is None else indexer.to(self.device)
        # a given config serves every batch; the defaults may depend on the padded batch size
        # (default_config's batch), so they are made per (next_n, kv dtype, padded size) on demand
        self._config = config
        self._configs: dict = {}
        self._max_parts: Optional[int] = None  # set by _alloc_buffers
        self._sparse_configs = {kv: (config or default_config(spec, 1, self.device, sparse=True, **_cache_flags(kv)))
                                for kv in _KV_TORCH}
        self._buffers: dict = {}
        self._alloc_buffers()

    # ------------------------------------------------------------------ buffers

    def _alloc_buffers(self) -> None:
        """Allocate every persistent buffer once (graph-safe mode reads only these)."""
        dev, mb, nn = self.device, self.max_batch, self.next_n_max
        # the plan's rows for any config a build can take: the given one, or the defaults at the
        # smallest and largest batches and with none (default_config's batch rule is a threshold)
        dense = [self.config_for(n, kv, b) for n in range(1, nn + 1) for kv in _KV_TORCH for b in (None, 1, mb)]
        max_parts = max(c.num_parts for c in dense + list(self._sparse_configs.values()))
        self._max_parts = max_parts
        i32 = dict(dtype=torch.int32, device=dev)
        # sparse plans have one row per (request, token): mb * nn rows
        plan_rows = mb * nn if self.topk_max else mb
        self._buffers = {
            "seq_lens": torch.zeros(mb, **i32),
            "block_table": torch.zeros(mb * self.max_blocks_per_seq, **i32),
            # flat 1-D: any (pad, width) prefix view is contiguous (vLLM #42135's fix)
            "ctx_lens": torch.zeros(mb * nn, **i32),
            "ctx_width": torch.zeros(1, **i32),
            "slot_mapping": torch.full((mb * nn,), -1, dtype=torch.int64, device=dev),
            "part_info": torch.zeros((max_parts + 1) * 3, **i32),
            "num_splits": torch.zeros(plan_rows, **i32),
            "split_offsets": torch.zeros(plan_rows, **i32),
            # the fp8_e4m3 scale the kernels read (copied from batch.k_scale at every build)
            "k_scale": torch.ones(1, dtype=torch.float32, device=dev),
        }
        if self.topk_max:
            rows = mb * nn
            self._buffers.update({
                "topk_indices": torch.full((rows * self.topk_max,), -1, **i32),
                "topk_length": torch.zeros(mb, **i32),
                "topk_rows": torch.zeros(rows, **i32),
                # row r's entries start at r * topk_max: constant, written once
                "topk_starts": torch.arange(rows, **i32) * self.topk_max,
            })

    def _flat_view(self, name: str, shape: tuple) -> torch.Tensor:
        """A contiguous ``shape`` view at offset 0 of persistent buffer ``name``."""
        n = 1
        for s in shape:
            n *= s
        buf = self._buffers[name]
        if n > buf.numel():
            raise ValueError(f"{name} needs {n} elements for shape {shape}, but its buffer holds {buf.numel()}")
        return buf[:n].view(shape)

    def _stage(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """Host tensor -> the device tensor forward reads: copied into persistent buffer
        ``name`` in graph-safe mode (stable address), a fresh device tensor otherwise."""
        if not self.graph_safe:
            return host.to(self.device)
        dst = self._flat_view(name, tuple(host.shape))
        dst.copy_(host)
        return dst

    def _scratch(self, name: str, shape: tuple) -> torch.Tensor:
        """Device-written metadata (the plan): persistent in graph-safe mode, else fresh."""
        if not self.graph_safe:
            return torch.empty(shape, dtype=self._buffers[name].dtype, device=self.device)
        return self._flat_view(name, shape)

    def _context_lens_view(self, pad: int, width: int) -> torch.Tensor:
        """Where this step's per-token context lengths go: ``[pad, width]`` int32, a
        contiguous prefix view of the flat buffer (the kernel indexes it flat)."""
        if not self.graph_safe:
            # fresh, but shaped like the persistent buffer: the planner and token_context read
            # it flat, pad * next_n_max elements, whatever this step's width
            flat = torch.zeros(pad * self.next_n_max, dtype=torch.int32, device=self.device)
            return flat[: pad * width].view(pad, width)
        return self._flat_view("ctx_lens", (pad, width))

    # ------------------------------------------------------------------ build

    def config_for(self, next_n: int, kv_dtype: str = "bf16", batch: Optional[int] = None) -> DecodeConfig:
        """The launch config used for dense batches of this ``next_n`` and ``kv_dtype``, padded to
        ``batch`` requests (None: a batch-independent default, ``default_config``'s)."""
        if not (isinstance(next_n, int) and 1 <= next_n <= self.next_n_max) or kv_dtype not in _KV_TORCH:
            raise ValueError(f"next_n must be in [1, next_n_max={self.next_n_max}] and kv_dtype one of "
                             f"{tuple(_KV_TORCH)}, got {next_n}, {kv_dtype!r}")
        if self._config is not None:
            return self._config
        key = (next_n, kv_dtype, batch)
        if key not in self._configs:
            cfg = default_config(self.spec, next_n, self.device, batch=batch, **_cache_flags(kv_dtype))
            if self._max_parts is not None and cfg.num_parts > self._max_parts:
                # the persistent plan buffer was sized at construction (_alloc_buffers)
                raise RuntimeError(f"default config for next_n={next_n}, {kv_dtype}, batch {batch} has "
                                   f"{cfg.num_parts} parts, more than the {self._max_parts} planned for")
            self._configs[key] = cfg
        return self._configs[key]

    def _check_batch(self, batch: DecodeBatch) -> None:
        if not isinstance(batch, DecodeBatch):
            raise ValueError(f"batch must be a DecodeBatch, got {type(batch).__name__}")
        batch.validate()
        if batch.padded_size > self.max_batch:
            raise ValueError(f"batch padded size {batch.padded_size} exceeds max_batch={self.max_batch}")
        if batch.next_n > self.next_n_max:
            raise ValueError(f"batch.next_n={batch.next_n} exceeds next_n_max={self.next_n_max}")
        if self.page_size is not None and batch.page_size != self.page_size:
            raise ValueError(f"batch.page_size must be {self.page_size} for this backend, got {batch.page_size}")
        if batch.is_sparse:
            k = batch.topk if batch.topk_on_device else batch.ragged_topk()[2]
            if batch.topk_on_device and self.indexer is None:
                raise ValueError("batch.topk without a selection needs the backend's top-k indexer "
                                 "(construct it with indexer=IndexerWeights)")
            if k > self.topk_max:
                raise ValueError(f"batch topk={k} exceeds this backend's topk_max={self.topk_max} "
                                 f"(construct it with topk_max >= {k} for sparse decode)")
        if batch.batch_size:
            pages = int(((batch.seq_lens.max() + batch.page_size - 1) // batch.page_size))
            if pages > self.max_blocks_per_seq:
                raise ValueError(f"a request needs {pages} pages but max_blocks_per_seq={self.max_blocks_per_seq}")

    def _fill_metadata(self, batch: DecodeBatch) -> TritonMLAMetadata:
        """Host side of ``build``: compute the padded host arrays and stage them."""
        B, pad = batch.batch_size, batch.padded_size
        next_n, width = batch.next_n, int(batch.max_decode_len)
        cfg = self.config_for(next_n, batch.kv_dtype, pad)

        seq = torch.zeros(pad, dtype=torch.int32)
        seq[:B] = batch.seq_lens.to(torch.int32)
        bt = torch.full((pad, self.max_blocks_per_seq), int(batch.null_block), dtype=torch.int32)
        cols = min(batch.block_table.shape[1], self.max_blocks_per_seq)
        bt[:B, :cols] = batch.block_table[:, :cols].to(torch.int32)
        slots = torch.full((pad, next_n), -1, dtype=torch.int64)
        slots[:B] = batch.slot_mapping.to(torch.int64)
        ctx_host = host_context_lens(batch.seq_lens, batch.q_lens, width, pad)

        ctx = self._context_lens_view(pad, width)
        ctx.copy_(ctx_host)
        sparse = {}
        if batch.is_sparse:
            cfg = self._sparse_configs[batch.kv_dtype]
            rows = pad * next_n
            if batch.topk_on_device:
                # written by the indexer inside forward; every request reads topk entries per token
                idx = self._scratch("topk_indices", (rows, self.topk_max))
                lens = self._stage("topk_length", torch.full((pad,), batch.topk, dtype=torch.int32))
            else:
                idx, lens = self._stage_topk(batch, pad)
            sparse = dict(topk_indices=idx, topk_length=lens, topk_starts=self._flat_view("topk_starts", (rows,)),
                          topk_rows=self._scratch("topk_rows", (rows,)), topk=int(batch.topk or batch.ragged_topk()[2]),
                          topk_on_device=batch.topk_on_device,
                          indexer_ctx=self._indexer_context_lens(ctx, pad, width) if batch.topk_on_device else None)
        plan_rows = pad * next_n if batch.is_sparse else pad
        k_scale = self._stage_k_scale(batch) if batch.kv_dtype == "fp8_e4m3" else None
        return TritonMLAMetadata(
            seq_lens=self._stage("seq_lens", seq),
            block_table=self._stage("block_table", bt),
            ctx_lens=ctx,
            ctx_width=self._stage("ctx_width", torch.tensor([width], dtype=torch.int32)),
            slot_mapping=self._stage("slot_mapping", slots),
            part_info=self._scratch("part_info", (cfg.num_parts + 1, 3)),
            num_splits=self._scratch("num_splits", (plan_rows,)),
            split_offsets=self._scratch("split_offsets", (plan_rows,)),
            num_reqs=B, padded_size=pad, next_n=next_n, max_decode_len=width,
            kv_dtype=batch.kv_dtype, page_size=batch.page_size, config=cfg, k_scale=k_scale, **sparse)

    def _stage_k_scale(self, batch: DecodeBatch) -> torch.Tensor:
        """``batch.k_scale`` (fp32 ``[1]``, the engine's device tensor) -> the tensor the kernels
        read: copied into the persistent buffer in graph-safe mode (a device-to-device copy, no
        host read), so every replay reads the latest build's scale from a fixed address."""
        if not self.graph_safe:
            return batch.k_scale.to(self.device, copy=True)
        dst = self._buffers["k_scale"]
        dst.copy_(batch.k_scale.reshape(1))
        return dst

    @staticmethod
    def host_topk(batch: DecodeBatch, pad: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's ragged selection in the kernel layout, on the host.

        Returns:
            ``(indices int32 [pad*next_n, width], topk_length int32 [pad])``: row ``b*next_n+i``
            holds token i's entries then ``-1`` up to ``width``; ``topk_length[b]`` is the
            batch's ``topk`` for a request with real tokens, 0 otherwise (padded rows). Rows
            of padding tokens are left all ``-1`` (no key: the contract ignores them).
        """
        flat, indptr, topk = batch.ragged_topk()
        B, n = batch.batch_size, batch.next_n
        host = torch.full((pad * n, width), -1, dtype=torch.int32)
        lens = (indptr[1:] - indptr[:-1]).to(torch.int64).reshape(B, n) if B else torch.zeros(0, n, dtype=torch.int64)
        real = torch.arange(n)[None, :] < batch.q_lens.to(torch.int64)[:, None]
        lens = torch.where(real, lens, torch.zeros_like(lens))
        starts = indptr[:-1].to(torch.int64)
        for r in (lens.reshape(-1) > 0).nonzero().flatten().tolist():
            k = int(lens.reshape(-1)[r])
            host[r, :k] = flat[starts[r]:starts[r] + k].to(torch.int32)
        tl = torch.zeros(pad, dtype=torch.int32)
        tl[:B] = torch.where(batch.q_lens > 0, topk, 0).to(torch.int32)
        return host, tl

    def _stage_topk(self, batch: DecodeBatch, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ragged selection -> persistent ``topk_indices [pad*next_n, topk_max]`` and
        ``topk_length [pad]``: the whole region is rewritten (entries then -1), so nothing the
        kernel reads is left over from an earlier step."""
        host, lens = self.host_topk(batch, pad, self.topk_max)
        return self._stage("topk_indices", host), self._stage("topk_length", lens)

    def _make_sched(self, md: TritonMLAMetadata) -> SchedState:
        """A fresh, unplanned scheduler state bound to this build's plan buffers."""
        return SchedState.over(md.config, md.part_info, md.num_splits, md.split_offsets)

    def _make_sparse_sched(self, md: TritonMLAMetadata) -> SchedState:
        """A fresh, unplanned scheduler state over this build's plan buffers (``pad*next_n`` rows)."""
        return SchedState.over(md.config, md.part_info, md.num_splits, md.split_offsets)

    def build(self, batch: DecodeBatch) -> TritonMLAMetadata:
        """Host side: validate ``batch`` and write it (padded to ``batch.padded_size``) into
        the metadata buffers. Launches no kernel; the plan is made inside ``forward``."""
        self._check_batch(batch)
        md = self._fill_metadata(batch)
        md.sched = self._make_sparse_sched(md) if md.sparse else self._make_sched(md)
        return md

    # ------------------------------------------------------------------ forward

    def _check_forward(self, q: torch.Tensor, kv_cache: torch.Tensor, md: TritonMLAMetadata,
                       out: Optional[torch.Tensor]) -> None:
        if not isinstance(md, TritonMLAMetadata):
            raise ValueError(f"metadata must be a TritonMLAMetadata from build(), got {type(md).__name__}")
        want = (md.padded_size, md.next_n, self.spec.num_heads, self.spec.d_qk)
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != want:
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be [pad={want[0]}, next_n={want[1]}, h={want[2]}, d_qk={want[3]}], got {got}")
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype not in _KV_TORCH[md.kv_dtype]:
            got = kv_cache.dtype if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
            raise ValueError(f"kv_cache dtype must match the batch's kv_dtype={md.kv_dtype!r}, got {got}")
        if kv_cache.dim() >= 2 and kv_cache.shape[1] != md.page_size:
            raise ValueError(f"kv_cache page size (dim 1) must be batch.page_size={md.page_size}, "
                             f"got {kv_cache.shape[1]}")

    def _plan(self, md: TritonMLAMetadata) -> None:
        """Launch the planner into the plan buffers — on every forward, never lazily, so it
        is part of any graph captured around ``forward`` (see the module doc)."""
        md.sched.plan(md.seq_lens, force=True)

    def _alloc_outputs(self, q: torch.Tensor, md: TritonMLAMetadata,
                       out: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if out is None:
            out = torch.empty(md.padded_size, md.next_n, self.spec.num_heads, self.spec.kv_lora_rank,
                              dtype=q.dtype, device=q.device)
        lse = torch.empty(md.padded_size, self.spec.num_heads, md.next_n, dtype=torch.float32, device=q.device)
        return out, lse

    def _decode(self, q, kv_cache, md: TritonMLAMetadata, out, lse, partial_o, partial_lse) -> None:
        """Split-KV decode over the plan (writes unsplit rows of out/lse and the partials)."""
        cfg, spec = md.config, self.spec
        ops.decode_split(q, kv_cache, md.block_table, md.seq_lens, md.ctx_lens, md.ctx_width, md.part_info,
                         md.num_splits, md.split_offsets, out, lse, partial_o, partial_lse, spec.softmax_scale,
                         spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group, cfg.block_m, cfg.block_n,
                         cfg.num_warps, cfg.num_stages, cfg.fp8_grouped, cfg.kernel, k_scale=md.k_scale)

    def _combine(self, md: TritonMLAMetadata, out, lse, partial_o, partial_lse) -> None:
        """Merge split rows and write 0 / -inf rows for requests without keys (all padded rows)."""
        ops.combine(partial_o, partial_lse, md.num_splits, md.split_offsets, out, lse, md.config.combine_block_m,
                    md.config.combine_col_blocks)

    def _sparse_rows(self, md: TritonMLAMetadata) -> None:
        """Entries each sparse row reads, on the device, into ``md.topk_rows``: request b's
        ``topk_length`` for its real tokens (visible context > 0 in the flat context-lens
        buffer), 0 for padding tokens and padded rows."""
        # the width comes from the device (ctx_width), never from this build's Python ints:
        # a graph captured at one max_decode_len is replayed at others
        real = token_context(md.ctx_lens, md.ctx_width, md.next_n) > 0
        md.topk_rows.view(md.padded_size, md.next_n).copy_(torch.where(real, md.topk_length[:, None], 0))

    def _plan_sparse(self, md: TritonMLAMetadata) -> None:
        """Plan the rows' tiles (``ceil(topk_rows / block_n)`` each), on every forward."""
        md.sched.plan(md.topk_rows, force=True)

    def _decode_sparse(self, q, kv_cache, md: TritonMLAMetadata, out, lse_rows, partial_o, partial_lse) -> None:
        """Sparse decode over the plan (writes unsplit rows of out / lse_rows and the partials)."""
        cfg, spec = md.config, self.spec
        ops.decode_sparse(q, kv_cache, md.topk_indices.view(-1), md.topk_starts, md.topk_rows, md.part_info,
                          md.num_splits, md.split_offsets, out, lse_rows, partial_o, partial_lse, spec.softmax_scale,
                          spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group, cfg.block_m, cfg.block_n,
                          cfg.num_warps, cfg.num_stages, k_scale=md.k_scale)

    def _combine_sparse(self, md: TritonMLAMetadata, out, lse_rows, partial_o, partial_lse) -> None:
        """Merge split rows over the ``[rows, 1, h, rank]`` view; rows without entries get 0 / -inf."""
        rows, h = md.padded_size * md.next_n, self.spec.num_heads
        ops.combine(partial_o, partial_lse, md.num_splits, md.split_offsets,
                    out.view(rows, 1, h, self.spec.kv_lora_rank), lse_rows.view(rows, h, 1),
                    md.config.combine_block_m, md.config.combine_col_blocks)

    def _indexer_context_lens(self, ctx: torch.Tensor, pad: int, width: int) -> torch.Tensor:
        """Build time: the per-token context lengths the indexer reads. ``ctx`` is this
        build's ``[pad, width]`` contiguous view of the flat 1-D buffer the dense path uses,
        already filled; the indexer reads it with the device-side width ``ctx_width``, like
        the decode kernel, so it is handed over as is."""
        return ctx

    def _run_indexer(self, q, kv_cache, md: TritonMLAMetadata) -> None:
        """Select each token's top-k on the device into ``md.topk_indices`` (-1 past the picks)."""
        w, spec = self.indexer, self.spec
        indexer_topk(q, kv_cache, md.block_table, md.indexer_ctx, md.ctx_width, w.w_q, w.w_k, w.head_w,
                     md.topk_indices.view(md.padded_size, md.next_n, self.topk_max), md.topk,
                     spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group, k_scale=md.k_scale)

    def _forward_sparse(self, q, kv_cache, md: TritonMLAMetadata, out) -> tuple[torch.Tensor, torch.Tensor]:
        if md.topk_on_device:
            self._run_indexer(q, kv_cache, md)
        self._sparse_rows(md)
        self._plan_sparse(md)
        out, lse = self._alloc_outputs(q, md, out)
        h = self.spec.num_heads
        partial_o, partial_lse = alloc_sparse_partials(md.config, h, self.spec.kv_lora_rank, q.device)
        lse_rows = torch.empty(md.padded_size * md.next_n, h, dtype=torch.float32, device=q.device)
        self._decode_sparse(q, kv_cache, md, out, lse_rows, partial_o, partial_lse)
        self._combine_sparse(md, out, lse_rows, partial_o, partial_lse)
        lse.copy_(lse_rows.view(md.padded_size, md.next_n, h).permute(0, 2, 1))
        return out, lse

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonMLAMetadata,
                out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Device work only (capturable).

        Args:
            q: ``[pad, next_n, h, d_qk]`` (bf16/fp16/fp32, contiguous).
            kv_cache: the paged cache of the batch's kv_dtype.
            metadata: from ``build``.
            out: optional ``[pad, next_n, h, kv_lora_rank]`` q-dtype buffer.
        Returns:
            ``out [pad, next_n, h, kv_lora_rank]`` (q dtype), ``lse [pad, h, next_n]`` fp32;
            padded rows and padding tokens are exactly 0 / -inf.
        """
        md = metadata
        self._check_forward(q, kv_cache, md, out)
        if md.sparse:
            return self._forward_sparse(q, kv_cache, md, out)
        self._plan(md)
        out, lse = self._alloc_outputs(q, md, out)
        partial_o, partial_lse = alloc_partials(md.config, md.next_n, self.spec.num_heads, self.spec.kv_lora_rank,
                                                q.device)
        self._decode(q, kv_cache, md, out, lse, partial_o, partial_lse)
        self._combine(md, out, lse, partial_o, partial_lse)
        return out, lse

    def write_kv(self, kv_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                 metadata: TritonMLAMetadata) -> None:
        """Write this step's latent KV by the metadata's slot mapping (-1 skipped); an fp8_e4m3
        cache quantises with the build's scale (``md.k_scale``).

        Args:
            latent: ``[pad, next_n, kv_lora_rank]``; rope: ``[pad, next_n, qk_rope_head_dim]``.
        """
        md, spec = metadata, self.spec
        lead = (md.padded_size, md.next_n)
        for nm, t, w in (("latent", latent, spec.kv_lora_rank), ("rope", rope, spec.qk_rope_head_dim)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != lead + (w,):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{nm} must be [pad={lead[0]}, next_n={lead[1]}, {w}], got {got}")
        ops.write_kv_cache(kv_cache, latent.reshape(-1, spec.kv_lora_rank), rope.reshape(-1, spec.qk_rope_head_dim),
                           md.slot_mapping.view(-1), spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group,
                           k_scale=md.k_scale)

    def kv_splits(self, metadata: TritonMLAMetadata) -> list[int]:
        """Pieces the planner cut each real work row into in the step just run (the fuzzer's
        coverage of the split path and the combine; a host read, never called in a capture):
        one entry per real request, or per real request's query token in sparse decode."""
        md = metadata
        rows = md.num_reqs * (md.next_n if md.sparse else 1)
        return md.num_splits[:rows].tolist()

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
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Sequence, Union

import torch

from mla_ref import DecodeBatch, ModelSpec

from . import ops
from .config import DecodeConfig, check_spec_supported, default_config
from .decode import alloc_partials
from .sched import SchedState

__all__ = ["TritonMLABackend", "TritonMLAMetadata", "host_context_lens"]

_KV_TORCH = {"bf16": (torch.bfloat16,), "fp16": (torch.float16,), "fp8": (torch.uint8,)}


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
      ``[pad]``: the plan, written by the planner inside ``forward``
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
        config: launch config for every batch (default: ``default_config`` per ``next_n`` and kv dtype).
    """

    name = "triton"

    def __init__(self, spec: ModelSpec, *, device: Union[str, torch.device] = "cuda", max_batch: int,
                 capture_sizes: Sequence[int] = (), graph_safe: bool = True, next_n_max: int = 4,
                 max_blocks_per_seq: int = 256, page_size: Optional[int] = None,
                 config: Optional[DecodeConfig] = None) -> None:
        check_spec_supported(spec)
        for nm, v in (("max_batch", max_batch), ("next_n_max", next_n_max), ("max_blocks_per_seq", max_blocks_per_seq)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{nm} must be a positive int, got {v!r}")
        capture_sizes = sorted(int(c) for c in capture_sizes)
        if capture_sizes and (capture_sizes[0] < 1 or capture_sizes[-1] > max_batch):
            raise ValueError(f"capture_sizes must lie in [1, max_batch={max_batch}], got {capture_sizes}")
        if page_size is not None and (not isinstance(page_size, int) or page_size < 1):
            raise ValueError(f"page_size must be a positive int or None, got {page_size!r}")
        self.spec = spec
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.capture_sizes = capture_sizes
        self.graph_safe = bool(graph_safe)
        self.next_n_max = next_n_max
        self.max_blocks_per_seq = max_blocks_per_seq
        self.page_size = page_size
        self._configs = {(n, kv): (config or default_config(spec, n, self.device, fp8=kv == "fp8"))
                         for n in range(1, next_n_max + 1) for kv in _KV_TORCH}
        self._buffers: dict = {}
        self._alloc_buffers()

    # ------------------------------------------------------------------ buffers

    def _alloc_buffers(self) -> None:
        """Allocate every persistent buffer once (graph-safe mode reads only these)."""
        dev, mb, nn = self.device, self.max_batch, self.next_n_max
        max_parts = max(c.num_parts for c in self._configs.values())
        i32 = dict(dtype=torch.int32, device=dev)
        self._buffers = {
            "seq_lens": torch.zeros(mb, **i32),
            "block_table": torch.zeros(mb * self.max_blocks_per_seq, **i32),
            # flat 1-D: any (pad, width) prefix view is contiguous (vLLM #42135's fix)
            "ctx_lens": torch.zeros(mb * nn, **i32),
            "ctx_width": torch.zeros(1, **i32),
            "slot_mapping": torch.full((mb * nn,), -1, dtype=torch.int64, device=dev),
            "part_info": torch.zeros((max_parts + 1) * 3, **i32),
            "num_splits": torch.zeros(mb, **i32),
            "split_offsets": torch.zeros(mb, **i32),
        }

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
            return torch.empty(pad, width, dtype=torch.int32, device=self.device)
        return self._flat_view("ctx_lens", (pad, width))

    # ------------------------------------------------------------------ build

    def config_for(self, next_n: int, kv_dtype: str = "bf16") -> DecodeConfig:
        """The launch config used for batches of this ``next_n`` and ``kv_dtype``."""
        if (next_n, kv_dtype) not in self._configs:
            raise ValueError(f"next_n must be in [1, next_n_max={self.next_n_max}] and kv_dtype one of "
                             f"{tuple(_KV_TORCH)}, got {next_n}, {kv_dtype!r}")
        return self._configs[(next_n, kv_dtype)]

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
        if batch.topk_indices is not None:
            raise ValueError("batch.topk_indices: sparse decode is not supported by TritonMLABackend yet")
        if batch.batch_size:
            pages = int(((batch.seq_lens.max() + batch.page_size - 1) // batch.page_size))
            if pages > self.max_blocks_per_seq:
                raise ValueError(f"a request needs {pages} pages but max_blocks_per_seq={self.max_blocks_per_seq}")

    def _fill_metadata(self, batch: DecodeBatch) -> TritonMLAMetadata:
        """Host side of ``build``: compute the padded host arrays and stage them."""
        B, pad = batch.batch_size, batch.padded_size
        next_n, width = batch.next_n, int(batch.max_decode_len)
        cfg = self.config_for(next_n, batch.kv_dtype)

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
        return TritonMLAMetadata(
            seq_lens=self._stage("seq_lens", seq),
            block_table=self._stage("block_table", bt),
            ctx_lens=ctx,
            ctx_width=self._stage("ctx_width", torch.tensor([width], dtype=torch.int32)),
            slot_mapping=self._stage("slot_mapping", slots),
            part_info=self._scratch("part_info", (cfg.num_parts + 1, 3)),
            num_splits=self._scratch("num_splits", (pad,)),
            split_offsets=self._scratch("split_offsets", (pad,)),
            num_reqs=B, padded_size=pad, next_n=next_n, max_decode_len=width,
            kv_dtype=batch.kv_dtype, page_size=batch.page_size, config=cfg)

    def _make_sched(self, md: TritonMLAMetadata) -> SchedState:
        """A fresh, unplanned scheduler state bound to this build's plan buffers."""
        return SchedState.over(md.config, md.part_info, md.num_splits, md.split_offsets)

    def build(self, batch: DecodeBatch) -> TritonMLAMetadata:
        """Host side: validate ``batch`` and write it (padded to ``batch.padded_size``) into
        the metadata buffers. Launches no kernel; the plan is made inside ``forward``."""
        self._check_batch(batch)
        md = self._fill_metadata(batch)
        md.sched = self._make_sched(md)
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
                         cfg.num_warps, cfg.num_stages, cfg.fp8_prefetch)

    def _combine(self, md: TritonMLAMetadata, out, lse, partial_o, partial_lse) -> None:
        """Merge split rows and write 0 / -inf rows for requests without keys (all padded rows)."""
        ops.combine(partial_o, partial_lse, md.num_splits, md.split_offsets, out, lse, md.config.combine_block_m)

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
        self._plan(md)
        out, lse = self._alloc_outputs(q, md, out)
        partial_o, partial_lse = alloc_partials(md.config, md.next_n, self.spec.num_heads, self.spec.kv_lora_rank,
                                                q.device)
        self._decode(q, kv_cache, md, out, lse, partial_o, partial_lse)
        self._combine(md, out, lse, partial_o, partial_lse)
        return out, lse

    def write_kv(self, kv_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                 metadata: TritonMLAMetadata) -> None:
        """Write this step's latent KV by the metadata's slot mapping (-1 skipped).

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
                           md.slot_mapping.view(-1), spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group)

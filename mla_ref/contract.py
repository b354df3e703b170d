"""The plug-in surface shared by the harness and every decode backend.

``DecodeBatch`` is the host-side description of one decode step; ``DecodeBackend`` is
the protocol a backend implements to be fuzzed. Both live here, beside the math,
because the Triton backend (``kernels``) implements them and must not import
``harness`` (docs/design.md, layering).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

import torch

#: KV-cache formats: ``"fp8"`` is FlashMLA's uint8 token (656 bytes at DeepSeek size, its scales
#: inside), ``"fp8_e4m3"`` float8_e4m3fn rows with one per-layer fp32 scale (``DecodeBatch.k_scale``).
KV_DTYPES = ("bf16", "fp16", "fp8", "fp8_e4m3")


@dataclass
class DecodeBatch:
    """One decode step, as the engine's scheduler hands it to a backend (CPU tensors, except
    ``k_scale``).

    Shapes (``B`` real requests, ``s_q = next_n``):

    - ``seq_lens`` int32 ``[B]``: KV length of each request *including* this step's tokens.
    - ``q_lens`` int32 ``[B]``: query tokens this step; ``0 <= q_lens <= max_decode_len <= next_n``
      and ``q_lens <= seq_lens``. Query token ``i >= q_lens[b]`` is padding.
    - ``block_table`` int32 ``[B, max_blocks]``: physical page of each logical page; entries past
      the last used page are ignored (any value).
    - ``slot_mapping`` int64 ``[B, next_n]``: global cache slot (``page*page_size + offset``) where
      query token ``i`` writes its latent KV; ``-1`` = do not write (padding tokens).
    - ``pad_to``: the captured batch size this step is replayed at (``None`` = eager, no padding).
      The backend pads rows ``B..pad_to-1`` as real engines do: seq_len 0, q_len 0, block-table
      rows pointing at ``null_block``, slot -1.
    - ``kv_dtype``: ``"bf16" | "fp16" | "fp8" | "fp8_e4m3"``: ``"fp8"`` is FlashMLA's uint8 token
      (``[num_blocks, page_size, spec.fp8_bytes_per_token]``, 656 bytes at DeepSeek size: e4m3
      latent, fp32 group scales, bf16 rope); ``"fp8_e4m3"`` is vLLM / SGLang / FlashInfer's
      float8_e4m3fn ``[num_blocks, page_size, 1, d_qk]`` (latent and rope all e4m3) read as
      ``e4m3 * k_scale`` (``mla_ref.fp8_tensor``).
    - ``topk_indices`` int32 ``[B, next_n, topk]`` (sparse decode only): global slots, ``-1`` invalid.
    - Ragged form of the same selection (sparse decode, as engines produce it; give this *or*
      ``topk_indices``): ``topk_flat`` int32 ``[nnz]`` holds the rows back to back,
      ``topk_indptr`` int32 ``[B*next_n + 1]`` delimits them (row ``b*next_n + i`` = query token
      i of request b is ``topk_flat[indptr[r]:indptr[r+1]]``; rows of padding tokens are
      ignored), and ``topk`` (int) bounds every row's length. Entries are global slots, ``-1``
      invalid; a row may hold fewer than ``topk`` entries, be empty, or be all ``-1``.
      ``topk`` alone (no ``topk_flat``/``topk_indptr``): sparse decode whose selection the
      backend makes on the device with its top-k indexer (``mla_ref.indexer_topk``).
    - ``k_scale`` (``"fp8_e4m3"`` only, else None): the layer's per-tensor KV scale, an fp32
      tensor of shape ``[1]`` **on the device** -- the one non-CPU field. The engine owns it and
      writes it in place when the scale changes, so a captured graph must read this tensor, or
      a persistent buffer ``build`` copies it into, never a tensor re-created per build (its
      value frozen at capture). Its value is not checked here (a host read); the reference
      refuses a scale that is not positive and finite.
    """

    seq_lens: torch.Tensor
    q_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    page_size: int
    next_n: int = 1
    max_decode_len: Optional[int] = None
    pad_to: Optional[int] = None
    kv_dtype: str = "bf16"
    null_block: int = 0
    topk_indices: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)
    topk_flat: Optional[torch.Tensor] = None
    topk_indptr: Optional[torch.Tensor] = None
    topk: Optional[int] = None
    k_scale: Optional[torch.Tensor] = None  # last: positional construction keeps its meaning

    def __post_init__(self) -> None:
        if self.max_decode_len is None:
            self.max_decode_len = int(self.q_lens.max()) if self.q_lens.numel() else 0
        self.validate()

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def padded_size(self) -> int:
        return self.pad_to if self.pad_to is not None else self.batch_size

    @property
    def is_sparse(self) -> bool:
        """True when the step carries a top-k selection (dense or ragged)."""
        return self.topk_indices is not None or self.topk is not None

    @property
    def topk_on_device(self) -> bool:
        """True when the backend's indexer selects the top-k (``topk`` given alone)."""
        return self.topk is not None and self.topk_flat is None and self.topk_indices is None

    def ragged_topk(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The selection in ragged form: ``(flat int32 [nnz], indptr int32 [B*next_n+1], topk)``
        (converted from ``topk_indices`` when that is the form given: every row full width)."""
        if self.topk_flat is not None:
            return self.topk_flat, self.topk_indptr, int(self.topk)
        if self.topk_indices is None:
            raise ValueError("DecodeBatch: no host-side top-k selection (not sparse, or selected on the device)")
        B, n, k = self.topk_indices.shape
        indptr = torch.arange(B * n + 1, dtype=torch.int32) * k
        return self.topk_indices.reshape(-1).to(torch.int32), indptr, int(k)

    def dense_topk(self) -> torch.Tensor:
        """The selection as int32 ``[B, next_n, topk]``, ``-1`` past each row's entries (the
        reference's ``indices`` argument)."""
        if self.topk_indices is not None:
            return self.topk_indices.to(torch.int32)
        flat, indptr, k = self.ragged_topk()
        B, n = self.batch_size, self.next_n
        dense = torch.full((B * n, k), -1, dtype=torch.int32)
        lens = (indptr[1:] - indptr[:-1]).to(torch.int64)
        if flat.numel():
            rows = torch.repeat_interleave(torch.arange(B * n), lens)
            cols = torch.arange(flat.numel()) - indptr[:-1].to(torch.int64)[rows]
            dense[rows, cols] = flat.to(torch.int32)
        return dense.reshape(B, n, k)

    def validate(self) -> None:
        """Raise ValueError naming the field and the expected vs given value."""
        B = self.batch_size

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"DecodeBatch: {msg}")

        need(self.seq_lens.dim() == 1, f"seq_lens must be 1-D [B], got shape {tuple(self.seq_lens.shape)}")
        need(tuple(self.q_lens.shape) == (B,), f"q_lens must have shape ({B},), got {tuple(self.q_lens.shape)}")
        need(self.block_table.dim() == 2 and self.block_table.shape[0] == B,
             f"block_table must be [B={B}, max_blocks], got {tuple(self.block_table.shape)}")
        need(tuple(self.slot_mapping.shape) == (B, self.next_n),
             f"slot_mapping must be [B={B}, next_n={self.next_n}], got {tuple(self.slot_mapping.shape)}")
        need(self.page_size > 0, f"page_size must be positive, got {self.page_size}")
        need(self.next_n >= 1, f"next_n must be >= 1, got {self.next_n}")
        need(0 <= self.max_decode_len <= self.next_n,
             f"max_decode_len must be in [0, next_n={self.next_n}], got {self.max_decode_len}")
        need(self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_dtype == "fp8_e4m3":
            ks = self.k_scale
            need(isinstance(ks, torch.Tensor), "k_scale is required for kv_dtype 'fp8_e4m3' (an fp32 [1] tensor on the "
                                               f"device), got {type(ks).__name__}")
            need(ks.dtype == torch.float32 and tuple(ks.shape) == (1,),
                 f"k_scale must be an fp32 tensor of shape [1], got {ks.dtype} {tuple(ks.shape)}")
        else:
            need(self.k_scale is None, f"k_scale is only for kv_dtype 'fp8_e4m3', but kv_dtype is {self.kv_dtype!r}")
        if B:
            need(int(self.seq_lens.min()) >= 0, "seq_lens must be >= 0")
            need(int(self.q_lens.min()) >= 0, "q_lens must be >= 0")
            need(int(self.q_lens.max()) <= self.max_decode_len,
                 f"q_lens must be <= max_decode_len={self.max_decode_len}, got max {int(self.q_lens.max())}")
            need(bool((self.q_lens <= self.seq_lens).all()), "q_lens must be <= seq_lens for every row")
            pages_needed = (self.seq_lens + self.page_size - 1) // self.page_size
            need(int(pages_needed.max()) <= self.block_table.shape[1],
                 f"block_table has {self.block_table.shape[1]} columns but a row needs {int(pages_needed.max())} pages")
        if self.pad_to is not None:
            need(self.pad_to >= B, f"pad_to must be >= batch size {B}, got {self.pad_to}")
        if self.topk_indices is not None:
            need(self.topk_indices.dim() == 3 and tuple(self.topk_indices.shape[:2]) == (B, self.next_n),
                 f"topk_indices must be [B={B}, next_n={self.next_n}, topk], got {tuple(self.topk_indices.shape)}")
        if self.topk is not None:
            need(isinstance(self.topk, int) and self.topk >= 1, f"topk must be a positive int, got {self.topk!r}")
        ragged = (self.topk_flat, self.topk_indptr, self.topk)
        if self.topk_flat is not None or self.topk_indptr is not None:
            need(all(v is not None for v in ragged), "topk_flat, topk_indptr and topk must be given together")
            need(self.topk_indices is None, "give the selection as topk_indices or as topk_flat/topk_indptr, not both")
            R = B * self.next_n
            need(isinstance(self.topk, int) and self.topk >= 1, f"topk must be a positive int, got {self.topk!r}")
            need(self.topk_flat.dim() == 1, f"topk_flat must be 1-D [nnz], got {tuple(self.topk_flat.shape)}")
            need(tuple(self.topk_indptr.shape) == (R + 1,),
                 f"topk_indptr must be [B*next_n+1={R + 1}], got {tuple(self.topk_indptr.shape)}")
            ind = self.topk_indptr.to(torch.int64)
            lens = ind[1:] - ind[:-1]
            need(int(ind[0]) == 0 and int(ind[-1]) == self.topk_flat.numel(),
                 f"topk_indptr must start at 0 and end at nnz={self.topk_flat.numel()}, got "
                 f"{int(ind[0])}..{int(ind[-1])}")
            need(R == 0 or int(lens.min()) >= 0, "topk_indptr must be non-decreasing")
            need(R == 0 or int(lens.max()) <= self.topk,
                 f"every topk row must hold <= topk={self.topk} entries, got {int(lens.max()) if R else 0}")

    def to_dict(self) -> dict:
        """JSON-ready form (lists of ints), the inverse of ``from_dict``."""
        d = {
            "seq_lens": self.seq_lens.tolist(), "q_lens": self.q_lens.tolist(),
            "block_table": self.block_table.tolist(), "slot_mapping": self.slot_mapping.tolist(),
            "page_size": self.page_size, "next_n": self.next_n, "max_decode_len": self.max_decode_len,
            "pad_to": self.pad_to, "kv_dtype": self.kv_dtype, "null_block": self.null_block,
            "topk_indices": None if self.topk_indices is None else self.topk_indices.tolist(),
        }
        if self.topk_flat is not None:  # only sparse ragged batches carry these keys
            d.update(topk_flat=self.topk_flat.tolist(), topk_indptr=self.topk_indptr.tolist())
        if self.topk is not None:
            d["topk"] = self.topk
        if self.k_scale is not None:  # a float: the fp32 value, exact in JSON's double
            d["k_scale"] = float(self.k_scale.detach().reshape(-1)[0].cpu())
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeBatch":
        """The batch ``to_dict`` wrote (``k_scale`` comes back as a CPU fp32 ``[1]`` tensor)."""
        B = len(d["seq_lens"])
        next_n = int(d.get("next_n", 1))
        bt = torch.tensor(d["block_table"], dtype=torch.int32).reshape(B, -1)
        topk = d.get("topk_indices")
        return cls(
            seq_lens=torch.tensor(d["seq_lens"], dtype=torch.int32),
            q_lens=torch.tensor(d["q_lens"], dtype=torch.int32),
            block_table=bt,
            slot_mapping=torch.tensor(d["slot_mapping"], dtype=torch.int64).reshape(B, next_n),
            page_size=int(d["page_size"]), next_n=next_n, max_decode_len=d.get("max_decode_len"),
            pad_to=d.get("pad_to"), kv_dtype=d.get("kv_dtype", "bf16"), null_block=int(d.get("null_block", 0)),
            topk_indices=None if topk is None else torch.tensor(topk, dtype=torch.int32).reshape(B, next_n, -1),
            topk_flat=None if d.get("topk_flat") is None else torch.tensor(d["topk_flat"], dtype=torch.int32),
            topk_indptr=None if d.get("topk_indptr") is None else torch.tensor(d["topk_indptr"], dtype=torch.int32),
            topk=None if d.get("topk") is None else int(d["topk"]),
            k_scale=None if d.get("k_scale") is None else torch.tensor([float(d["k_scale"])], dtype=torch.float32),
        )


@runtime_checkable
class DecodeBackend(Protocol):
    """What the fuzzer drives. Loaded by import path ``package.module:Class``.

    Constructor: ``__init__(spec, *, device, max_batch, capture_sizes, graph_safe, **extra)``.
    ``spec`` is a ``ModelSpec``; ``device`` a ``torch.device``; ``max_batch`` the largest
    (padded) batch; ``capture_sizes`` the batch sizes graphs are captured at; ``graph_safe``
    True when forwards will be captured (keep persistent buffers). ``extra`` holds those of
    ``page_size``, ``max_blocks_per_seq``, ``next_n_max``, ``num_blocks``, ``topk_max`` and
    ``indexer`` that the constructor names (all of them with ``**kwargs``).

    ``build(batch)`` runs on the host before each step (in graph mode it must write into
    persistent buffers so a captured graph sees the new step). Optional
    ``build_for_capture(batch)``: used instead of ``build`` for the step a graph is captured
    on (and the warmups that share its build), as engines keep a separate capture path.
    ``forward(q, kv_cache, metadata)`` is device work only and is what gets captured. ``q`` is
    ``[pad, s_q, h_q, d_qk]`` where ``pad`` is ``batch.padded_size``; it returns
    ``(out, lse)``: ``out [pad, s_q, h_q, kv_lora_rank]`` in q's dtype and
    ``lse [pad, h_q, s_q]`` (fp32, or q's dtype and/or base 2 as ``capabilities`` declares;
    ``out`` alone or ``(out, None)`` when it declares ``lse=None``). Any strides are fine.
    Optional: ``write_kv(kv_cache, latent, rope, metadata)`` (cache write by the step's slot
    mapping) enables layer-level scenarios. Optional class attribute ``capabilities``
    (``mla_ref.Capabilities``): what it supports; ``Unsupported`` for anything else.
    """

    name: str

    def build(self, batch: DecodeBatch) -> Any: ...

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]: ...

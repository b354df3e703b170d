"""Example (a): the smallest graph-safe decode backend, to copy and replace the math of.

What makes it graph-safe, in the order an engine meets it:

- ``__init__`` allocates every tensor ``forward`` reads (seq_lens, q_lens, block_table) once,
  at ``max_batch`` rows;
- ``build`` (host side, never captured) pads the batch to ``batch.padded_size`` (rows
  ``B..pad-1``: seq_len 0, q_len 0, block-table rows of ``batch.null_block``) and ``copy_``s
  it into those buffers, returning views at offset 0: every build hands ``forward`` the same
  addresses, so a graph captured on one build reads the next build's values on replay;
- ``forward`` is device work only, one ``torch.library.custom_op`` (the shape a real kernel
  wrapper has; the harness's CUDA-graph emulator records and replays it as one op, and its
  address/contiguity audits see exactly the tensors it reads).

Why the op wraps ``mla_ref.mla_decode_masked`` and not ``mla_ref.mla_decode``: the latter is
written for obviousness and reads the lengths on the host (``.tolist()``) to loop over rows
and tokens, which a CUDA capture forbids (and the emulator refuses, inside custom ops too:
"Tensor.tolist ... copies device memory to the host"). ``mla_decode_masked`` is the same
function with fixed shapes: it gathers all ``max_blocks_per_seq`` pages of every row (so
``build`` makes every block-table entry a valid page), masks keys by position (bottom-right
causal for MTP) and gives a token with no visible key (padding token, padded row, seq_len 0)
out exactly 0 and lse ``-inf``, as ``mla_decode`` does. Cost is
``O(pad * next_n * heads * max_blocks_per_seq * page_size)``: a reference, not a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_fuzz.mla_ref import Capabilities, DecodeBatch, ModelSpec, Unsupported, mla_decode_masked

__all__ = ["ReferenceBackend", "ReferenceMetadata", "reference_decode"]


@torch.library.custom_op("mla_examples::reference_decode", mutates_args=())
def reference_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     q_lens: torch.Tensor, softmax_scale: float, rank: int, rope_dim: int,
                     fp8_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_ref.mla_decode_masked`` as one op (a custom op's arguments are tensors and scalars,
    so the spec travels as its three dims): ``q [pad, s_q, h, d_qk]``, a paged cache (floating or
    FP8 uint8), int32 ``block_table [pad, max_blocks]`` (every entry a valid page: all are
    gathered), ``seq_lens`` / ``q_lens [pad]`` -> ``out [pad, s_q, h, rank]`` (q dtype), ``lse [pad, h, s_q]`` fp32."""
    spec = ModelSpec(kv_lora_rank=rank, qk_rope_head_dim=rope_dim, fp8_group=fp8_group, num_heads=q.shape[2])
    return mla_decode_masked(q, kv_cache, block_table, seq_lens, spec=spec, q_lens=q_lens,
                             softmax_scale=softmax_scale)


@reference_decode.register_fake
def _reference_decode_fake(q, kv_cache, block_table, seq_lens, q_lens, softmax_scale, rank, rope_dim, fp8_group):
    pad, s_q, h, _ = q.shape
    return q.new_empty(pad, s_q, h, rank), q.new_empty(pad, h, s_q, dtype=torch.float32)


@dataclass
class ReferenceMetadata:
    """Views at offset 0 of the persistent buffers (same addresses for every build)."""

    seq_lens: torch.Tensor     # int32 [pad]
    q_lens: torch.Tensor       # int32 [pad]
    block_table: torch.Tensor  # int32 [pad, max_blocks_per_seq]


class ReferenceBackend:
    """A graph-safe reference decode backend (``mla_ref.DecodeBackend``); see the module doc."""

    name = "example-reference"
    capabilities = Capabilities(sparse=False, layer=False)

    def __init__(self, spec: ModelSpec, *, device, max_batch: int, capture_sizes=(), graph_safe: bool = True,
                 page_size: int = 16, max_blocks_per_seq: int = 8, **extra) -> None:
        self.spec, self.max_batch, self.max_blocks = spec, max_batch, max_blocks_per_seq
        i32 = dict(dtype=torch.int32, device=device)
        # persistent in both modes: an eager engine does not care, a graph needs it
        self.seq_lens = torch.zeros(max_batch, **i32)
        self.q_lens = torch.zeros(max_batch, **i32)
        self.block_table = torch.zeros(max_batch, max_blocks_per_seq, **i32)

    def build(self, batch: DecodeBatch) -> ReferenceMetadata:
        """Host side: pad the batch to ``batch.padded_size`` and copy it into the buffers."""
        if batch.is_sparse:
            raise Unsupported("sparse top-k decode: this example attends to whole sequences")
        B, pad, mb = batch.batch_size, batch.padded_size, self.max_blocks
        pages = (batch.seq_lens.long() + batch.page_size - 1) // batch.page_size
        if pad > self.max_batch or (B and int(pages.max()) > mb):
            raise ValueError(f"batch of {pad} rows / {int(pages.max()) if B else 0} pages exceeds max_batch="
                             f"{self.max_batch} / max_blocks_per_seq={mb}")
        seq, ql = torch.zeros(pad, dtype=torch.int32), torch.zeros(pad, dtype=torch.int32)
        seq[:B], ql[:B] = batch.seq_lens, batch.q_lens
        table = torch.full((pad, mb), batch.null_block, dtype=torch.int32)
        cols = min(mb, batch.block_table.shape[1])
        table[:B, :cols] = batch.block_table[:, :cols]
        # entries past a row's pages may hold anything (contract): the op gathers every column
        table[:B][torch.arange(mb)[None, :] >= pages[:, None]] = batch.null_block
        self.seq_lens[:pad].copy_(seq)
        self.q_lens[:pad].copy_(ql)
        self.block_table[:pad].copy_(table)
        return ReferenceMetadata(self.seq_lens[:pad], self.q_lens[:pad], self.block_table[:pad])

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: ReferenceMetadata, out=None):
        """Device work only: ``(out [pad, s_q, h, rank] q dtype, lse [pad, h, s_q] fp32)``."""
        md, spec = metadata, self.spec
        res, lse = reference_decode(q, kv_cache, md.block_table, md.seq_lens, md.q_lens, spec.softmax_scale,
                                    spec.kv_lora_rank, spec.qk_rope_head_dim, spec.fp8_group)
        if out is not None:
            out.copy_(res)
            res = out
        return res, lse

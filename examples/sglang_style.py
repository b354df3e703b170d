"""Example (c): an SGLang-shaped decode backend, with separate capture and replay metadata paths.

SGLang's Triton attention backends address the KV pool token by token, not page by page:
``kv_indptr`` int32 ``[bs + 1]`` delimits each request's run in ``kv_indices`` (global slot
ids ``page * page_size + offset``, one per key token), and the decode kernel reads a row's
keys as ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``. Its metadata comes from three places:

- ``init_forward_metadata`` (eager): fresh tensors sized for this batch;
- ``init_forward_metadata_capture_cuda_graph`` (capture): fills the buffers that
  ``init_cuda_graph_state`` allocated once for ``max_bs``;
- ``init_forward_metadata_replay_cuda_graph`` (before each replay): refreshes those same
  buffers in place, so the captured graph reads the new step.

The capture and replay paths are two pieces of code that must agree on *which* buffers they
fill; when they diverge the graph reads capture-time indices forever while each path on its
own looks fine (``harness.mutants.sglang_style.CaptureOwnIndices``). Here ``build`` is the
eager path (``batch.pad_to`` unset) and the replay path (``pad_to`` set), and
``build_for_capture`` is the capture path; both graph paths go through
``_fill_graph_metadata`` on ``self.kv_indptr`` / ``self.cuda_graph_kv_indices``.

Padded rows ``B..pad-1`` get ``seq_len = 1`` (SGLang's fill value for its Triton backend)
pointing at slot 0 of ``batch.null_block``: the kernel needs no zero-length special case, and
the padded rows' output is garbage the engine discards (never read by the fuzzer's oracles).
Indices are built on the host (SGLang builds them on the device from ``req_to_token``; the
buffers and their addresses are what matters here). Any page size works: the token-major
layout hides pages from the kernel.

The decode is plain torch over fixed shapes inside one custom op (the shape of SGLang's
``decode_attention_fwd`` launch): every row reads ``max_tokens`` positions from its indptr
start, masked past its length, softmax in fp32; no host reads, so it is capturable. Like
SGLang's Triton MLA decode it returns no lse and handles one query token per request over a
bf16/fp16 cache; everything else raises ``Unsupported`` from the builders, so the backend
without its ``capabilities`` declaration yields ``Unsupported``, never a wrong answer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_fuzz.mla_ref import Capabilities, DecodeBatch, ModelSpec, Unsupported

__all__ = ["SGLangStyleBackend", "SGLangStyleMetadata", "sglang_decode", "host_kv_indices"]

#: seq_len of a padded row (SGLang's ``get_cuda_graph_seq_len_fill_value`` for Triton).
SEQ_LEN_FILL_VALUE = 1


@torch.library.custom_op("mla_examples::sglang_decode", mutates_args=())
def sglang_decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                  softmax_scale: float, rank: int, max_tokens: int) -> torch.Tensor:
    """Token-major MLA decode: ``q [bs, 1, h, d_qk]``, floating cache ``[nb, page, 1, d_qk]``,
    int32 ``kv_indptr [>= bs + 1]`` and ``kv_indices [n]`` (global slots); each row reads at most
    ``max_tokens`` keys. Returns ``out [bs, 1, h, rank]`` in q's dtype."""
    bs = q.shape[0]
    d_qk = kv_cache.shape[-1]
    slots_kv = kv_cache.reshape(-1, d_qk)  # [num_blocks * page_size, d_qk]: slot-major
    start = kv_indptr[:bs].long()
    length = kv_indptr[1:bs + 1].long() - start
    pos = torch.arange(max_tokens, device=q.device)
    valid = pos[None, :] < length[:, None]                                   # [bs, max_tokens]
    idx = (start[:, None] + pos[None, :]).clamp(0, max(kv_indices.numel() - 1, 0))
    slots = kv_indices[idx].long().clamp(0, slots_kv.shape[0] - 1)        # past a row's run: anything
    keys = torch.where(valid[..., None], slots_kv[slots].float(), 0.0)     # [bs, max_tokens, d_qk]
    scores = torch.einsum("bhd,btd->bht", q[:, 0].float(), keys) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # fp32; every row the builders make has >= 1 key
    out = torch.einsum("bht,btv->bhv", probs, keys[..., :rank])
    return out.unsqueeze(1).to(q.dtype)


@sglang_decode.register_fake
def _sglang_decode_fake(q, kv_cache, kv_indptr, kv_indices, softmax_scale, rank, max_tokens):
    return q.new_empty(q.shape[0], 1, q.shape[2], rank)


@dataclass
class SGLangStyleMetadata:
    """``kv_indptr`` int32 ``[pad + 1]`` and ``kv_indices`` int32 (graph paths: the whole
    persistent ``[max_batch * max_tokens]`` buffer; eager: exactly the batch's slots)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    padded_size: int
    page_size: int


def host_kv_indices(batch: DecodeBatch, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's token-major addressing on the host: ``(kv_indptr int32 [pad + 1], kv_indices
    int32 [total])``. Real row b lists ``block_table[b, t // ps] * ps + t % ps`` for its
    ``seq_len`` tokens; padded rows list one key, slot 0 of the null block."""
    B, ps = batch.batch_size, batch.page_size
    seq = torch.full((pad,), SEQ_LEN_FILL_VALUE, dtype=torch.int64)
    seq[:B] = batch.seq_lens.long()
    indptr = torch.zeros(pad + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(seq, 0)
    runs = []
    for b in range(B):
        t = torch.arange(int(seq[b]))
        runs.append(batch.block_table[b, t // ps].long() * ps + t % ps)
    runs.append(torch.full((pad - B,), batch.null_block * ps, dtype=torch.int64))
    return indptr.to(torch.int32), torch.cat(runs).to(torch.int32)


class SGLangStyleBackend:
    """SGLang-shaped MLA decode backend (``mla_ref.DecodeBackend``); see the module doc.

    ``max_tokens`` (keys one request may have, SGLang's ``max_context_len``) is
    ``max_blocks_per_seq * page_size``; ``kv_indices`` holds ``max_batch * max_tokens`` slots.
    """

    name = "example-sglang-style"
    capabilities = Capabilities(kv_dtypes=("bf16", "fp16"), next_n=(1,), mtp="none", empty_rows=False, lse=None,
                                sparse=False, layer=False)

    def __init__(self, spec: ModelSpec, *, device, max_batch: int, capture_sizes=(), graph_safe: bool = True,
                 page_size: int = 16, max_blocks_per_seq: int = 8, **extra) -> None:
        self.spec, self.device, self.max_batch = spec, torch.device(device), max_batch
        self.max_tokens = max_blocks_per_seq * page_size
        self.kv_indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device)
        self.init_cuda_graph_state(max_batch)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """The capture/replay index buffer, allocated once for the largest captured batch."""
        self.cuda_graph_kv_indices = torch.zeros(max_bs * self.max_tokens, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ metadata paths

    def _check(self, batch: DecodeBatch) -> None:
        """``Unsupported`` for inputs outside ``capabilities``; ValueError past the buffers."""
        if batch.kv_dtype not in ("bf16", "fp16"):
            raise Unsupported(f"kv_dtype {batch.kv_dtype!r}: the Triton decode reads bf16/fp16 caches only")
        if batch.next_n != 1:
            raise Unsupported(f"next_n={batch.next_n}: the decode takes one query token per request (no MTP)")
        if batch.is_sparse:
            raise Unsupported("sparse top-k decode: the decode attends to whole sequences")
        B = batch.batch_size
        if B and (int(batch.seq_lens.min()) == 0 or int(batch.q_lens.min()) == 0):
            raise Unsupported("a real request with seq_len 0 or q_len 0: the decode computes every row's "
                              "token over at least one key")
        if batch.padded_size > self.max_batch:
            raise ValueError(f"padded batch {batch.padded_size} exceeds max_batch={self.max_batch}")
        if B and int(batch.seq_lens.max()) > self.max_tokens:
            raise ValueError(f"a request has {int(batch.seq_lens.max())} keys but max_tokens={self.max_tokens}")

    def _fill_graph_metadata(self, batch: DecodeBatch, kv_indptr: torch.Tensor,
                             kv_indices: torch.Tensor) -> SGLangStyleMetadata:
        """Write the batch into ``kv_indptr`` / ``kv_indices`` in place (addresses unchanged)."""
        pad = batch.padded_size
        indptr, indices = host_kv_indices(batch, pad)
        kv_indptr[:pad + 1].copy_(indptr)
        kv_indices[:indices.numel()].copy_(indices)
        return SGLangStyleMetadata(kv_indptr[:pad + 1], kv_indices, pad, batch.page_size)

    def build(self, batch: DecodeBatch) -> SGLangStyleMetadata:
        """Eager (``pad_to`` unset: fresh tensors) and replay (``pad_to`` set: the persistent
        buffers the capture filled, refreshed in place)."""
        self._check(batch)
        if batch.pad_to is not None:
            return self._fill_graph_metadata(batch, self.kv_indptr, self.cuda_graph_kv_indices)
        indptr, indices = host_kv_indices(batch, batch.padded_size)
        if indices.numel() == 0:  # an empty batch: give the kernel one valid element to clamp to
            indices = torch.zeros(1, dtype=torch.int32)
        return SGLangStyleMetadata(indptr.to(self.device), indices.to(self.device), batch.padded_size,
                                   batch.page_size)

    def build_for_capture(self, batch: DecodeBatch) -> SGLangStyleMetadata:
        """The capture path: the same persistent buffers the replay path refreshes."""
        self._check(batch)
        return self._fill_graph_metadata(batch, self.kv_indptr, self.cuda_graph_kv_indices)

    # ------------------------------------------------------------------ forward

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: SGLangStyleMetadata, out=None):
        """Device work only: ``(out [pad, 1, h, rank] in q's dtype, None)`` (no lse)."""
        md = metadata
        if kv_cache.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dim() != 4:
            raise Unsupported(f"kv_cache {kv_cache.dtype} {tuple(kv_cache.shape)}: a bf16/fp16 "
                              f"[num_blocks, page_size, 1, d_qk] cache only")
        if tuple(q.shape[:2]) != (md.padded_size, 1) or kv_cache.shape[1] != md.page_size:
            raise ValueError(f"q must be [pad={md.padded_size}, 1, h, d_qk] over a cache of page size "
                             f"{md.page_size}; got q {tuple(q.shape)}, cache {tuple(kv_cache.shape)}")
        res = sglang_decode(q, kv_cache, md.kv_indptr, md.kv_indices, self.spec.softmax_scale,
                            self.spec.kv_lora_rank, self.max_tokens)
        if out is not None:
            out.copy_(res)
            res = out
        return res, None

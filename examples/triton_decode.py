"""Example (b): a raw Triton MLA decode backend, written the way serving engines write theirs.

What it demonstrates, for someone plugging their own backend into ``mla-fuzz``:

- the engines' two-stage split-KV decode (vLLM's ``triton_mla.py`` + ``decode_attention_fwd``
  shape): stage 1 gives every (query row, head block, KV split) an online softmax over its
  slice of the paged latent cache and writes a partial output + lse into an fp32 workspace;
  stage 2 merges the splits. Uniform MTP is flattened into query rows, each with its own
  bottom-right causal key count, and V is the first ``kv_lora_rank`` columns of the cache;
- a metadata builder that ``copy_``s every step into persistent buffers (graph-safe), pads
  rows ``B..padded_size-1`` and picks the split count ON THE HOST from the longest sequence.
  That count is a Python int, so a CUDA graph freezes the capture-time value: by design,
  declared with ``schedule_may_differ=True`` (the kernel is correct for any split count);
- both launches wrapped in ``torch.library.custom_op`` so the harness's CUDA-graph emulator
  (which records dispatched ops) can replay them on a CPU;
- ``capabilities`` declaring what it handles, and ``Unsupported`` with a readable reason
  for everything else.

Fuzz it: ``mla-fuzz run --backend mla_fuzz.examples.triton_decode:TritonDecodeBackend``.
Its deliberately broken variants live in ``harness/mutants/examples.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_fuzz.mla_ref import Capabilities, DecodeBatch, ModelSpec, Unsupported

__all__ = ["TritonDecodeBackend", "TritonDecodeMetadata", "decode_stage1", "decode_stage2"]

_TORCH_KV = {"bf16": torch.bfloat16, "fp16": torch.float16}


# Stage 1, grid (rows, head blocks, splits): one program runs an online softmax for BLOCK_H
# heads of one query row over its split's slice of the row's visible keys and writes the
# normalised partial output and its lse to Ws[row, head, split, :RANK] and [..., RANK].
@triton.jit
def _stage1_kernel(Q, K, V, BlockTable, SeqLens, Ws, sm_scale, num_heads,
                   stride_q_row, stride_q_head, stride_k_page, stride_k_tok, stride_v_page, stride_v_tok,
                   stride_bt, stride_w_row, stride_w_head, stride_w_split,
                   S_Q: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr):
    row, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    req, tok = row // S_Q, row % S_Q
    # bottom-right causal: MTP token `tok` of s_q sees seq_len - s_q + tok + 1 keys; padded rows
    # have seq_len 0, so they see none and no page of theirs is ever read
    visible = tl.maximum(tl.load(SeqLens + req) - S_Q + tok + 1, 0)
    # the split boundaries come from the device-side length, so a graph captured with one
    # split count stays correct for any later batch (only the partition changes)
    split_len = tl.cdiv(visible, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, visible)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h, mask_d, mask_r = offs_h < num_heads, offs_d < RANK, offs_r < ROPE
    q_ptr = Q + row * stride_q_row + offs_h[:, None] * stride_q_head
    q_lat = tl.load(q_ptr + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    q_pe = tl.load(q_ptr + RANK + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        # one page lookup per key: any page size works, pages need not be contiguous;
        # int64 so page * page_stride cannot overflow on a large pool
        page = tl.load(BlockTable + req * stride_bt + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        k_ptr = K + page * stride_k_page + in_page * stride_k_tok
        k_lat = tl.load(k_ptr[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        k_pe = tl.load(k_ptr[:, None] + RANK + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        qk = (tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_pe, tl.trans(k_pe))) * sm_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        # every tile holds at least one visible key, so m_new is finite and alpha never NaN
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptr = V + page * stride_v_page + in_page * stride_v_tok
        v = tl.load(v_ptr[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        # P in the cache dtype for a tensor-core dot, accumulated in fp32, as engines do
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # an empty split (short row, or a padded row) must write 0 / -inf, never 0/0: stage 2
    # reads every split, and a NaN weight times a zero partial is still NaN
    has_keys = l_i > 0
    part = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    w_ptr = Ws + row * stride_w_row + offs_h * stride_w_head + split * stride_w_split
    tl.store(w_ptr[:, None] + offs_d[None, :], part, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(w_ptr + RANK, lse, mask=mask_h)


# Stage 2, grid (rows, heads): lse-weighted merge of one (row, head)'s splits.
@triton.jit
def _stage2_kernel(Ws, Out, Lse, stride_w_row, stride_w_head, stride_w_split, stride_o_row, stride_o_head,
                   stride_l_req, stride_l_head, stride_l_tok,
                   S_Q: tl.constexpr, RANK: tl.constexpr, BLOCK_D: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    req, tok = row // S_Q, row % S_Q
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s, mask_d = offs_s < NUM_SPLITS, offs_d < RANK
    w_ptr = Ws + row * stride_w_row + head * stride_w_head + offs_s * stride_w_split
    lse_s = tl.load(w_ptr + RANK, mask=mask_s, other=float("-inf"))
    m = tl.max(lse_s, 0)
    has_keys = m > float("-inf")
    # a row without keys (padding) has every split at -inf: shift by 0 so the weights are
    # exp(-inf) = 0 instead of exp(-inf - -inf) = NaN
    w = tl.exp(lse_s - tl.where(has_keys, m, 0.0))
    denom = tl.sum(w, 0)
    parts = tl.load(w_ptr[:, None] + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(has_keys, denom, 1.0)
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, denom, 1.0)), float("-inf"))
    tl.store(Out + row * stride_o_row + head * stride_o_head + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)
    tl.store(Lse + req * stride_l_req + head * stride_l_head + tok * stride_l_tok, lse.to(Lse.dtype.element_ty))


def _check_stage1(q, k_cache, v_cache, block_table, seq_lens, workspace, s_q, num_kv_splits):
    rows, h, d_qk = q.shape
    rank = v_cache.shape[-1]
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need unit stride in their last dim")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and the cache ({k_cache.dtype}) must share a dtype")
    if tuple(workspace.shape) != (rows, h, num_kv_splits, rank + 1) or workspace.dtype != torch.float32:
        raise ValueError(f"workspace must be fp32 [{rows}, {h}, {num_kv_splits}, {rank + 1}], "
                         f"got {workspace.dtype} {tuple(workspace.shape)}")
    if rows % s_q or seq_lens.shape != (rows // s_q,) or block_table.shape[0] != rows // s_q:
        raise ValueError(f"seq_lens / block_table must have rows/s_q = {rows // s_q} rows")


@torch.library.custom_op("mla_examples::triton_decode_stage1", mutates_args=("workspace",))
def decode_stage1(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, workspace: torch.Tensor, sm_scale: float, s_q: int,
                  num_kv_splits: int) -> None:
    """Stage 1: per-split partial attention into ``workspace``.

    ``q`` ``[rows, h, d_qk]`` (rows = requests * s_q, token-major; bf16/fp16); ``k_cache``
    ``[num_blocks, page_size, 1, d_qk]`` and ``v_cache`` its ``[..., :rank]`` view (same dtype);
    ``block_table`` int32 ``[rows/s_q, max_blocks]``; ``seq_lens`` int32 ``[rows/s_q]``;
    ``workspace`` fp32 ``[rows, h, num_kv_splits, rank + 1]`` (written: partial out, then lse
    in the last column, natural log)."""
    _check_stage1(q, k_cache, v_cache, block_table, seq_lens, workspace, s_q, num_kv_splits)
    rows, h, d_qk = q.shape
    rank = v_cache.shape[-1]
    block_h = 16  # tl.dot needs M >= 16; masked heads cost a little, never correctness
    big = rank >= 256  # DeepSeek's 512-wide K and V tiles: keep them within shared memory
    _stage1_kernel[(rows, triton.cdiv(h, block_h), num_kv_splits)](
        q, k_cache, v_cache, block_table, seq_lens, workspace, sm_scale, h,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0), workspace.stride(0), workspace.stride(1), workspace.stride(2),
        S_Q=s_q, RANK=rank, ROPE=d_qk - rank, BLOCK_D=triton.next_power_of_2(rank),
        BLOCK_R=max(16, triton.next_power_of_2(d_qk - rank)), BLOCK_H=block_h, BLOCK_N=16 if big else 32,
        PAGE_SIZE=k_cache.shape[1], NUM_SPLITS=num_kv_splits, num_warps=4, num_stages=2)


@decode_stage1.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, workspace, sm_scale, s_q, num_kv_splits):
    _check_stage1(q, k_cache, v_cache, block_table, seq_lens, workspace, s_q, num_kv_splits)


@torch.library.custom_op("mla_examples::triton_decode_stage2", mutates_args=("out", "lse"))
def decode_stage2(workspace: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, s_q: int) -> None:
    """Stage 2: merge the splits of ``workspace`` fp32 ``[rows, h, splits, rank + 1]`` into
    ``out`` ``[rows, h, rank]`` (q dtype, unit last stride) and ``lse`` ``[rows/s_q, h, s_q]``
    (q dtype, natural log; any strides). Rows without keys get exactly 0 / -inf."""
    rows, h, splits, _ = workspace.shape
    rank = out.shape[-1]
    _stage2_kernel[(rows, h)](
        workspace, out, lse, workspace.stride(0), workspace.stride(1), workspace.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), lse.stride(2),
        S_Q=s_q, RANK=rank, BLOCK_D=triton.next_power_of_2(rank), NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), num_warps=4)


@decode_stage2.register_fake
def _(workspace, out, lse, s_q):
    return None


@dataclass
class TritonDecodeMetadata:
    """One step's metadata. The tensors are offset-0 views of the builder's persistent
    buffers (the same ``data_ptr`` every build); the ints are host decisions that a captured
    graph freezes.

    - ``seq_lens`` int32 ``[pad]`` (0 for padded rows); ``block_table`` int32 ``[pad, max_blocks]``
    - ``workspace`` fp32 ``[pad * next_n, h, num_kv_splits, rank + 1]``: stage-1 partials
    """

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    workspace: torch.Tensor
    num_kv_splits: int
    next_n: int
    padded_size: int
    num_reqs: int
    page_size: int


class TritonDecodeBackend:
    """A split-KV Triton MLA decode backend (``mla_ref.DecodeBackend``) in the engines' shape.

    Args (the harness's constructor contract): ``spec`` (``ModelSpec``), ``device``,
    ``max_batch`` (largest padded batch), ``capture_sizes``, ``graph_safe`` (buffers are
    persistent either way: a copy costs no more than an allocation), ``page_size`` (every
    batch must use it), ``max_blocks_per_seq`` (block-table columns kept per request),
    ``next_n_max`` (largest MTP ``next_n``; sizes the workspace); ``extra`` is ignored.
    """

    name = "example-triton-decode"
    capabilities = Capabilities(kv_dtypes=("bf16", "fp16"), q_dtypes=("bf16", "fp16"), next_n=(1, 2),
                                mtp="uniform", empty_rows=False, lse="natural", lse_dtype="q", sparse=False,
                                layer=False, schedule_may_differ=True)
    #: split-count policy: one split per ``min_split_len`` keys of the longest sequence,
    #: rounded up to a power of two (fewer distinct kernels), at most ``max_kv_splits``
    min_split_len = 64
    max_kv_splits = 8

    def __init__(self, spec: ModelSpec, *, device, max_batch: int, capture_sizes, graph_safe: bool,
                 page_size: int = 16, max_blocks_per_seq: int = 8, next_n_max: int = 1, **extra) -> None:
        for nm, v in (("max_batch", max_batch), ("page_size", page_size),
                      ("max_blocks_per_seq", max_blocks_per_seq), ("next_n_max", next_n_max)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{nm} must be a positive int, got {v!r}")
        self.spec, self.device = spec, torch.device(device)
        self.max_batch, self.capture_sizes, self.graph_safe = max_batch, tuple(capture_sizes), bool(graph_safe)
        self.page_size, self.max_blocks_per_seq = page_size, max_blocks_per_seq
        self.next_n_max = min(next_n_max, 2)  # the kernel handles next_n 1 and 2 only
        i32 = dict(dtype=torch.int32, device=self.device)
        self._seq_lens = torch.zeros(max_batch, **i32)
        self._block_table = torch.zeros(max_batch * max_blocks_per_seq, **i32)
        # the workspace at its largest (every row, every split) once, here: a graph keeps the
        # address it captured, so the buffer must never move (example-workspace-realloc)
        rows = max_batch * self.next_n_max
        self._workspace = torch.empty(rows * spec.num_heads * self.max_kv_splits * (spec.kv_lora_rank + 1),
                                      dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ host side

    def _check_supported(self, batch: DecodeBatch) -> None:
        """``Unsupported`` (shown to users as the reason a draw was skipped) or ValueError
        (the engine broke the constructor's contract)."""
        if batch.kv_dtype not in _TORCH_KV:
            raise Unsupported(f"kv_dtype {batch.kv_dtype}: this example reads bf16/fp16 latent caches only "
                              "(no FP8 dequantisation)")
        if batch.is_sparse:
            raise Unsupported("sparse top-k decode: this example attends to every cached key")
        if batch.next_n not in (1, 2):
            raise Unsupported(f"next_n={batch.next_n}: the kernel handles 1 or 2 query tokens per request")
        B = batch.batch_size
        if B and int(batch.seq_lens.min()) == 0:
            raise Unsupported("a real request with seq_len 0: every request needs at least one cached key")
        if B and (batch.max_decode_len != batch.next_n or bool((batch.q_lens != batch.next_n).any())):
            raise Unsupported(f"ragged MTP (q_lens {batch.q_lens.tolist()}, max_decode_len {batch.max_decode_len}): "
                              f"every request must have exactly next_n={batch.next_n} query tokens")
        if batch.next_n > self.next_n_max:
            raise ValueError(f"batch.next_n={batch.next_n} exceeds next_n_max={self.next_n_max}")
        if batch.padded_size > self.max_batch:
            raise ValueError(f"padded batch {batch.padded_size} exceeds max_batch={self.max_batch}")
        if batch.page_size != self.page_size:
            raise ValueError(f"batch.page_size={batch.page_size} but this backend was built for {self.page_size}")
        pages = -(-int(batch.seq_lens.max()) // batch.page_size) if B else 0
        if pages > self.max_blocks_per_seq:
            raise ValueError(f"a request needs {pages} pages but max_blocks_per_seq={self.max_blocks_per_seq}")

    def _stage(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """Copy ``host`` into the persistent buffer ``name`` and return the offset-0 view the
        kernels read: the address a captured graph holds, refreshed in place every step."""
        dst = getattr(self, "_" + name)[:host.numel()].view(host.shape)
        dst.copy_(host)
        return dst

    def _num_kv_splits(self, max_seq_len: int) -> int:
        """Host-side split count from the longest sequence (1 up to ``min_split_len`` keys)."""
        want = -(-max(max_seq_len, 1) // self.min_split_len)
        return min(triton.next_power_of_2(want), self.max_kv_splits)

    def _workspace_for(self, rows: int, num_kv_splits: int) -> torch.Tensor:
        """fp32 ``[rows, h, num_kv_splits, rank + 1]``: an offset-0 view of the workspace
        allocated once in ``__init__``."""
        shape = (rows, self.spec.num_heads, num_kv_splits, self.spec.kv_lora_rank + 1)
        return self._workspace[:rows * shape[1] * shape[2] * shape[3]].view(shape)

    def build(self, batch: DecodeBatch) -> TritonDecodeMetadata:
        """Host side, never captured: check ``batch`` (``Unsupported`` for what this example
        does not handle), copy its lengths and block table (padded to ``batch.padded_size``)
        into the persistent buffers and choose the split count from the longest sequence."""
        self._check_supported(batch)
        B, pad = batch.batch_size, batch.padded_size
        # padded rows: seq_len 0 and null-block pages, so the kernel reads nothing for them and
        # writes out 0 / lse -inf; stale columns past a row's pages are overwritten too
        seq = torch.zeros(pad, dtype=torch.int32)
        seq[:B] = batch.seq_lens
        bt = torch.full((pad, self.max_blocks_per_seq), batch.null_block, dtype=torch.int32)
        cols = min(batch.block_table.shape[1], self.max_blocks_per_seq)
        bt[:B, :cols] = batch.block_table[:, :cols]
        splits = self._num_kv_splits(int(batch.seq_lens.max()) if B else 0)
        return TritonDecodeMetadata(
            seq_lens=self._stage("seq_lens", seq), block_table=self._stage("block_table", bt),
            workspace=self._workspace_for(pad * batch.next_n, splits), num_kv_splits=splits,
            next_n=batch.next_n, padded_size=pad, num_reqs=B, page_size=batch.page_size)

    def kv_splits(self, metadata: TritonDecodeMetadata) -> list[int]:
        """Optional, for the fuzzer's coverage only: pieces each real request's keys were cut
        into (the one host-side split count, for every request)."""
        return [metadata.num_kv_splits] * metadata.num_reqs

    # ------------------------------------------------------------------ device side

    def _splits(self, md: TritonDecodeMetadata) -> int:
        """The split count to launch: the build's host decision (never a device read)."""
        return md.num_kv_splits

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonDecodeMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device work only (no host reads: CUDA-graph capturable).

        Args:
            q: ``[pad, next_n, h, d_qk]`` bf16/fp16; kv_cache: ``[num_blocks, page_size, 1, d_qk]``
                of the same dtype; metadata: from ``build``.
        Returns:
            ``out [pad, next_n, h, kv_lora_rank]`` and ``lse [pad, h, next_n]`` (natural log),
            both in q's dtype, freshly allocated; padded rows are 0 / -inf.
        """
        md, spec = metadata, self.spec
        pad, s_q, h, rank = md.padded_size, md.next_n, spec.num_heads, spec.kv_lora_rank
        if tuple(q.shape) != (pad, s_q, h, spec.d_qk):
            raise ValueError(f"q must be [pad={pad}, next_n={s_q}, h={h}, d_qk={spec.d_qk}], got {tuple(q.shape)}")
        if tuple(kv_cache.shape[1:]) != (md.page_size, 1, spec.d_qk) or kv_cache.dtype != q.dtype:
            raise ValueError(f"kv_cache must be {q.dtype} [num_blocks, {md.page_size}, 1, {spec.d_qk}], "
                             f"got {kv_cache.dtype} {tuple(kv_cache.shape)}")
        splits = self._splits(md)
        # uniform MTP flattens into pad * s_q independent query rows, token-major per request
        q_rows = q.reshape(pad * s_q, h, spec.d_qk)
        if q_rows.stride(-1) != 1:
            q_rows = q_rows.contiguous()
        v_cache = kv_cache[..., :rank]  # MLA: the values are the latent part of each key row
        out = torch.empty(pad, s_q, h, rank, dtype=q.dtype, device=q.device)
        lse = torch.empty(pad, h, s_q, dtype=q.dtype, device=q.device)
        decode_stage1(q_rows, kv_cache, v_cache, md.block_table, md.seq_lens, md.workspace,
                      spec.softmax_scale, s_q, splits)
        decode_stage2(md.workspace, out.view(pad * s_q, h, rank), lse, s_q)
        return out, lse

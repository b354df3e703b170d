"""Shared builders for the mla_ref tests: random paged batches and an independent oracle.

The paged cache here is filled by direct indexing (not ``write_kv_cache``) and the oracle
is a vectorised fp64 softmax over a padded key tensor, so neither shares code with the
per-request loop in ``mla_ref.decode``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from hypothesis import strategies as st

from mla_fuzz.mla_ref import ModelSpec, quantize_kv_fp8, dequantize_kv_fp8

# rank 32 + rope 8 in groups of 16, and the standard tiny spec with odd head counts
MICRO = ModelSpec(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_heads=2,
                  q_lora_rank=24, hidden=32, fp8_group=16)
SMALL_SPECS = [MICRO, ModelSpec.tiny(num_heads=3), ModelSpec.tiny(num_heads=8)]

CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Case:
    """One decode call's inputs plus what the cache holds, for the oracle."""

    spec: ModelSpec
    q: torch.Tensor                 # [B, s_q, h, d_qk]
    kv_cache: torch.Tensor          # floating [nb, ps, 1, d_qk] (float8_e4m3fn too) or uint8 [nb, ps, bytes]
    block_table: torch.Tensor       # int32 [B, cols]
    cache_seqlens: torch.Tensor     # int32 [B]
    q_lens: Optional[torch.Tensor]  # int32 [B] or None
    keys: list                      # per request fp64 [L, d_qk]: the values the cache holds
    page_size: int
    k_scale: Optional[float] = None  # fp8_e4m3 only: the fp32 scale its values are multiplied by

    def slot(self, b: int, t: int) -> int:
        """Global slot of token t of request b."""
        return int(self.block_table[b, t // self.page_size]) * self.page_size + t % self.page_size

    def args(self) -> tuple:
        return (self.q, self.kv_cache, self.block_table, self.cache_seqlens)


def e4m3_by_hand(x: torch.Tensor, k_scale: float) -> torch.Tensor:
    """fp8_e4m3 codes of ``x`` written out with torch ops only (fp32 division, saturation at
    +-448, torch's round-to-nearest-even cast), for tests that must not use mla_ref's quantiser."""
    return (x.to(torch.float32) / torch.tensor(k_scale, dtype=torch.float32)).clamp(-448.0, 448.0).to(
        torch.float8_e4m3fn)


def build_case(spec: ModelSpec, *, seq_lens, s_q: int, page_size: int, q_lens=None, kv_dtype: str = "fp32",
               q_dtype: torch.dtype = torch.float64, seed: int = 0, spare_blocks: int = 1, extra_cols: int = 0,
               poison: bool = False, k_scale: Optional[float] = None) -> Case:
    """A random batch. Physical pages are handed out in a random order; with ``poison`` every
    slot not holding a real token is NaN (an fp8_e4m3 cache: 0xFF bytes, the NaN code, as the
    harness poisons) and unused block-table columns hold garbage. ``k_scale``: the fp8_e4m3
    cache's scale (default 2**-5: keys of magnitude ~1 use the top of the e4m3 range)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    pages = [-(-L // page_size) for L in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    cols = max(pages + [1]) + extra_cols
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    if poison:
        block_table = torch.randint(-(2 ** 30), 2 ** 30, (B, cols), generator=gen, dtype=torch.int32)
    else:
        block_table = torch.zeros(B, cols, dtype=torch.int32)
    for b, n in enumerate(pages):
        for p in range(n):
            block_table[b, p] = physical.pop()

    fill = float("nan") if poison else 0.0
    d = spec.d_qk
    if kv_dtype == "fp8":
        empty = quantize_kv_fp8(torch.full((spec.kv_lora_rank,), fill), torch.full((spec.qk_rope_head_dim,), fill),
                                spec=spec)
        kv_cache = empty.expand(num_blocks, page_size, -1).clone()
    elif kv_dtype == "fp8_e4m3":
        k_scale = 2.0 ** -5 if k_scale is None else float(torch.tensor(k_scale, dtype=torch.float32))
        kv_cache = torch.full((num_blocks, page_size, 1, d), 0xFF if poison else 0, dtype=torch.uint8).view(
            torch.float8_e4m3fn)
    else:
        kv_cache = torch.full((num_blocks, page_size, 1, d), fill, dtype=CACHE_DTYPES[kv_dtype])

    keys = []
    for b, L in enumerate(seq_lens):
        k = torch.randn(L, d, generator=gen, dtype=torch.float64)
        blocks = block_table[b, torch.arange(L) // page_size].long()
        offsets = torch.arange(L) % page_size
        if kv_dtype == "fp8":
            packed = quantize_kv_fp8(k[:, :spec.kv_lora_rank], k[:, spec.kv_lora_rank:], spec=spec)
            kv_cache[blocks, offsets] = packed
            keys.append(dequantize_kv_fp8(packed, spec=spec, dtype=torch.float64))
        elif kv_dtype == "fp8_e4m3":
            codes = e4m3_by_hand(k, k_scale)
            kv_cache[blocks, offsets, 0] = codes
            keys.append(codes.to(torch.float64) * k_scale)  # exact: 4 x 24 significant bits
        else:
            kv_cache[blocks, offsets, 0] = k.to(kv_cache.dtype)
            keys.append(kv_cache[blocks, offsets, 0].to(torch.float64))
    q = torch.randn(B, s_q, spec.num_heads, d, generator=gen, dtype=torch.float64).to(q_dtype)
    return Case(spec=spec, q=q, kv_cache=kv_cache, block_table=block_table,
                cache_seqlens=torch.tensor(seq_lens, dtype=torch.int32),
                q_lens=None if q_lens is None else torch.tensor(q_lens, dtype=torch.int32),
                keys=keys, page_size=page_size, k_scale=k_scale if kv_dtype == "fp8_e4m3" else None)


def oracle_dense(case: Case, *, causal: bool = True, softmax_scale: Optional[float] = None):
    """fp64 softmax over a padded key tensor with an explicit visibility mask.

    Returns ``(out [B, s_q, h, rank], lse [B, h, s_q])`` fp64.
    """
    spec = case.spec
    q = case.q.to(torch.float64)
    B, s_q, h, d = q.shape
    seq = case.cache_seqlens.tolist()
    ql = [s_q] * B if case.q_lens is None else case.q_lens.tolist()
    L_max = max(seq + [1])
    K = torch.zeros(B, L_max, d, dtype=torch.float64)
    for b, k in enumerate(case.keys):
        K[b, :k.shape[0]] = k
    t = torch.arange(L_max).view(1, 1, L_max)
    i = torch.arange(s_q).view(1, s_q, 1)
    L = torch.tensor(seq).view(B, 1, 1)
    QL = torch.tensor(ql).view(B, 1, 1)
    visible = (t < L) & (i < QL)
    if causal:
        visible &= t <= L - QL + i
    scale = spec.softmax_scale if softmax_scale is None else softmax_scale
    scores = torch.einsum("bshd,btd->bhst", q, K) * scale
    return masked_softmax_attention(scores, visible.unsqueeze(1), K[..., :spec.kv_lora_rank])


def oracle_sparse(q, slot_values, indices, topk_length, q_lens, spec):
    """fp64 softmax over exactly the counted valid slots of each token (a multiset).

    ``slot_values`` fp64 ``[n_slots, d_qk]``: the key each global slot holds.
    """
    B, s_q, h, d = q.shape
    out = torch.zeros(B, s_q, h, spec.kv_lora_rank, dtype=torch.float64)
    lse = torch.full((B, h, s_q), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for i in range(q_lens[b]):
            sel = [s for s in indices[b, i, :topk_length[b]].tolist() if s >= 0]
            if not sel:
                continue
            K = slot_values[sel].unsqueeze(0)  # [1, n, d]
            scores = torch.einsum("hd,btd->bht", q[b, i].double(), K).unsqueeze(2) * spec.softmax_scale
            o, l = masked_softmax_attention(scores, torch.ones(1, 1, 1, len(sel), dtype=torch.bool),
                                            K[..., :spec.kv_lora_rank])
            out[b, i], lse[b, :, i] = o[0, 0], l[0, :, 0]
    return out, lse


def masked_softmax_attention(scores, visible, values):
    """``scores [B, h, s, n]``, ``visible`` bool broadcastable to it, ``values [B, n, v]`` ->
    ``(out [B, s, h, v], lse [B, h, s])``; a token with nothing visible gives 0 and -inf."""
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # -inf - -inf rows
    out = torch.einsum("bhst,btv->bshv", probs, values)
    return out, lse


def assert_close_rows(out, ref, *, rtol: float, what: str = "out"):
    """Per-(request, token, head) max error relative to that row's magnitude (no global norm
    that could hide one bad row)."""
    out = out.to(torch.float64)
    ref = ref.to(torch.float64)
    err = (out - ref).abs().amax(dim=-1)
    mag = ref.abs().amax(dim=-1).clamp_min(1.0)
    bad = err > rtol * mag
    if bool(bad.any()):
        worst = (err / mag).flatten().argmax().item()
        index = []
        for size in reversed(err.shape):
            index.append(worst % size)
            worst //= size
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} rows off by more than rtol={rtol:g}; "
                             f"worst err {float(err.max()):.3e} at row {tuple(reversed(index))}")


def assert_lse_close(lse, ref, *, atol: float):
    """lse equal within ``atol`` plus its fp32 rounding (lse is returned in fp32) where
    finite, and -inf exactly where the oracle has -inf."""
    lse = lse.to(torch.float64)
    ref = ref.to(torch.float64)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "lse -inf pattern differs"
    fin = torch.isfinite(ref)
    assert torch.isfinite(lse[fin]).all()
    if fin.any():
        excess = (lse[fin] - ref[fin]).abs() - (atol + 2.0 ** -24 * ref[fin].abs())
        assert float(excess.max()) <= 0, f"lse off by {float(excess.max()):.3e} beyond tolerance"


@st.composite
def dense_params(draw, max_B: int = 4, max_s_q: int = 4, max_len: int = 40, specs=None):
    """Structural parameters of a dense decode batch: dict for ``build_case``."""
    spec = draw(st.sampled_from(specs or SMALL_SPECS))
    B = draw(st.integers(1, max_B))
    s_q = draw(st.integers(1, max_s_q))
    page_size = draw(st.sampled_from([1, 3, 4, 16]))
    seq_lens = draw(st.lists(st.integers(0, max_len), min_size=B, max_size=B))
    q_lens = [draw(st.integers(0, min(s_q, L))) for L in seq_lens]
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return dict(spec=spec, seq_lens=seq_lens, q_lens=q_lens, s_q=s_q, page_size=page_size, seed=seed)

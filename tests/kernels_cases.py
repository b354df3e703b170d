"""Shared builders and checks for the Triton kernel tests (tests/test_kernels_*.py).

A case is a random paged batch written through ``mla_ref.write_kv_cache`` into physical
pages handed out in a random order, with every slot that holds no real token — the tail of
each last page, the spare pages and the null page 0 — poisoned with NaN, and padding query
tokens NaN too: a kernel that reads anything it should not turns the result NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from hypothesis import strategies as st

from mla_fuzz import mla_ref
from mla_fuzz.mla_ref import DecodeBatch, ModelSpec

Q_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "fp8_e4m3": torch.bfloat16}
#: the fp8_e4m3 cases' default per-tensor scale: randn keys use the top of the e4m3 range
E4M3_SCALE = 2.0 ** -5

# Interpreter: dots run in fp32 like the reference, so only the final rounding to the
# output dtype differs (RNE both sides; <= 1 ulp where fp32 noise straddles a tie).
# GPU: P is rounded to the 16-bit dot dtype and FP8 keys are dequantised to bf16 before the
# tensor-core dots, so the bounds are those of 16-bit attention.
TOL_INTERP = {torch.bfloat16: (1e-3, 2 ** -7, 1e-4), torch.float16: (2e-4, 2 ** -9, 1e-4),
              torch.float32: (1e-5, 1e-5, 1e-5)}
TOL_GPU = {torch.bfloat16: (2e-2, 2e-2, 2e-2), torch.float16: (4e-3, 4e-3, 5e-3),
           torch.float32: (1e-4, 1e-4, 1e-4)}


@dataclass
class DecodeCase:
    spec: ModelSpec
    q: torch.Tensor               # [B, s_q, h, d_qk]
    kv_cache: torch.Tensor
    block_table: torch.Tensor     # int32 [B, cols]
    seq_lens: torch.Tensor        # int32 [B]
    q_lens: torch.Tensor          # int32 [B]
    page_size: int
    null_block: int = 0
    k_scale: Optional[torch.Tensor] = None  # fp8_e4m3 only: fp32 [1] on the case's device

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    def slot(self, b: int, t: int) -> int:
        return int(self.block_table[b, t // self.page_size]) * self.page_size + t % self.page_size


def make_case(spec: ModelSpec, *, seq_lens, q_lens, s_q: int, page_size: int, kv_dtype: str,
              q_dtype: Optional[torch.dtype] = None, seed: int = 0, device="cpu",
              k_scale: Optional[float] = None) -> DecodeCase:
    """A random decode batch (see the module doc). ``q_lens[b] <= min(s_q, seq_lens[b])``.
    ``kv_dtype="fp8_e4m3"``: written with ``k_scale`` (default ``E4M3_SCALE``), kept as the
    case's fp32 ``[1]`` tensor; its poison is the NaN code."""
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    pages = [-(-int(L) // page_size) for L in seq_lens]
    num_blocks = sum(pages) + 2  # + null page 0 + one spare
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cols = max(pages + [1]) + 1
    block_table = torch.zeros(B, cols, dtype=torch.int32)  # unused columns -> the NaN null page
    for b, n in enumerate(pages):
        for c in range(n):
            block_table[b, c] = physical.pop()
    cache = mla_ref.make_kv_cache(spec, num_blocks, page_size, kv_dtype, fill=float("nan"))
    case = DecodeCase(spec=spec, q=None, kv_cache=cache, block_table=block_table,
                      seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                      q_lens=torch.tensor(q_lens, dtype=torch.int32), page_size=page_size)
    if kv_dtype == "fp8_e4m3":
        case.k_scale = torch.tensor([E4M3_SCALE if k_scale is None else k_scale], dtype=torch.float32)
    slots = [case.slot(b, t) for b in range(B) for t in range(int(seq_lens[b]))]
    if slots:
        T = len(slots)
        latent = torch.randn(T, spec.kv_lora_rank, generator=gen)
        rope = torch.randn(T, spec.qk_rope_head_dim, generator=gen)
        mla_ref.write_kv_cache(cache, latent, rope, torch.tensor(slots, dtype=torch.int64), spec=spec,
                               k_scale=case.k_scale)
    q = torch.randn(B, s_q, spec.num_heads, spec.d_qk, generator=gen)
    for b in range(B):
        q[b, int(q_lens[b]):] = float("nan")  # padding tokens: must never matter
    case.q = q.to(q_dtype or Q_DTYPE[kv_dtype])
    dev = torch.device(device)
    for name in ("q", "kv_cache", "block_table", "seq_lens", "q_lens", "k_scale"):
        if getattr(case, name) is not None:
            setattr(case, name, getattr(case, name).to(dev))
    return case


@st.composite
def lens_strategy(draw, *, max_batch: int, max_len: int, s_q: int, page_size: int):
    """``(seq_lens, q_lens)``: lengths biased to 0, 1 and page boundaries; mixed q_lens."""
    B = draw(st.integers(1, max_batch))
    special = [0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size, max_len]
    seq = [draw(st.one_of(st.sampled_from([v for v in special if 0 <= v <= max_len]),
                          st.integers(0, max_len))) for _ in range(B)]
    ql = [draw(st.integers(0, min(s_q, L))) for L in seq]
    return seq, ql


def assert_decode_close(out, lse, ref_out, ref_lse, *, tol, what: str = "") -> None:
    """Per element: ``|out - ref| <= atol + rtol * |ref|``, ``|lse - ref| <= lse_tol`` where
    finite, the same -inf pattern, and exactly 0 output wherever the reference lse is -inf."""
    atol, rtol, lse_tol = tol
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype, (out.shape, out.dtype, ref_out.shape)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    out, ref_out = out.float().cpu(), ref_out.float().cpu()
    lse, ref_lse = lse.cpu(), ref_lse.cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite output at {torch.nonzero(~torch.isfinite(out))[:4].tolist()}"
    empty = torch.isneginf(ref_lse)  # [B, h, s_q]
    assert torch.equal(torch.isneginf(lse), empty), \
        f"{what}: -inf lse pattern differs at {torch.nonzero(torch.isneginf(lse) != empty)[:4].tolist()}"
    assert not torch.isnan(lse).any(), f"{what}: NaN lse"
    err = (out - ref_out).abs() - (atol + rtol * ref_out.abs())
    if (err > 0).any():
        b, i, h, r = [int(v) for v in torch.nonzero(err > 0)[0]]
        raise AssertionError(f"{what}: out[{b},{i},{h},{r}] = {out[b, i, h, r]:.6g} vs ref {ref_out[b, i, h, r]:.6g} "
                             f"(max excess {err.max():.3g}, atol {atol}, rtol {rtol})")
    fin = ~empty
    lerr = (lse[fin] - ref_lse[fin]).abs()
    assert lerr.numel() == 0 or lerr.max() <= lse_tol, f"{what}: lse error {lerr.max():.3g} > {lse_tol}"
    zero_rows = empty.permute(0, 2, 1)  # [B, s_q, h]
    assert (out[zero_rows] == 0).all(), f"{what}: rows without keys must be exactly 0"


def spy_launches(monkeypatch, module, name: str, *keys: str) -> list:
    """Replace the kernel object ``module.<name>`` (launched as ``kernel[grid](*args, **kw)``)
    by one that records ``tuple(kw[k] for k in keys)`` of each launch, then launches the real
    kernel. Returns the list the records go to (one tuple a launch, in launch order)."""
    seen = []
    real = getattr(module, name)

    class _Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(tuple(kw[k] for k in keys))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(module, name, _Spy())
    return seen


def batch_of(case, *, next_n, pad_to=None, kv_dtype="bf16", max_decode_len=None, k_scale=None):
    """The ``DecodeBatch`` of a case: this step's tokens are the last q_len of each request
    (an fp8_e4m3 batch carries ``k_scale``, default the case's)."""
    B = case.batch
    slots = torch.full((B, next_n), -1, dtype=torch.int64)
    for b in range(B):
        L, ql = int(case.seq_lens[b]), int(case.q_lens[b])
        for i in range(ql):
            slots[b, i] = case.slot(b, L - ql + i)
    if kv_dtype == "fp8_e4m3" and k_scale is None:
        k_scale = case.k_scale
    return DecodeBatch(seq_lens=case.seq_lens.cpu(), q_lens=case.q_lens.cpu(), block_table=case.block_table.cpu(),
                       slot_mapping=slots, page_size=case.page_size, next_n=next_n, pad_to=pad_to,
                       kv_dtype=kv_dtype, null_block=case.null_block, max_decode_len=max_decode_len,
                       k_scale=k_scale if kv_dtype == "fp8_e4m3" else None)

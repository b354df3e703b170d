"""One MLA layer's decode step, in two mathematically equal forms.

*absorbed* (what serving engines run): W_uk is folded into the query so attention runs in
the latent space via ``mla_decode``, and W_uv is applied after. *naive*: the latent cache is
decompressed into per-head K and V and ordinary attention runs on them. Both share every
sub-step up to the cache write, so naive == absorbed tests the latent attention op and the
absorption algebra, not two copies of the projections.

Precision policy: every sub-step computes in fp32 (fp64 for fp64 inputs) and returns the
activation dtype (``hidden``'s), as an engine materialises activations between kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Union

import torch

from .cache import gather_kv, write_kv_cache
from .decode import DecodePlan, check_decode_args, mla_decode
from .fp8 import FP8_AMAX_FLOOR, FP8_E4M3_MAX, ieee_div
from .fp8_tensor import KScale
from .spec import ModelSpec


_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@dataclass
class MLALayerWeights:
    """Weights of one MLA attention layer (``nn.Linear`` convention: ``[out, in]``).

    - ``q_a_proj`` ``[q_lora_rank, hidden]``, ``q_a_norm`` ``[q_lora_rank]``
    - ``q_b_proj`` ``[h * (nope + rope), q_lora_rank]`` (per head: nope rows then rope rows)
    - ``kv_a_proj`` ``[rank + rope, hidden]`` (latent rows then the shared k_rope rows)
    - ``kv_a_norm`` ``[rank]``
    - ``kv_b_proj`` ``[h * (nope + v), rank]`` (per head: W_uk's nope rows then W_uv's v rows)
    - ``o_proj`` ``[hidden, h * v]``
    """

    q_a_proj: torch.Tensor
    q_a_norm: torch.Tensor
    q_b_proj: torch.Tensor
    kv_a_proj: torch.Tensor
    kv_a_norm: torch.Tensor
    kv_b_proj: torch.Tensor
    o_proj: torch.Tensor

    @classmethod
    def random(cls, spec: ModelSpec, seed: int, dtype: torch.dtype = torch.bfloat16,
               device: Union[str, torch.device] = "cpu") -> "MLALayerWeights":
        """Seeded random weights; each projection is scaled by 1/sqrt(fan_in) so that O(1)
        inputs give O(1) activations (and softmax scores that are neither flat nor one-hot)."""
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        h, nope, rope, v = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        rank = spec.kv_lora_rank

        def proj(out_f: int, in_f: int) -> torch.Tensor:
            return torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5

        def norm(n: int) -> torch.Tensor:
            return 1.0 + 0.1 * torch.randn(n, generator=gen)

        tensors = dict(
            q_a_proj=proj(spec.q_lora_rank, spec.hidden),
            q_a_norm=norm(spec.q_lora_rank),
            q_b_proj=proj(h * (nope + rope), spec.q_lora_rank),
            kv_a_proj=proj(rank + rope, spec.hidden),
            kv_a_norm=norm(rank),
            kv_b_proj=proj(h * (nope + v), rank),
            o_proj=proj(spec.hidden, h * v),
        )
        return cls(**{k: t.to(device=device, dtype=dtype) for k, t in tensors.items()})

    def to(self, *args, **kwargs) -> "MLALayerWeights":
        """A copy with every tensor passed through ``Tensor.to(*args, **kwargs)``."""
        return MLALayerWeights(**{f.name: getattr(self, f.name).to(*args, **kwargs) for f in fields(self)})

    def w_uk(self, spec: ModelSpec) -> torch.Tensor:
        """``[h, nope, rank]``: maps the latent to each head's nope key (K_nope = latent @ W_uk[h]^T)."""
        w = self.kv_b_proj.view(spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
        return w[:, :spec.qk_nope_head_dim]

    def w_uv(self, spec: ModelSpec) -> torch.Tensor:
        """``[h, v, rank]``: maps the latent to each head's value (V = latent @ W_uv[h]^T)."""
        w = self.kv_b_proj.view(spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
        return w[:, spec.qk_nope_head_dim:]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim (pass ``spec.rms_eps``). ``x [..., n]`` float, ``weight [n]``;
    returns x's dtype."""
    c = _compute_dtype(x)
    xf = x.to(c)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(c)).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, *, spec: Optional[ModelSpec] = None,
               theta: Optional[float] = None) -> torch.Tensor:
    """Rotate-half RoPE (first half / second half pairing, as in DeepSeek's HF code).

    Args:
        x: ``[..., rope]`` float, ``rope`` even.
        positions: int64 whose shape is a prefix of ``x.shape[:-1]`` (e.g. ``[B, s]`` for a
            ``[B, s, h, rope]`` query); trailing dims (heads) share the position.
        spec / theta: the RoPE base is ``theta`` if given, else ``spec.rope_theta``, else 10000.
    Returns:
        rotated ``x`` in x's dtype.
    """
    if theta is None:
        theta = spec.rope_theta if spec is not None else 10000.0
    rope = x.shape[-1]
    if rope % 2:
        raise ValueError(f"x last dim must be even for RoPE, got {rope}")
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be an int64 tensor, got "
                         f"{positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__}")
    lead = tuple(x.shape[:-1])
    if tuple(positions.shape) != lead[:positions.dim()]:
        raise ValueError(f"positions shape must be a prefix of x's leading shape {lead}, got {tuple(positions.shape)}")
    pos = positions.reshape(tuple(positions.shape) + (1,) * (len(lead) - positions.dim()))
    # angles in fp64: at position ~1e4 an fp32 angle is already off by ~1e-3 rad
    inv_freq = theta ** (-torch.arange(0, rope, 2, dtype=torch.float64, device=x.device) / rope)
    angles = pos.to(torch.float64).unsqueeze(-1) * inv_freq  # [..., rope/2]
    c = _compute_dtype(x)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(c)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(c)
    xf = x.to(c)
    half = rope // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    c = _compute_dtype(x)
    return x.to(c) @ weight.to(c).T


def project_q(w: MLALayerWeights, hidden: torch.Tensor, positions: torch.Tensor, *,
              spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Query projection with q-LoRA: ``q_b(norm(q_a(hidden)))``, RoPE on the rope part.

    Args:
        hidden: ``[B, s, hidden]`` float; positions: int64 ``[B, s]``.
    Returns:
        ``(q_nope [B, s, h, nope], q_rope [B, s, h, rope])`` in hidden's dtype.
    """
    B, s, _ = hidden.shape
    c_q = rms_norm(_linear(hidden, w.q_a_proj).to(hidden.dtype), w.q_a_norm, spec.rms_eps)
    q = _linear(c_q, w.q_b_proj).to(hidden.dtype)
    q = q.view(B, s, spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    q_nope, q_rope = q[..., :spec.qk_nope_head_dim], q[..., spec.qk_nope_head_dim:]
    return q_nope.contiguous(), apply_rope(q_rope, positions, spec=spec)


def compress_kv(w: MLALayerWeights, hidden: torch.Tensor, positions: torch.Tensor, *,
                spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """KV compression: the normed latent and the (shared across heads) rotated k_rope.

    Args:
        hidden: ``[B, s, hidden]`` float; positions: int64 ``[B, s]``.
    Returns:
        ``(latent [B, s, rank], k_rope [B, s, rope])`` in hidden's dtype.
    """
    kv = _linear(hidden, w.kv_a_proj).to(hidden.dtype)
    latent = rms_norm(kv[..., :spec.kv_lora_rank], w.kv_a_norm, spec.rms_eps)
    k_rope = apply_rope(kv[..., spec.kv_lora_rank:], positions, spec=spec)
    return latent, k_rope


def absorb_q(w: MLALayerWeights, q_nope: torch.Tensor, q_rope: torch.Tensor, *, spec: ModelSpec) -> torch.Tensor:
    """Fold W_uk into the query: ``q_latent[h] = q_nope[h] @ W_uk[h]``, then append q_rope.

    Args:
        q_nope: ``[B, s, h, nope]``; q_rope: ``[B, s, h, rope]``.
    Returns:
        ``q [B, s, h, d_qk]`` in q_nope's dtype, ready for ``mla_decode``.
    """
    c = _compute_dtype(q_nope)
    q_latent = torch.einsum("bshn,hnr->bshr", q_nope.to(c), w.w_uk(spec).to(c))
    return torch.cat([q_latent, q_rope.to(c)], dim=-1).to(q_nope.dtype)


def unabsorb_out(w: MLALayerWeights, out_latent: torch.Tensor, *, spec: ModelSpec) -> torch.Tensor:
    """Apply W_uv to the latent attention output.

    Args:
        out_latent: ``[B, s, h, rank]``.
    Returns:
        ``[B, s, h, v]`` in out_latent's dtype.
    """
    c = _compute_dtype(out_latent)
    return torch.einsum("bshr,hvr->bshv", out_latent.to(c), w.w_uv(spec).to(c)).to(out_latent.dtype)


def quantize_fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 quantisation: ONE amax over the whole tensor (NaN anywhere poisons all).

    Returns:
        ``(x_fp8 float8_e4m3fn, same shape as x; scale fp32 0-d)`` with ``x ~ x_fp8 * scale``.
    """
    xf = x.float()
    scale = ieee_div(xf.abs().amax().clamp_min(FP8_AMAX_FLOOR), FP8_E4M3_MAX)
    return (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def o_project(w: MLALayerWeights, attn: torch.Tensor, *, spec: ModelSpec, fp8_out: bool = False) -> torch.Tensor:
    """Output projection.

    Args:
        attn: ``[B, s, h, v]``.
        fp8_out: quantise ``attn`` per tensor (one amax over the whole batch tensor, padding
            rows included, as real engines do) before the projection.
    Returns:
        ``[B, s, hidden]`` in attn's dtype.
    """
    B, s = attn.shape[:2]
    x = attn.reshape(B, s, spec.num_heads * spec.v_head_dim)
    c = _compute_dtype(attn)
    if fp8_out:
        x_fp8, scale = quantize_fp8_per_tensor(x)
        x = x_fp8.to(c) * scale.to(c)
    return _linear(x.to(c), w.o_proj).to(attn.dtype)


def _check_layer_args(hidden, positions, kv_cache, block_table, cache_seqlens, slot_mapping, q_lens,
                      spec: ModelSpec, k_scale: Optional[KScale] = None) -> DecodePlan:
    """Validate everything before the cache is touched, so bad input leaves it unchanged."""
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in _ACT_DTYPES or hidden.dim() != 3 \
            or hidden.shape[2] != spec.hidden:
        raise ValueError(f"hidden must be a bf16/fp16/fp32/fp64 [B, s_q, hidden={spec.hidden}] tensor, got "
                         f"{(hidden.dtype, tuple(hidden.shape)) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
    B, s_q = hidden.shape[:2]
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (B, s_q):
            raise ValueError(f"{name} must be int64 [B={B}, s_q={s_q}], got "
                             f"{(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__}")
    # the attention metadata contract is mla_decode's; q's shape is what project_q will produce
    q_shape_only = torch.empty(B, s_q, spec.num_heads, spec.d_qk, dtype=hidden.dtype, device="meta")
    return check_decode_args(q_shape_only, kv_cache, block_table, cache_seqlens, spec=spec, q_lens=q_lens,
                             k_scale=k_scale)


def _write_step(w, hidden, positions, kv_cache, slot_mapping, spec, k_scale=None) -> None:
    latent, k_rope = compress_kv(w, hidden, positions, spec=spec)
    write_kv_cache(kv_cache, latent.reshape(-1, spec.kv_lora_rank), k_rope.reshape(-1, spec.qk_rope_head_dim),
                   slot_mapping.reshape(-1), spec=spec, k_scale=k_scale)


def mla_layer_decode_absorbed(w: MLALayerWeights, hidden: torch.Tensor, positions: torch.Tensor,
                              kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                              slot_mapping: torch.Tensor, *, spec: ModelSpec, q_lens: Optional[torch.Tensor] = None,
                              fp8_out: bool = False, k_scale: Optional[KScale] = None) -> torch.Tensor:
    """One decode step of the layer, absorbed form (latent attention through ``mla_decode``).

    Writes this step's latent KV into ``kv_cache`` (in place; slot -1 skipped) first.

    Args:
        hidden: ``[B, s_q, hidden]`` float; positions: int64 ``[B, s_q]``.
        kv_cache / block_table / cache_seqlens / q_lens: as ``mla_decode`` (seq lens include
            this step's tokens).
        slot_mapping: int64 ``[B, s_q]`` global slot of each token, -1 = do not write.
        fp8_out: per-tensor FP8 quantisation of the attention output before o_proj.
        k_scale: the fp8_e4m3 cache's per-tensor scale (float or 1-element fp32 tensor), used
            for the write and the attention; required for that cache, refused for any other.
    Returns:
        ``[B, s_q, hidden]`` in hidden's dtype; padding tokens (``i >= q_lens``) are 0.
    """
    plan = _check_layer_args(hidden, positions, kv_cache, block_table, cache_seqlens, slot_mapping, q_lens, spec,
                             k_scale)
    _write_step(w, hidden, positions, kv_cache, slot_mapping, spec, plan.k_scale)
    q_nope, q_rope = project_q(w, hidden, positions, spec=spec)
    q = absorb_q(w, q_nope, q_rope, spec=spec)
    out_latent, _ = mla_decode(q, kv_cache, block_table, cache_seqlens, spec=spec, q_lens=q_lens,
                               k_scale=plan.k_scale)
    return o_project(w, unabsorb_out(w, out_latent, spec=spec), spec=spec, fp8_out=fp8_out)


def mla_layer_decode_naive(w: MLALayerWeights, hidden: torch.Tensor, positions: torch.Tensor,
                           kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                           slot_mapping: torch.Tensor, *, spec: ModelSpec, q_lens: Optional[torch.Tensor] = None,
                           fp8_out: bool = False, k_scale: Optional[KScale] = None) -> torch.Tensor:
    """One decode step of the layer, naive form: same signature and result as
    ``mla_layer_decode_absorbed``, but the latent cache is decompressed into per-head
    ``K = [latent @ W_uk^T, k_rope]`` and ``V = latent @ W_uv^T`` and standard bottom-right
    causal attention runs with ``q = [q_nope, q_rope]`` (no absorption). ``k_scale``: as there.

    Returns:
        ``[B, s_q, hidden]`` in hidden's dtype; padding tokens are 0 rows before o_proj.
    """
    plan = _check_layer_args(hidden, positions, kv_cache, block_table, cache_seqlens, slot_mapping, q_lens, spec,
                             k_scale)
    _write_step(w, hidden, positions, kv_cache, slot_mapping, spec, plan.k_scale)
    q_nope, q_rope = project_q(w, hidden, positions, spec=spec)
    B, s_q, h, _ = q_nope.shape
    c = _compute_dtype(hidden)
    w_uk, w_uv = w.w_uk(spec).to(c), w.w_uv(spec).to(c)
    q_full = torch.cat([q_nope, q_rope], dim=-1).to(c)  # [B, s, h, nope + rope]
    attn = torch.zeros(B, s_q, h, spec.v_head_dim, dtype=c, device=hidden.device)
    for b in range(B):
        L, ql = plan.seq_lens[b], plan.q_lens[b]
        kv = gather_kv(kv_cache, block_table[b], L, spec=spec, dtype=c, k_scale=plan.k_scale).to(hidden.device)
        latent, k_rope = kv[:, :spec.kv_lora_rank], kv[:, spec.kv_lora_rank:]
        k_nope = torch.einsum("tr,hnr->htn", latent, w_uk)  # [h, L, nope]
        values = torch.einsum("tr,hvr->htv", latent, w_uv)  # [h, L, v]
        keys = torch.cat([k_nope, k_rope.unsqueeze(0).expand(h, L, spec.qk_rope_head_dim)], dim=-1)
        for i in range(ql):
            n_vis = max(L - ql + i + 1, 0)
            if n_vis == 0:
                continue
            scores = torch.einsum("hd,htd->ht", q_full[b, i], keys[:, :n_vis]) * spec.softmax_scale
            attn[b, i] = torch.einsum("ht,htv->hv", torch.softmax(scores, dim=-1), values[:, :n_vis])
    return o_project(w, attn.to(hidden.dtype), spec=spec, fp8_out=fp8_out)

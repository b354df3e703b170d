"""The layer decode step: naive == absorbed, MTP == token by token, cache writes, sub-steps."""
import math

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mla_fuzz.mla_ref import (MLALayerWeights, ModelSpec, apply_rope, make_kv_cache, mla_layer_decode_absorbed,
                     mla_layer_decode_naive, o_project, quantize_fp8_per_tensor, quantize_kv_fp8, rms_norm)
from ref_cases import MICRO, SMALL_SPECS, assert_close_rows

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=25)

# naive vs absorbed, relative to each output row's magnitude. The forms differ in where
# the activation dtype rounds (absorbed rounds q_latent and the latent output, naive rounds
# the per-head output), so 16-bit tolerances are a few ulps of the dtype, fp32/fp64 tight.
LAYER_TOL = {torch.float64: 1e-13, torch.float32: 3e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}
KV_FOR = {torch.float64: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def build_step(spec, *, seq_lens, q_lens, s_q, page_size, dtype, kv_dtype, seed, poison=False):
    """A layer step: history tokens already in the cache, this step's tokens to be written.

    Returns ``(args, kwargs)`` for the layer functions (the cache is the first positional
    after hidden/positions; callers clone it per call)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    pages = [-(-L // page_size) for L in seq_lens]
    num_blocks = sum(pages) + 1
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    cols = max(pages + [1]) + 1
    block_table = torch.full((B, cols), -99, dtype=torch.int32)  # garbage past the used pages
    for b, n in enumerate(pages):
        for p in range(n):
            block_table[b, p] = physical.pop()
    kv_cache = make_kv_cache(spec, num_blocks, page_size, kv_dtype, fill=float("nan") if poison else None)
    flat = kv_cache.view(num_blocks * page_size, -1)
    slot_mapping = torch.full((B, s_q), -1, dtype=torch.int64)
    positions = torch.zeros(B, s_q, dtype=torch.int64)
    for b, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        for t in range(L - ql):  # history: random latent rows of the activation scale
            slot = int(block_table[b, t // page_size]) * page_size + t % page_size
            token = torch.randn(spec.d_qk, generator=gen)
            if kv_dtype == "fp8":
                flat[slot] = quantize_kv_fp8(token[:spec.kv_lora_rank], token[spec.kv_lora_rank:], spec=spec)
            else:
                flat[slot] = token.to(kv_cache.dtype)
        for i in range(ql):
            t = L - ql + i
            slot_mapping[b, i] = int(block_table[b, t // page_size]) * page_size + t % page_size
            positions[b, i] = t
    hidden = torch.randn(B, s_q, spec.hidden, generator=gen, dtype=torch.float64).to(dtype)
    return dict(hidden=hidden, positions=positions, kv_cache=kv_cache, block_table=block_table,
                cache_seqlens=torch.tensor(seq_lens, dtype=torch.int32), slot_mapping=slot_mapping,
                q_lens=torch.tensor(q_lens, dtype=torch.int32))


def run_layer(fn, w, step, spec, **extra):
    kw = dict(step)
    kw["kv_cache"] = step["kv_cache"].clone()
    out = fn(w, kw.pop("hidden"), kw.pop("positions"), kw.pop("kv_cache"), kw.pop("block_table"),
             kw.pop("cache_seqlens"), kw.pop("slot_mapping"), spec=spec, **kw, **extra)
    return out


@st.composite
def layer_params(draw, max_B=3, max_s_q=3, max_len=24):
    B = draw(st.integers(1, max_B))
    s_q = draw(st.integers(1, max_s_q))
    seq_lens = draw(st.lists(st.integers(0, max_len), min_size=B, max_size=B))
    q_lens = [draw(st.integers(0, min(s_q, L))) for L in seq_lens]
    return dict(seq_lens=seq_lens, q_lens=q_lens, s_q=s_q, page_size=draw(st.sampled_from([1, 4, 16])),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


@SETTINGS
@given(spec=st.sampled_from(SMALL_SPECS), p=layer_params(), dtype=st.sampled_from(list(LAYER_TOL)),
       fp8_kv=st.booleans(), poison=st.booleans())
def test_naive_equals_absorbed(spec, p, dtype, fp8_kv, poison):
    kv_dtype = "fp8" if fp8_kv else KV_FOR[dtype]
    w = MLALayerWeights.random(spec, seed=p["seed"] + 1, dtype=dtype)
    step = build_step(spec, **p, dtype=dtype, kv_dtype=kv_dtype, poison=poison)
    absorbed = run_layer(mla_layer_decode_absorbed, w, step, spec)
    naive = run_layer(mla_layer_decode_naive, w, step, spec)
    assert absorbed.dtype == dtype and tuple(absorbed.shape) == tuple(step["hidden"].shape)
    assert bool(naive.isfinite().all()) and bool(absorbed.isfinite().all())
    assert_close_rows(absorbed, naive, rtol=LAYER_TOL[dtype], what="absorbed vs naive")
    for b, ql in enumerate(p["q_lens"]):  # padding tokens: 0 rows through a bias-free o_proj
        assert torch.equal(absorbed[b, ql:], torch.zeros_like(absorbed[b, ql:]))
        assert torch.equal(naive[b, ql:], torch.zeros_like(naive[b, ql:]))


def test_naive_equals_absorbed_at_deepseek_size():
    """DeepSeek-V3 per-head and model dims (rank 512, rope 64, nope 128, v 128, q_lora 1536,
    hidden 7168) with 16 of the 128 heads: the full 187M-parameter layer costs seconds of
    random-number generation alone, while heads are independent and h=128 is covered by
    the op-level DeepSeek test."""
    spec = ModelSpec(num_heads=16)
    w = MLALayerWeights.random(spec, seed=5, dtype=torch.bfloat16)
    step = build_step(spec, seq_lens=[70, 3, 0], q_lens=[2, 1, 0], s_q=2, page_size=64, dtype=torch.bfloat16,
                      kv_dtype="bf16", seed=6, poison=True)
    absorbed = run_layer(mla_layer_decode_absorbed, w, step, spec)
    naive = run_layer(mla_layer_decode_naive, w, step, spec)
    assert_close_rows(absorbed, naive, rtol=LAYER_TOL[torch.bfloat16], what="absorbed vs naive")
    assert float(naive[0].abs().max()) > 0.05  # activations are O(1)-ish, not vanishing


@settings(SETTINGS, max_examples=15)
@given(spec=st.sampled_from(SMALL_SPECS), p=layer_params(), naive=st.booleans())
def test_mtp_step_equals_token_by_token(spec, p, naive):
    """Decoding q_len tokens at once == decoding them one at a time, each step writing its
    own token and seeing a cache one token longer."""
    fn = mla_layer_decode_naive if naive else mla_layer_decode_absorbed
    w = MLALayerWeights.random(spec, seed=p["seed"], dtype=torch.float64)
    step = build_step(spec, **p, dtype=torch.float64, kv_dtype="fp32")
    together = run_layer(fn, w, step, spec)
    cache = step["kv_cache"].clone()
    B = len(p["seq_lens"])
    for i in range(p["s_q"]):
        real = torch.tensor([i < ql for ql in p["q_lens"]])
        lens = torch.tensor([L - ql + i + 1 if i < ql else L for L, ql in zip(p["seq_lens"], p["q_lens"])],
                            dtype=torch.int32)
        one = fn(w, step["hidden"][:, i:i + 1], step["positions"][:, i:i + 1], cache, step["block_table"], lens,
                 step["slot_mapping"][:, i:i + 1], spec=spec, q_lens=real.to(torch.int32))
        for b in range(B):
            if real[b]:
                torch.testing.assert_close(one[b, 0], together[b, i], rtol=1e-10, atol=1e-12)


def test_q_lens_none_means_every_token_is_real():
    spec = ModelSpec.tiny(num_heads=3)
    w = MLALayerWeights.random(spec, seed=4, dtype=torch.float32)
    step = build_step(spec, seq_lens=[5, 9], q_lens=[2, 2], s_q=2, page_size=4, dtype=torch.float32,
                      kv_dtype="fp32", seed=4)
    for fn in (mla_layer_decode_absorbed, mla_layer_decode_naive):
        explicit = run_layer(fn, w, step, spec)
        implicit = run_layer(fn, w, {**step, "q_lens": None}, spec)
        assert torch.equal(explicit, implicit)


@SETTINGS
@given(spec=st.sampled_from(SMALL_SPECS), p=layer_params(), kv_dtype=st.sampled_from(["bf16", "fp8"]))
def test_layer_writes_exactly_the_mapped_slots(spec, p, kv_dtype):
    """Slots with -1 (padding tokens) are never written; every other slot stays bit-identical."""
    w = MLALayerWeights.random(spec, seed=1, dtype=torch.bfloat16)
    step = build_step(spec, **p, dtype=torch.bfloat16, kv_dtype=kv_dtype, poison=True)
    cache = step["kv_cache"].clone()
    mla_layer_decode_absorbed(w, step["hidden"], step["positions"], cache, step["block_table"],
                              step["cache_seqlens"], step["slot_mapping"], spec=spec, q_lens=step["q_lens"])
    n = cache.shape[0] * cache.shape[1]
    before = step["kv_cache"].reshape(n, -1).view(torch.uint8)
    after = cache.reshape(n, -1).view(torch.uint8)
    written = set(s for s in step["slot_mapping"].flatten().tolist() if s >= 0)
    for slot in range(n):
        assert torch.equal(before[slot], after[slot]) != (slot in written), slot


def test_fp8_out_padding_zeros_do_not_move_real_rows_but_nan_padding_poisons_all():
    """The per-tensor amax sees the whole batch: zero padding is harmless, NaN padding (stale
    graph memory, vLLM #37442/#38148) leaks into every real row. The harness relies on both."""
    spec = MICRO
    w = MLALayerWeights.random(spec, seed=2, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    attn = torch.randn(2, 2, spec.num_heads, spec.v_head_dim, generator=gen)
    real = o_project(w, attn, spec=spec, fp8_out=True)
    padded = torch.cat([attn, torch.zeros(2, 2, spec.num_heads, spec.v_head_dim)])
    assert torch.equal(o_project(w, padded, spec=spec, fp8_out=True)[:2], real)
    padded[3, 1, 0, 0] = float("nan")
    assert bool(o_project(w, padded, spec=spec, fp8_out=True)[:2].isnan().all())
    # and quantisation is real: fp8_out differs from the unquantised projection, within 2^-4
    plain = o_project(w, attn, spec=spec)
    assert not torch.equal(plain, real)
    assert float((plain - real).abs().max()) <= 2.0 ** -4 * float(
        (attn.abs().reshape(2, 2, -1) @ w.o_proj.abs().T).max())


@SETTINGS
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), log_mag=st.integers(-20, 20),
       seed=st.integers(0, 2 ** 31 - 1))
def test_per_tensor_fp8_uses_one_amax_and_stays_within_e4m3_bound(shape, log_mag, seed):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2.0 ** log_mag
    x_fp8, scale = quantize_fp8_per_tensor(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scale.dim() == 0
    amax = float(x.abs().max())
    assert math.isclose(float(scale), amax / 448.0, rel_tol=2.0 ** -22)
    # same derivation as the cache's group bound (tests/reference/test_ref_fp8.py), with the tensor as one group
    err = (x_fp8.double() * float(scale) - x).abs()
    assert bool((err <= (2.0 ** -4 + 2.0 ** -20) * x.abs() + (2.0 ** -10 + 2.0 ** -20) * float(scale)).all())


@SETTINGS
@given(m=st.integers(0, 5000), n=st.integers(0, 5000), seed=st.integers(0, 2 ** 31 - 1))
def test_rope_is_a_rotation_with_relative_position_scores(m, n, seed):
    """<rope(q, m), rope(k, n)> depends only on m - n, and norms are preserved."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 16, generator=gen, dtype=torch.float64)
    pos = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    qm, kn = apply_rope(q, pos(m)), apply_rope(k, pos(n))
    shift = 17
    q2, k2 = apply_rope(q, pos(m + shift)), apply_rope(k, pos(n + shift))
    assert math.isclose(float(qm @ kn), float(q2 @ k2), rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(float(qm.norm()), float(q.norm()), rel_tol=1e-12)
    assert torch.equal(apply_rope(q, pos(0)), q)


def test_rope_rotates_half_pairs_at_the_spec_frequencies():
    """Dimension j pairs with j + rope/2 and turns by pos * theta^(-2j/rope)."""
    x = torch.zeros(8, dtype=torch.float64)
    x[1] = 1.0  # pair (1, 5), frequency 10000^(-2/8)
    y = apply_rope(x, torch.tensor(3, dtype=torch.int64), theta=10000.0)
    angle = 3 * 10000.0 ** (-2 / 8)
    expect = torch.zeros(8, dtype=torch.float64)
    expect[1], expect[5] = math.cos(angle), math.sin(angle)
    torch.testing.assert_close(y, expect, rtol=0, atol=1e-15)
    # the base comes from the spec when one is given (theta 100: angle 3 * 100^(-2/8))
    y100 = apply_rope(x, torch.tensor(3, dtype=torch.int64), spec=ModelSpec(qk_rope_head_dim=8, rope_theta=100.0,
                                                                           kv_lora_rank=32, fp8_group=16))
    assert math.isclose(float(y100[5]), math.sin(3 * 100.0 ** (-2 / 8)), rel_tol=1e-14)
    # positions broadcast over trailing (head) dims
    xs = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    ps = torch.tensor([[0, 1, 2], [3, 4, 5]])
    got = apply_rope(xs, ps)
    assert torch.equal(got[1, 2, 3], apply_rope(xs[1, 2, 3], ps[1, 2]))


def test_rms_norm_matches_its_definition():
    x = torch.randn(3, 10, dtype=torch.float64)
    wgt = torch.rand(10, dtype=torch.float64)
    want = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * wgt
    torch.testing.assert_close(rms_norm(x, wgt, 1e-6), want, rtol=1e-14, atol=0)
    assert rms_norm(x.to(torch.bfloat16), wgt, 1e-6).dtype == torch.bfloat16


def test_random_weights_are_seeded_and_shaped():
    spec = ModelSpec.tiny(num_heads=3)
    a, b = MLALayerWeights.random(spec, 7), MLALayerWeights.random(spec, 7)
    c = MLALayerWeights.random(spec, 8)
    h, nope, rope, v, rank = 3, 32, 16, 32, 64
    shapes = dict(q_a_proj=(48, 64), q_a_norm=(48,), q_b_proj=(h * (nope + rope), 48), kv_a_proj=(rank + rope, 64),
                  kv_a_norm=(rank,), kv_b_proj=(h * (nope + v), rank), o_proj=(64, h * v))
    for name, shape in shapes.items():
        assert tuple(getattr(a, name).shape) == shape, name
        assert getattr(a, name).dtype == torch.bfloat16
        assert torch.equal(getattr(a, name), getattr(b, name))
        assert not torch.equal(getattr(a, name), getattr(c, name))

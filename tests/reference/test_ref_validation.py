"""Every ValueError path of mla_ref: bad input is rejected with a message naming the argument."""
import re

import pytest
import torch

from mla_fuzz.mla_ref import (MLALayerWeights, apply_rope, gather_kv, make_kv_cache, mla_decode, mla_layer_decode_absorbed,
                     mla_layer_decode_naive, quantize_kv_fp8, write_kv_cache)
from ref_cases import MICRO

SPEC = MICRO  # rank 32 + rope 8 = d_qk 40, 2 heads, fp8 token 32 + 8 + 16 = 56 bytes
I32 = torch.int32


def decode_args(**over):
    """A valid call: B=2, s_q=2, page_size 4, 6 blocks; row 0 needs 2 pages, row 1 one page."""
    args = dict(
        q=torch.zeros(2, 2, 2, 40),
        kv_cache=torch.zeros(6, 4, 1, 40, dtype=torch.bfloat16),
        block_table=torch.tensor([[3, 1, -1], [5, 99, 99]], dtype=I32),  # garbage past needed pages
        cache_seqlens=torch.tensor([7, 2], dtype=I32),
        q_lens=torch.tensor([2, 1], dtype=I32),
        indices=None, topk_length=None)
    args.update(over)
    return args


def call_decode(**over):
    a = decode_args(**over)
    return mla_decode(a.pop("q"), a.pop("kv_cache"), a.pop("block_table"), a.pop("cache_seqlens"), spec=SPEC, **a)


def test_valid_call_passes_and_ignores_unneeded_block_table_entries():
    out, lse = call_decode()
    assert tuple(out.shape) == (2, 2, 2, 32) and tuple(lse.shape) == (2, 2, 2)
    # sparse with garbage past topk_length and in padding tokens' rows
    idx = torch.tensor([[[0, 5, -1], [23, -1, 10 ** 6]], [[4, -9, -9], [-9, -9, -9]]], dtype=I32)
    call_decode(indices=idx, topk_length=torch.tensor([2, 1], dtype=I32))


DECODE_CASES = [
    # (id, overrides, argument named, expected text)
    ("q-dtype", dict(q=torch.zeros(2, 2, 2, 40, dtype=torch.int32)), "q", "bf16/fp16/fp32/fp64"),
    ("q-not-tensor", dict(q=[[0.0]]), "q", "list"),
    ("q-rank", dict(q=torch.zeros(2, 2, 80)), "q", "4-D"),
    ("q-d_qk", dict(q=torch.zeros(2, 2, 2, 41)), "q", "40"),
    ("q-heads", dict(q=torch.zeros(2, 2, 3, 40)), "q", "num_heads = 2"),
    ("kv-dtype", dict(kv_cache=torch.zeros(6, 4, 1, 40, dtype=torch.int16)), "kv_cache", "uint8"),
    ("kv-shape", dict(kv_cache=torch.zeros(6, 4, 40, dtype=torch.bfloat16)), "kv_cache", "d_qk=40"),
    ("kv-fp8-shape", dict(kv_cache=torch.zeros(6, 4, 57, dtype=torch.uint8)), "kv_cache", "fp8_bytes_per_token=56"),
    ("kv-not-tensor", dict(kv_cache=None), "kv_cache", "NoneType"),
    ("kv-page-size-0", dict(kv_cache=torch.zeros(6, 0, 1, 40)), "kv_cache", "page_size"),
    ("bt-dtype", dict(block_table=torch.tensor([[3, 1], [5, 0]], dtype=torch.int64)), "block_table", "int32"),
    ("bt-rows", dict(block_table=torch.tensor([[3, 1]], dtype=I32)), "block_table", "B=2"),
    ("bt-page-out-of-cache", dict(block_table=torch.tensor([[3, 6], [5, 0]], dtype=I32)), r"block_table\[0, 1\]",
     "num_blocks=6"),
    ("bt-negative-page", dict(block_table=torch.tensor([[3, 1], [-1, 0]], dtype=I32)), r"block_table\[1, 0\]",
     "outside"),
    ("bt-too-few-columns", dict(block_table=torch.tensor([[3], [5]], dtype=I32)), "block_table", "2 pages"),
    ("seqlens-dtype", dict(cache_seqlens=torch.tensor([7, 2])), "cache_seqlens", "int32"),
    ("seqlens-shape", dict(cache_seqlens=torch.tensor([7, 2, 1], dtype=I32)), "cache_seqlens", "B=2"),
    ("seqlens-negative", dict(cache_seqlens=torch.tensor([7, -1], dtype=I32)), "cache_seqlens", ">= 0"),
    ("qlens-dtype", dict(q_lens=torch.tensor([2, 1])), "q_lens", "int32"),
    ("qlens-shape", dict(q_lens=torch.tensor([2], dtype=I32)), "q_lens", "B=2"),
    ("qlens-above-s_q", dict(q_lens=torch.tensor([3, 1], dtype=I32)), r"q_lens\[0\]", "s_q=2"),
    ("qlens-negative", dict(q_lens=torch.tensor([2, -1], dtype=I32)), r"q_lens\[1\]", r"\[0, s_q=2\]"),
    ("qlens-above-seqlen", dict(cache_seqlens=torch.tensor([1, 2], dtype=I32)), r"q_lens\[0\] = 2",
     r"cache_seqlens\[0\] = 1"),
    ("topk-length-without-indices", dict(topk_length=torch.tensor([1, 1], dtype=I32)), "topk_length", "indices"),
    ("indices-dtype", dict(indices=torch.zeros(2, 2, 3, dtype=torch.int64)), "indices", "int32"),
    ("indices-shape", dict(indices=torch.zeros(2, 1, 3, dtype=I32)), "indices", "s_q=2"),
    ("indices-out-of-cache", dict(indices=torch.tensor([[[0, 24]], [[0, 0]]], dtype=I32).expand(2, 2, 2)),
     r"indices\[0, 0, 1\] = 24", "num_blocks\\*page_size=24"),
    ("indices-below-minus-one", dict(indices=torch.full((2, 2, 2), -2, dtype=I32)), r"indices\[0, 0, 0\]", "-1"),
    ("topk-length-dtype", dict(indices=torch.zeros(2, 2, 3, dtype=I32), topk_length=torch.tensor([1, 1])),
     "topk_length", "int32"),
    ("topk-length-range", dict(indices=torch.zeros(2, 2, 3, dtype=I32), topk_length=torch.tensor([1, 4], dtype=I32)),
     r"topk_length\[1\]", "topk=3"),
]


@pytest.mark.parametrize("over, arg, expect", [c[1:] for c in DECODE_CASES], ids=[c[0] for c in DECODE_CASES])
def test_mla_decode_rejects(over, arg, expect):
    with pytest.raises(ValueError) as info:
        call_decode(**over)
    msg = str(info.value)
    assert re.search(arg, msg), msg
    assert re.search(expect, msg), msg


def _write(**over):
    a = dict(kv_cache=make_kv_cache(SPEC, 2, 4, "bf16"), latent=torch.zeros(3, 32), rope=torch.zeros(3, 8),
             slot_mapping=torch.tensor([0, -1, 7]))
    a.update(over)
    write_kv_cache(a["kv_cache"], a["latent"], a["rope"], a["slot_mapping"], spec=SPEC)


WRITE_CASES = [
    ("slots-dtype", dict(slot_mapping=torch.tensor([0, -1, 7], dtype=I32)), "slot_mapping", "int64"),
    ("slots-2d", dict(slot_mapping=torch.tensor([[0, -1, 7]])), "slot_mapping", r"\[T\]"),
    ("slot-out-of-cache", dict(slot_mapping=torch.tensor([0, -1, 8])), "slot_mapping", "8"),
    ("slot-below-minus-one", dict(slot_mapping=torch.tensor([0, -2, 7])), "slot_mapping", "-2"),
    ("slot-repeated", dict(slot_mapping=torch.tensor([7, -1, 7])), "slot_mapping", "repeated"),
    ("latent-int", dict(latent=torch.zeros(3, 32, dtype=torch.int64)), "latent", "floating"),
    ("latent-width", dict(latent=torch.zeros(3, 31)), "latent", "32"),
    ("rope-rows", dict(rope=torch.zeros(2, 8)), "rope", "T=3"),
    ("cache-layout", dict(kv_cache=torch.zeros(2, 4, 40)), "kv_cache", "d_qk=40"),
]


@pytest.mark.parametrize("over, arg, expect", [c[1:] for c in WRITE_CASES], ids=[c[0] for c in WRITE_CASES])
def test_write_kv_cache_rejects(over, arg, expect):
    with pytest.raises(ValueError) as info:
        _write(**over)
    assert re.search(arg, str(info.value)) and re.search(expect, str(info.value)), str(info.value)


@pytest.mark.parametrize("call, arg", [
    (lambda: make_kv_cache(SPEC, 2, 4, "int8"), "kv_dtype"),
    (lambda: make_kv_cache(SPEC, 0, 4, "bf16"), "num_blocks"),
    (lambda: make_kv_cache(SPEC, 2, -4, "fp8"), "page_size"),
    (lambda: gather_kv(make_kv_cache(SPEC, 2, 4), torch.tensor([0, 1], dtype=I32), -1, spec=SPEC), "seq_len"),
    (lambda: gather_kv(make_kv_cache(SPEC, 2, 4), torch.tensor([[0, 1]], dtype=I32), 3, spec=SPEC),
     "block_table_row"),
    (lambda: gather_kv(make_kv_cache(SPEC, 2, 4), torch.tensor([0, 1], dtype=I32), 9, spec=SPEC), "block_table_row"),
    (lambda: gather_kv(make_kv_cache(SPEC, 2, 4), torch.tensor([0, 2], dtype=I32), 5, spec=SPEC), "block_table_row"),
    (lambda: quantize_kv_fp8(torch.zeros(32), torch.zeros(8, device="meta"), spec=SPEC), "rope"),
    (lambda: apply_rope(torch.zeros(3, 7), torch.zeros(3, dtype=torch.int64)), "x"),
    (lambda: apply_rope(torch.zeros(3, 8), torch.zeros(3, dtype=torch.int32)), "positions"),
    (lambda: apply_rope(torch.zeros(3, 8), torch.zeros(4, dtype=torch.int64)), "positions"),
])
def test_helpers_reject(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


def _layer_kwargs(**over):
    kw = dict(hidden=torch.zeros(1, 2, SPEC.hidden), positions=torch.tensor([[3, 4]]),
              kv_cache=make_kv_cache(SPEC, 2, 4, "fp32"), block_table=torch.tensor([[1, 0]], dtype=I32),
              cache_seqlens=torch.tensor([5], dtype=I32), slot_mapping=torch.tensor([[7, 0]]))
    kw.update(over)
    return kw


LAYER_CASES = [
    ("hidden-width", dict(hidden=torch.zeros(1, 2, SPEC.hidden + 1)), "hidden"),
    ("hidden-int", dict(hidden=torch.zeros(1, 2, SPEC.hidden, dtype=torch.int64)), "hidden"),
    ("positions-dtype", dict(positions=torch.tensor([[3, 4]], dtype=I32)), "positions"),
    ("positions-shape", dict(positions=torch.tensor([3, 4])), "positions"),
    ("slots-shape", dict(slot_mapping=torch.tensor([[7, 0, -1]])), "slot_mapping"),
    ("seqlens-short", dict(cache_seqlens=torch.tensor([9], dtype=I32)), "cache_seqlens"),
]


@pytest.mark.parametrize("fn", [mla_layer_decode_absorbed, mla_layer_decode_naive], ids=["absorbed", "naive"])
@pytest.mark.parametrize("over, arg", [c[1:] for c in LAYER_CASES], ids=[c[0] for c in LAYER_CASES])
def test_layer_rejects(fn, over, arg):
    w = MLALayerWeights.random(SPEC, 0, dtype=torch.float32)
    kw = _layer_kwargs(**over)
    cache = kw["kv_cache"]
    with pytest.raises(ValueError, match=arg):
        fn(w, kw.pop("hidden"), kw.pop("positions"), kw.pop("kv_cache"), kw.pop("block_table"),
           kw.pop("cache_seqlens"), kw.pop("slot_mapping"), spec=SPEC)
    # validation happens before the cache write: a rejected step leaves the cache untouched
    assert not bool(cache.any())

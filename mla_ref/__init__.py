"""mla_ref: the math of MLA decode in plain PyTorch — the oracle everything is judged against.

Imports nothing else of this project (docs/design.md, layering).
"""
from .spec import ModelSpec
from .capabilities import Capabilities, Unsupported, capabilities_of
from .contract import DecodeBatch, DecodeBackend, KV_DTYPES
from .fp8 import (FP8_AMAX_FLOOR, FP8_E4M3_MAX, dequantize_kv_fp8, ieee_div, quantize_kv_fp8, split_fp8_tokens)
from .fp8_tensor import check_k_scale, dequantize_kv_fp8_e4m3, quantize_kv_fp8_e4m3
from .cache import (CACHE_FLOAT_DTYPES, check_kv_cache, check_scale_for, gather_kv, is_fp8_cache, is_fp8_e4m3_cache,
                    make_kv_cache, read_slots, write_kv_cache)
from .decode import DecodePlan, attend, check_decode_args, mla_decode
from .masked import mla_decode_masked
from .indexer import IndexerWeights, indexer_topk
from .layer import (MLALayerWeights, absorb_q, apply_rope, compress_kv, mla_layer_decode_absorbed,
                    mla_layer_decode_naive, o_project, project_q, quantize_fp8_per_tensor, rms_norm,
                    unabsorb_out)

__all__ = [
    "ModelSpec", "DecodeBatch", "DecodeBackend", "KV_DTYPES", "Capabilities", "Unsupported", "capabilities_of",
    "FP8_AMAX_FLOOR", "FP8_E4M3_MAX", "quantize_kv_fp8", "dequantize_kv_fp8", "split_fp8_tokens", "ieee_div",
    "quantize_kv_fp8_e4m3", "dequantize_kv_fp8_e4m3", "check_k_scale",
    "CACHE_FLOAT_DTYPES", "check_kv_cache", "make_kv_cache", "write_kv_cache", "gather_kv", "read_slots",
    "is_fp8_cache", "is_fp8_e4m3_cache", "check_scale_for",
    "DecodePlan", "check_decode_args", "attend", "mla_decode", "mla_decode_masked", "IndexerWeights", "indexer_topk",
    "MLALayerWeights", "rms_norm", "apply_rope", "project_q", "compress_kv", "absorb_q", "unabsorb_out",
    "quantize_fp8_per_tensor", "o_project", "mla_layer_decode_absorbed", "mla_layer_decode_naive",
]

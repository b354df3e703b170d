"""mla_ref: the math of MLA decode in plain PyTorch — the oracle everything is judged against.

Imports nothing else of this project (DESIGN.md layering).
"""
from .spec import ModelSpec
from .contract import DecodeBatch, DecodeBackend, KV_DTYPES

__all__ = ["ModelSpec", "DecodeBatch", "DecodeBackend", "KV_DTYPES"]

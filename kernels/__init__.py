"""kernels: the Triton MLA decode implementation and its graph-ready backend.

- ``mla_decode``: the op (same contract as ``mla_ref.mla_decode``), with FlashMLA-style
  lazily planned ``SchedState``;
- ``TritonMLABackend`` / ``TritonMLAMetadata``: the metadata builder with persistent graph
  buffers, and ``forward`` / ``write_kv``;
- ``MLADecodeLayer``: a full layer decode step over a backend;
- ``ops``: the kernels as ``torch.library`` custom ops (namespace ``mla_fuzz``).

Imports ``mla_ref`` (the contract) and never ``harness`` (docs/design.md, layering).
"""
from . import ops
from .backend import TritonMLABackend, TritonMLAMetadata, host_context_lens
from .config import DecodeConfig, default_config, interpreting
from .decode import context_lens, mla_decode
from .layer import MLADecodeLayer, decode_positions
from .planner import plan_reference
from .sched import SchedState

__all__ = ["ops", "mla_decode", "context_lens", "SchedState", "DecodeConfig", "default_config", "interpreting",
           "TritonMLABackend", "TritonMLAMetadata", "host_context_lens", "MLADecodeLayer", "decode_positions",
           "plan_reference"]

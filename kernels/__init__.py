"""kernels: the Triton MLA decode implementation and its graph-ready backend.

- ``mla_decode``: the op (same contract as ``mla_ref.mla_decode``), with FlashMLA-style
  lazily planned ``SchedState``;
- ``TritonMLABackend`` / ``TritonMLAMetadata``: the metadata builder with persistent graph
  buffers, and ``forward`` / ``write_kv``;
- ``ops``: the kernels as ``torch.library`` custom ops (namespace ``mla_fuzz``);
- ``DecodeConfig`` / ``default_config`` / ``routes``: launch configs and the route table that
  decides which kernel runs a launch and why (the portable Triton kernels here, the Hopper
  Gluon ones in ``kernels/hopper/``);
- ``interpreter_patches``: speed-ups of Triton's CPU interpreter, installed explicitly by
  whoever runs the kernels interpreted (never as a side effect of this package).

Imports ``mla_ref`` (the contract) and never ``harness`` (docs/design.md, layering); the
layer step over a backend (``MLADecodeLayer``) is ``mla_fuzz.harness.layer``'s.
"""
from . import ops, routes
from .backend import TritonMLABackend, TritonMLAMetadata, host_context_lens
from .config import DecodeConfig, interpreting
from .decode import context_lens, mla_decode
from .planner import plan_reference
from .routes import ROUTES, default_config
from .sched import SchedState

__all__ = ["ops", "routes", "mla_decode", "context_lens", "SchedState", "DecodeConfig", "default_config", "ROUTES",
           "interpreting", "TritonMLABackend", "TritonMLAMetadata", "host_context_lens", "plan_reference"]

"""Example decode backends written the way serving engines write them, each fuzzed in CI.

- ``reference_backend``: a graph-safe backend in about 60 lines (persistent buffers,
  ``copy_`` in ``build``, the ``mla_ref`` decode inside a custom op);
- ``triton_decode``: a raw Triton decode kernel in the engines' shape, wrapped for emulation;
- ``sglang_style``: separate capture and replay metadata paths (``build_for_capture``).

Installed as ``mla_fuzz.examples``: ``mla-fuzz run --backend mla_fuzz.examples.triton_decode:TritonDecodeBackend``.
"""

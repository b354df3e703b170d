"""The Hopper (sm_90) decodes, written in Gluon: GPU only, no interpreter.

- ``decode_wgmma``: 64-row blocks of a 16-bit cache, both dots split over two warpgroups;
- ``decode_wgmma_pp``: the same blocks, the two warpgroups on alternate tiles (ping-pong);
- ``decode_wgmma_ws64``: FP8 64-row blocks, a producer partition dequantising the next tile;
- ``decode_wgmma_rs``: FP8 16-row blocks, TMA copies, codes converted in wgmma's register operands;
- ``decode_wgmma_ws``: FP8 16-row blocks (one a request), a producer partition converting tiles;
- ``decode_wgmma_kt``: 16-bit 16/32-row blocks, TMA copies, keys on the wgmma M axis;
- ``gluon_parts``: the pieces they share; ``pdl``: programmatic dependent launch, which the
  portable Triton kernels use too.

Each has the contract of the Triton split-KV decode (``kernels/decode_split.py``). Which one a
launch takes, and what it needs, is the route table's (``kernels/routes.py``). Importing this
package imports no Gluon; its modules import it where Triton has it (else their ``gluon`` is None
and the route table never picks them).
"""

"""Mutants: the Triton backend with one 2026 decode bug put back, each a one-method subclass.

They are the proof that the harness works: the suite asserts the fuzzer catches every
mutant (from its own search, with the right diagnosis) and passes the clean backend.

``ALL`` maps name -> backend class; ``EXPECTED`` maps name -> diagnosis classes that
are a correct explanation of that bug.
"""
from .graph_state import (HostSplitDecision, ItemInCapture, LazyPlannerOnBackend, SharedLazySched, StaleFP8Metadata,
                          StaleKScale, TorchOpMetadata)
from .layout import NoncontigContextLens, PaddedSlotWrite
from .padding import NanZeroLen, PadWithLastRequest, UninitPaddingAmax
from .indexer import IndexerTwoDContextLens
from .ragged import RaggedFreshAlloc, RaggedItemSync, RaggedStaleTail, StaleWorkspaceTail
from .examples import (BackendHeldLens, ExampleItemInForward, ExamplePaddedPageMinusOne, ExampleSeqLensFresh,
                       ExampleUnguardedStage2, ExampleWorkspaceRealloc)
from .sglang_style import CaptureOwnIndices
from .layers import IndexerOncePerStep, PoolRebasedBlockTable, SharedOutputBuffer
from .build_state import ContextLensInPlace, TileCounterPerBuild

ALL = {
    "stale-fp8-metadata": StaleFP8Metadata,
    "stale-k-scale": StaleKScale,
    "shared-lazy-sched": SharedLazySched,
    "noncontig-context-lens": NoncontigContextLens,
    "uninit-padding-amax": UninitPaddingAmax,
    "padded-slot-write": PaddedSlotWrite,
    "host-split-decision": HostSplitDecision,
    "item-in-capture": ItemInCapture,
    "nan-zero-len": NanZeroLen,
    "ragged-fresh-alloc": RaggedFreshAlloc,
    "ragged-item-sync": RaggedItemSync,
    "ragged-stale-tail": RaggedStaleTail,
    "indexer-2d-context-lens": IndexerTwoDContextLens,
    # the second set: written held out (issue #44's diagnosis work), measured once untouched
    # (benchmarks/results/cpu-2026-11-28-fresh-mutants.json), then added here
    "torch-op-metadata": TorchOpMetadata,
    "lazy-planner-on-backend": LazyPlannerOnBackend,
    "stale-ctx-tail": StaleWorkspaceTail,
    "pad-with-last-request": PadWithLastRequest,
    "example-backend-held-lens": BackendHeldLens,
    # the plug-in example (examples/triton_decode.py) with the same bug classes put back
    "example-seq-lens-fresh": ExampleSeqLensFresh,
    "example-workspace-realloc": ExampleWorkspaceRealloc,
    "example-item-in-forward": ExampleItemInForward,
    "example-padded-page-minus-one": ExamplePaddedPageMinusOne,
    # the SGLang-shaped example (examples/sglang_style.py): capture and replay paths diverged
    "example-capture-own-indices": CaptureOwnIndices,
    # issue #44 item 6: multi-layer steps (state shared across the layers of one build)
    "pool-rebased-block-table": PoolRebasedBlockTable,
    "shared-output-buffer": SharedOutputBuffer,
    "indexer-once-per-step": IndexerOncePerStep,
    # the diagnosis of a forward that changes its own build (experiment R): written before it,
    # measured untouched (caught in 1 example at seeds 0 and 1, named stale-address both times)
    "context-lens-in-place": ContextLensInPlace,
    "tile-counter-per-build": TileCounterPerBuild,
    # held out from 2026-11-28 to 2026-11-29 (caught at every measurement, named laziness at some
    # seeds): moved here with the diagnosis changes it proves (1b inside experiment 3, S, E)
    "example-unguarded-stage2": ExampleUnguardedStage2,
}

EXPECTED = {
    "stale-fp8-metadata": {"stale-address"},
    "stale-k-scale": {"stale-address"},
    "shared-lazy-sched": {"laziness"},
    "noncontig-context-lens": {"contiguity"},
    "uninit-padding-amax": {"padding-leak"},
    "padded-slot-write": {"cache-corruption"},
    "host-split-decision": {"laziness"},
    "item-in-capture": {"host-sync"},
    "nan-zero-len": {"padding-leak"},
    "ragged-fresh-alloc": {"stale-address"},
    "ragged-item-sync": {"host-sync"},
    # the kernel reads data an earlier step left in a persistent buffer the build did not
    # refresh: the stale-address family (diagnosis experiment "fresh backend")
    "ragged-stale-tail": {"stale-address"},
    "indexer-2d-context-lens": {"contiguity"},
    "torch-op-metadata": {"stale-address"},
    "lazy-planner-on-backend": {"laziness"},
    "stale-ctx-tail": {"stale-address"},
    "pad-with-last-request": {"padding-leak"},
    "example-backend-held-lens": {"stale-address"},
    "example-seq-lens-fresh": {"stale-address"},
    "example-workspace-realloc": {"stale-address"},
    "example-item-in-forward": {"host-sync"},
    "example-capture-own-indices": {"capture-divergence"},
    "example-padded-page-minus-one": {"out-of-bounds"},
    # issue #44 item 6: multi-layer steps
    "pool-rebased-block-table": {"layer-state"},
    "shared-output-buffer": {"layer-state"},
    "indexer-once-per-step": {"layer-state"},
    # a forward rewrites metadata in place that a second forward on the same build reads
    "context-lens-in-place": {"layer-state"},
    "tile-counter-per-build": {"layer-state"},
    # stage 2 merges splits stage 1 left unwritten: stale contents at a stable address
    "example-unguarded-stage2": {"stale-address"},
}

#: Mutants whose only symptom is an access outside the kernel's tensors: the bounds check of
#: Triton's CPU interpreter (``harness.memory_guard``) sees it; a GPU run reads memory no
#: oracle looks at, so ``mla-fuzz mutants --graph cuda`` lists them as not applicable.
INTERPRETER_ONLY = frozenset({"example-padded-page-minus-one"})

#: Mutants without a row in the README's GPU table (GPU runs, row for row), named in its text;
#: none now. ``mla-fuzz mutants --graph cuda`` runs them like any other.
NOT_YET_ON_GPU: frozenset = frozenset()

__all__ = ["ALL", "EXPECTED", "INTERPRETER_ONLY", "NOT_YET_ON_GPU"] + [c.__name__ for c in ALL.values()]

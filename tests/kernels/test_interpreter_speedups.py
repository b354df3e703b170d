"""``kernels.interpreter_patches``: the speed-ups of Triton's interpreter change no result, are
installed only explicitly, and refuse a Triton they are not written for.

``_cache_interpreter_types`` replaces some of the interpreter's per-op bookkeeping with
cached equivalents; every forward of a set of scenarios (dense bf16/fp16/fp8, sparse with
and without the on-device indexer, whole layer steps, FP8 output; graphs captured, replayed
with poisoned padding) must give the same bytes with it as with Triton's interpreter as
shipped. Each side runs in its own process: the patches last for a process's lifetime.
"""
import os
import subprocess
import sys

import pytest
import torch

from mla_fuzz.kernels.config import interpreting
from mla_fuzz.kernels.interpreter_patches import PLAIN_INTERPRETER_ENV

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: interp_outputs.py
ROOT = os.path.dirname(HERE)

pytestmark = pytest.mark.skipif(not interpreting(), reason="checks Triton's interpreter (TRITON_INTERPRET=1)")


def _outputs(tmp_path, name: str, plain: bool) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop(PLAIN_INTERPRETER_ENV, None)
    if plain:
        env[PLAIN_INTERPRETER_ENV] = "1"
    path = tmp_path / f"{name}.pt"
    subprocess.run([sys.executable, os.path.join(HERE, "interp_outputs.py"), str(path)], cwd=ROOT, env=env,
                   check=True, timeout=600)
    return torch.load(path)


def test_cached_interpreter_types_are_bit_identical(tmp_path):
    fast = _outputs(tmp_path, "fast", plain=False)
    plain = _outputs(tmp_path, "plain", plain=True)
    assert fast["patched"] and not plain["patched"], "the switch did not select the two interpreters"
    assert len(fast["outs"]) == len(plain["outs"]) > 20
    for i, (a, b) in enumerate(zip(fast["outs"], plain["outs"])):
        assert torch.equal(a, b), f"forward output {i} differs with the cached interpreter types"


def test_speedups_are_installed_explicitly_and_only_so(tmp_path):
    """``install()`` (here: the conftest's) patches the interpreter; a process that imports the
    kernels and launches one on CPU without calling it runs Triton's interpreter as shipped --
    the argument checks install nothing."""
    import triton.language.core as core
    from triton.runtime import interpreter

    from mla_fuzz.kernels import interpreter_patches

    if os.environ.get(PLAIN_INTERPRETER_ENV, "0") not in ("", "0"):
        pytest.skip(f"{PLAIN_INTERPRETER_ENV} is set")
    assert interpreter_patches.installed()
    assert getattr(core.tensor.__init__, "_mla_fuzz", False)
    assert getattr(core.block_type.__init__, "_mla_fuzz", False)
    assert getattr(interpreter._get_np_dtype, "_mla_fuzz", False)
    assert getattr(interpreter._patch_lang, "_mla_fuzz", False)
    assert getattr(interpreter._convert_float, "_mla_fuzz", False)
    assert getattr(interpreter._patch_builtin, "_mla_fuzz", False)
    assert getattr(interpreter.GridExecutor.__call__, "_mla_fuzz", False)
    code = ("import torch, triton.language.core as core\n"
            "from triton.runtime import interpreter\n"
            "from mla_fuzz import kernels\n"
            "from mla_fuzz.mla_ref import ModelSpec\n"
            "spec = ModelSpec.tiny(num_heads=2)\n"
            "from mla_fuzz.mla_ref import make_kv_cache\n"
            "cache = make_kv_cache(spec, 2, 4, 'bf16')\n"
            "q = torch.zeros(1, 1, 2, spec.d_qk, dtype=torch.bfloat16)\n"
            "kernels.mla_decode(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),"
            " spec=spec)\n"
            "from mla_fuzz.kernels import interpreter_patches\n"
            "assert not interpreter_patches.installed()\n"
            "assert not getattr(core.tensor.__init__, '_mla_fuzz', False)\n"
            "assert not getattr(interpreter.GridExecutor.__call__, '_mla_fuzz', False)\n")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=300)


def test_install_refuses_a_triton_it_is_not_written_for(monkeypatch):
    """On a Triton version outside ``TRITON_VERSIONS`` ``install()`` raises before patching
    anything, naming the version and the way out."""
    from mla_fuzz.kernels import interpreter_patches as ip

    monkeypatch.setattr(ip, "_INSTALLED", False)
    monkeypatch.delenv(ip.PLAIN_INTERPRETER_ENV, raising=False)
    monkeypatch.setattr(ip, "triton_version", lambda: (4, 0))
    with pytest.raises(RuntimeError, match=r"Triton .* is installed, but .* written for Triton 3\.") as err:
        ip.install()
    assert "do not call install()" in str(err.value) and not ip.installed()


def test_float_conversion_tables_match_triton():
    """Every conversion from a <= 16-bit float is looked up in a table of Triton's own
    results; checked code by code against Triton's function, in odd shapes, plus the
    cached conversions of single wider values (-0.0, nan and a subnormal included)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from mla_fuzz.kernels import interpreter_patches

    interpreter_patches.install()
    fast = interpreter._convert_float
    if not getattr(fast, "_mla_fuzz", False):
        pytest.skip("speed-ups not installed")
    orig = fast._mla_orig
    rne = interpreter._ir.ROUNDING_MODE.RTNE
    for src, dst, mode in ((tl.bfloat16, tl.float32, None), (tl.float8e4nv, tl.float32, rne),
                           (tl.float8e5, tl.float16, rne), (tl.float16, tl.float32, None),
                           (tl.float16, tl.float8e4nv, rne)):
        bits = src.primitive_bitwidth
        codes = np.arange(1 << bits, dtype=getattr(np, f"uint{bits}"))
        for x in (codes, codes[::-7].reshape(-1, 1), codes[:0]):
            a, b = fast(x, src, dst, mode), orig(x, src, dst, mode)
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
                (src, dst)
    for v in (0.0, -0.0, float("nan"), 1e-40, -3.5, 65504.0, 1e30):
        x = np.array([v], dtype=np.float32)
        for _ in range(2):  # a miss, then a hit
            a, b = fast(x, tl.float32, tl.bfloat16, None), orig(x, tl.float32, tl.bfloat16, None)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), v


def test_cached_block_type_matches_triton():
    """Field by field: what the cached ``block_type`` / ``tensor`` constructors build equals
    what Triton's own code builds, and bad shapes still get Triton's errors."""
    import triton.language as tl
    import triton.language.core as core

    from mla_fuzz.kernels import interpreter_patches

    interpreter_patches.install()
    if not getattr(core.block_type.__init__, "_mla_fuzz", False):
        pytest.skip("speed-ups not installed")
    fast = core.block_type(tl.float32, [16, 32])
    ref = core.block_type.__new__(core.block_type)
    # Triton's __init__, reached through the fallback path: a tl.tuple holding a constexpr dim
    core.block_type.__init__(ref, tl.float32, core.tuple([core.constexpr(16), 32]))
    assert fast == ref and fast.name == ref.name and fast.numel == ref.numel
    assert list(fast.shape) == list(ref.shape) and fast.shape.type.name == ref.shape.type.name
    t_fast = core.tensor(None, fast)
    t_ref = core.tensor(None, ref)
    assert [d.value for d in t_fast.shape] == [d.value for d in t_ref.shape] == [16, 32]
    assert t_fast.numel.value == t_ref.numel.value == 512 and t_fast.dtype == t_ref.dtype == tl.float32
    assert t_fast.shape is not t_ref.shape and t_fast.shape.values is not fast.shape.values
    with pytest.raises(ValueError, match="power of 2"):
        core.block_type(tl.float32, [3])
    with pytest.raises(TypeError):
        core.block_type(tl.float32, [])
    with pytest.raises(TypeError):
        core.block_type(tl.float32, [16.0])

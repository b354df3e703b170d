"""The address oracle sees every tensor a captured graph reads: metadata read through a plain
torch op, and tensors a build replaced on the backend object. The message names the field and,
for state on the backend, the build() that replaced it, and says what to do. (Fixed scenarios:
these test the messages; the search finding the bugs is the mutation matrix's job.)"""
from mla_fuzz.harness.executor import run_steps
from mla_fuzz.harness.mutants import ALL
from mla_fuzz.harness.scenario import ScenarioConfig
from mla_fuzz.mla_ref import ModelSpec


def _steps():
    draw = lambda seed, lens: {"seed": seed, "seq_lens": lens, "q_lens": [1] * len(lens), "max_decode_len": 1}  # noqa: E731
    return [{"op": "capture", "size": 2, "batch": draw(0, [5, 9])},
            {"op": "replay", "size": 2, "batch": draw(1, [40, 3]), "poison": False}]


def _cfg():
    return ScenarioConfig(spec=ModelSpec.tiny(num_heads=4).to_dict(), kv_dtype="fp16", q_dtype="fp16", page_size=16,
                          capture_sizes=[2], max_pages_per_seq=4)


def test_a_tensor_build_replaces_on_the_backend_is_named_with_the_build_line():
    f = run_steps(ALL["example-backend-held-lens"], _cfg(), _steps(), "emulated", "cpu")
    assert f is not None and f.oracle == "address" and f.step == 1
    assert "attribute 'self._seq_lens_now'" in f.message and "harness/mutants/examples.py:" in f.message
    assert "copy_" in f.message


def test_metadata_read_only_through_a_torch_op_is_still_audited():
    f = run_steps(ALL["torch-op-metadata"], _cfg(), _steps(), "emulated", "cpu")
    assert f is not None and f.oracle == "address" and "metadata field 'seq_lens'" in f.message


def test_the_clean_backends_pass_the_same_steps():
    from mla_fuzz.examples.triton_decode import TritonDecodeBackend
    from mla_fuzz.kernels import TritonMLABackend
    for cls in (TritonDecodeBackend, TritonMLABackend):
        assert run_steps(cls, _cfg(), _steps(), "emulated", "cpu") is None, cls.__name__

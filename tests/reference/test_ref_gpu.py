"""The reference also runs on CUDA tensors (the harness compares GPU backends against it in
place) and agrees with its CPU self."""
import pytest
import torch

from mla_fuzz.mla_ref import (MLALayerWeights, ModelSpec, mla_decode, mla_layer_decode_absorbed, mla_layer_decode_naive,
                     quantize_fp8_per_tensor, quantize_kv_fp8)
from ref_cases import build_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_decode_on_cuda_matches_cpu(cuda_device, kv_dtype):
    spec = ModelSpec.deepseek_v3()
    case = build_case(spec, seq_lens=[1000, 0, 257], q_lens=[2, 0, 1], s_q=2, page_size=64, kv_dtype=kv_dtype,
                      q_dtype=torch.bfloat16, poison=True, extra_cols=1)
    cpu = mla_decode(*case.args(), spec=spec, q_lens=case.q_lens)
    gpu = mla_decode(*(t.to(cuda_device) for t in case.args()), spec=spec, q_lens=case.q_lens.to(cuda_device))
    assert gpu[0].device.type == "cuda"
    # different GEMM kernels: agreement to a bf16 rounding of out, fp32 noise on lse
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], rtol=1e-5, atol=1e-4)


def test_fp8_quantisation_is_bitwise_the_same_on_cuda(cuda_device):
    """Failed before mla_ref.fp8.ieee_div: CUDA's `amax / 448.0` put some scales one ulp off."""
    spec = ModelSpec.deepseek_v3()
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(64, 512, generator=gen) * torch.rand(64, 1, generator=gen) * 10
    rope = torch.randn(64, 64, generator=gen)
    latent[3] = 0.0  # the amax floor path
    cpu = quantize_kv_fp8(latent, rope, spec=spec)
    gpu = quantize_kv_fp8(latent.to(cuda_device), rope.to(cuda_device), spec=spec)
    assert torch.equal(gpu.cpu(), cpu)


def test_layer_on_cuda_naive_equals_absorbed(cuda_device):
    spec = ModelSpec.deepseek_v3()
    w = MLALayerWeights.random(spec, seed=0, dtype=torch.bfloat16, device=cuda_device)
    case = build_case(spec, seq_lens=[300, 5], q_lens=[2, 1], s_q=2, page_size=64, kv_dtype="bf16",
                      q_dtype=torch.bfloat16)
    slots = torch.tensor([[case.slot(0, 298), case.slot(0, 299)], [case.slot(1, 4), -1]], device=cuda_device)
    positions = torch.tensor([[298, 299], [4, 0]], device=cuda_device)
    hidden = torch.randn(2, 2, spec.hidden, generator=torch.Generator().manual_seed(1)).to(cuda_device, torch.bfloat16)
    args = (case.block_table.to(cuda_device), case.cache_seqlens.to(cuda_device))
    outs = [fn(w, hidden, positions, case.kv_cache.to(cuda_device), *args, slots, spec=spec,
               q_lens=case.q_lens.to(cuda_device))
            for fn in (mla_layer_decode_absorbed, mla_layer_decode_naive)]
    err = (outs[0].double() - outs[1].double()).abs().amax(-1)
    mag = outs[1].double().abs().amax(-1).clamp_min(1.0)
    assert bool((err <= 2e-2 * mag).all()), float((err / mag).max())
    assert torch.equal(outs[0][1, 1], torch.zeros_like(outs[0][1, 1]))


def test_per_tensor_fp8_is_bitwise_the_same_on_cuda(cuda_device):
    """torch on CUDA divides by a Python scalar via its reciprocal; the reference must not."""
    x = torch.randn(8, 3, 1000, generator=torch.Generator().manual_seed(2)) * 3.7
    cpu_q, cpu_s = quantize_fp8_per_tensor(x)
    gpu_q, gpu_s = quantize_fp8_per_tensor(x.to(cuda_device))
    assert torch.equal(gpu_s.cpu(), cpu_s)
    assert torch.equal(gpu_q.cpu().view(torch.uint8), cpu_q.view(torch.uint8))

"""Each low-precision mode, and the FP8 block KV cache, against torchao's own reference quantize/dequantize
primitives: the engine's linear layer must give F.linear(Q_act(x), Q_w(W)) with Q the reference fake-quantization (quantize then dequantize), to float32
round-off, and must differ from the high-precision layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
from torchao.quantization.quant_primitives import (
    MappingType,
    _choose_scale_float8,
    _dequantize_affine_float8,
    _quantize_affine_float8,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)
from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER

import dllm_ais.quantization as quantization
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.likelihood.trajectory import decoder_trajectory_pieces, sum_pieces
from dllm_ais.loading import load_model, load_tokenizer
from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.policy import build_policy
from dllm_ais.quantization import AMAX_FLOOR, kernel_path, quantize_model_
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler
from dllm_ais.sampling.fp8_cache import dequantize_per_head, quantize_per_head


def fp8_reference(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """e4m3 round trip with scale max|·| / 448 per row (per_row) or over the whole 2-D tensor."""
    block = [1, x.shape[-1]] if per_row else list(x.shape)
    scale = _choose_scale_float8(x, block, torch.float8_e4m3fn, hp_value_lb=AMAX_FLOOR)
    return _dequantize_affine_float8(_quantize_affine_float8(x, scale, torch.float8_e4m3fn), scale)


def mx_reference(x: torch.Tensor, element_dtype: torch.dtype) -> torch.Tensor:
    """MX round trip: blocks of 32 with an E8M0 scale (RCEIL)."""
    scale, data = to_mx(x, element_dtype, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    return to_dtype(data, scale, element_dtype, 32, torch.float32)


def nvfp4_reference(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 round trip of a 2-D tensor (a weight, or a layer's whole input): e2m1 in blocks of 16, e4m3 block
    scales under the per-tensor scale max|W| / (448·6)."""
    tensor_scale = per_tensor_amax_to_scale(w.abs().max())
    block_scales, data = nvfp4_quantize(w, 16, tensor_scale)
    values = f4_unpacked_to_f32(unpack_uint4(data.view(torch.uint8))).view(w.shape[0], -1, 16)
    return (values * (block_scales.float() * tensor_scale).view(w.shape[0], -1, 1)).view(w.shape)


def int4_reference(w: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric int4 round trip, one scale per group of `group` input features."""
    block = (1, group)
    scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, block, torch.int8, quant_min=-8, quant_max=7,
                                       zero_point_dtype=torch.int8, keepdim=True)
    q = quantize_affine(w, block, scale, zero, torch.int8, quant_min=-8, quant_max=7)
    return dequantize_affine(q, block, scale, zero, torch.int8, quant_min=-8, quant_max=7)


# mode -> (fake-quantization of the activations [N, K], of the weight [out, K])
REFERENCES = {
    "fp8": (lambda x: fp8_reference(x, True), lambda w: fp8_reference(w, True)),
    "fp8_tensor": (lambda x: fp8_reference(x, False), lambda w: fp8_reference(w, False)),
    "fp8_weight_only": (lambda x: x, lambda w: fp8_reference(w, True)),
    "mxfp8": (lambda x: mx_reference(x, torch.float8_e4m3fn), lambda w: mx_reference(w, torch.float8_e4m3fn)),
    "mxfp4": (lambda x: mx_reference(x, torch.float4_e2m1fn_x2), lambda w: mx_reference(w, torch.float4_e2m1fn_x2)),
    "nvfp4": (nvfp4_reference, nvfp4_reference),
    "nvfp4_weight_only": (lambda x: x, nvfp4_reference),
    "int4": (lambda x: x, lambda w: int4_reference(w, 32)),
    "int4_g128": (lambda x: x, lambda w: int4_reference(w, 128)),
}


@pytest.mark.parametrize("precision", REFERENCES)
def test_quantized_linear_matches_torchao_reference_numerics(precision):
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=False)
    weight = linear.weight.detach().clone()
    x = torch.randn(12, 256) * torch.logspace(-2, 1, 12).unsqueeze(-1)  # rows of different magnitudes
    assert quantize_model_(nn.Sequential(linear), precision, skip=lambda name, module: False) == ["0"]
    quantize_activations, quantize_weight = REFERENCES[precision]
    with torch.no_grad():
        output = linear(x)
    expected = F.linear(quantize_activations(x), quantize_weight(weight))
    error = (output - expected).abs().max().item()
    print(f"\n[{precision}] max |engine − torchao reference| = {error:.2e}; path: {kernel_path(precision, 'cpu')}")
    assert error <= 1e-5 * expected.abs().max().item()
    assert not torch.equal(quantize_weight(weight), weight)  # the mode does change the weights ...
    assert (output - F.linear(x, weight)).abs().max() > 100 * error  # ... and the layer's output


@pytest.mark.parametrize("precision", REFERENCES)
def test_square_layers_and_batched_inputs_take_the_same_numerics(precision):
    """A 128 x 128 weight fed [B, L, K] activations, as every attention projection of a d_model-128 model is: a
    per-tensor FP8 weight must not be read as 128 x 128 blockwise-scaled by torchao's matmul."""
    torch.manual_seed(1)
    linear = nn.Linear(128, 128, bias=False)
    weight = linear.weight.detach().clone()
    x = torch.randn(2, 5, 128)
    assert quantize_model_(nn.Sequential(linear), precision, skip=lambda name, module: False) == ["0"]
    quantize_activations, quantize_weight = REFERENCES[precision]
    with torch.no_grad():
        output = linear(x)
    expected = F.linear(quantize_activations(x.reshape(-1, 128)), quantize_weight(weight)).reshape(2, 5, 128)
    assert (output - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("precision", ["mxfp8", "mxfp4"])
def test_native_mx_config_stores_the_emulated_weights_values(precision):
    """The weight torchao's MXDynamicActivationMXWeightConfig builds for the native kernels (swizzled scales; it runs
    on sm100 only, but builds anywhere) holds the values of the emulated path's weight, and requantizes as its mode."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    config = quantization._torchao_config(precision)
    holder = nn.Linear(256, 64, bias=False, device="meta")
    holder.weight = nn.Parameter(weight, requires_grad=False)
    native = _QUANTIZE_CONFIG_HANDLER[type(config)](holder, config).weight.detach()
    emulated = quantization.quantized_weight(precision, weight)
    assert native.is_swizzled_scales and not emulated.is_swizzled_scales
    assert torch.equal(native.dequantize(torch.float32), emulated.dequantize(torch.float32))
    assert quantization._precision_of(native) == precision


def test_native_nvfp4_config_stores_the_emulated_weights_values(monkeypatch):
    """torchao's NVFP4DynamicActivationNVFP4WeightConfig (the native W4A4 path; its handler asserts an sm100 GPU, told
    here that it has one) stores the weight values the emulated "nvfp4" keeps as a weight-only tensor, and
    requantizes as "nvfp4"."""
    import torchao.prototype.mx_formats.inference_workflow as workflow

    monkeypatch.setattr(workflow, "is_sm_at_least_100", lambda: True)
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    config = quantization._torchao_config("nvfp4")
    holder = nn.Linear(256, 64, bias=False, device="meta")
    holder.weight = nn.Parameter(weight, requires_grad=False)
    native = _QUANTIZE_CONFIG_HANDLER[type(config)](holder, config).weight.detach()
    emulated = quantization.quantized_weight("nvfp4", weight)
    assert native.act_quant_kwargs is not None and emulated.act_quant_kwargs is None
    assert torch.equal(native.dequantize(torch.float32), emulated.dequantize(torch.float32))
    assert quantization._precision_of(native) == "nvfp4"


def test_emulated_nvfp4_quantizes_the_whole_input_under_one_tensor_scale():
    """The W4A4 round trip takes its per-tensor scale over every row of the input, as torchao's dynamic recipe: a
    row's output depends on the other rows' magnitude (unlike the per-row FP8 modes)."""
    torch.manual_seed(2)
    linear = nn.Linear(64, 32, bias=False)
    quantize_model_(nn.Sequential(linear), "nvfp4", skip=lambda name, module: False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        alone, beside_a_large_row = linear(x[:1]), linear(torch.cat([x[:1], 100 * x[1:]]))[:1]
    assert not torch.allclose(alone, beside_a_large_row)


def test_kernel_path_names_the_emulated_path_on_cpu():
    assert kernel_path("fp8_tensor", "cpu").startswith("emulated")
    assert kernel_path("mxfp4", "cpu").startswith("emulated")
    assert kernel_path("nvfp4", "cpu").startswith("emulated")
    assert kernel_path("int4_g128", "cpu").startswith("weight-only")


def test_fp8_kv_cache_storage_matches_torchao_reference_per_row_and_head():
    torch.manual_seed(0)
    keys = torch.randn(2, 4, 24, 16) * torch.logspace(-3, 1, 4).view(1, 4, 1, 1)  # heads of different magnitudes
    keys[1, 2] = 0  # an all-zero head keeps a finite scale
    q, scale = quantize_per_head(keys)
    reference_scale = _choose_scale_float8(keys, [1, 1, 24, 16], torch.float8_e4m3fn, hp_value_lb=AMAX_FLOOR)
    assert torch.equal(scale, reference_scale.view(2, 4, 1, 1))
    assert torch.equal(q.view(torch.uint8), _quantize_affine_float8(keys, reference_scale).view(torch.uint8))
    restored = dequantize_per_head(q, scale, torch.float32)
    assert torch.equal(restored, _dequantize_affine_float8(q, reference_scale))
    assert torch.isfinite(restored).all() and not torch.equal(restored, keys)
    assert ((restored - keys).abs() <= keys.abs().amax(dim=(-2, -1), keepdim=True) / 8).all()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fp8_kv_cache_changes_the_sampled_log_probs_slightly_and_the_replay_keeps_full_precision(cache):
    """Sampling stores the cache in FP8 (its recorded log-probs move); the trainer's replay of the cached decoder
    keeps it in the model's dtype (the ratio sees the storage like the weights' precision) and backpropagates."""
    torch.manual_seed(0)
    model = LLaDAModelLM(LLaDAConfig(d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128,
                                     vocab_size=128, embedding_size=128, max_sequence_length=64, mask_token_id=127,
                                     eos_token_id=126, pad_token_id=126)).eval()
    prompts = torch.randint(0, 120, (2, 8), generator=torch.Generator().manual_seed(1))
    samplers = {cache_dtype: MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=16, block_length=8, steps=16, temperature=1.0, cache=cache, cache_dtype=cache_dtype))
        for cache_dtype in ("none", "fp8")}
    rollouts = {cache_dtype: sampler.sample(model, prompts, generator=torch.Generator().manual_seed(0))
                for cache_dtype, sampler in samplers.items()}
    full, fp8 = rollouts["none"].step_logprobs, rollouts["fp8"].step_logprobs
    assert not torch.equal(full, fp8) and (full - fp8).abs().max() < 0.5

    rollout = rollouts["fp8"]
    replays = {cache_dtype: sum_pieces(decoder_trajectory_pieces(model, rollout, sampler.decoder_logits, 1.0), False)
               for cache_dtype, sampler in samplers.items()}
    assert torch.equal(replays["fp8"], replays["none"]) and not torch.equal(replays["fp8"], rollout.step_logprobs)
    replays["fp8"].sum().backward()
    assert all(torch.isfinite(param.grad).all() for param in model.parameters() if param.grad is not None)
    with pytest.raises(ValueError, match="cache_dtype='fp8' stores the block KV cache"):
        DiffusionSamplerConfig(gen_length=16, block_length=8, steps=16, cache_dtype="fp8")


def test_config_rollout_cache_dtype_reaches_the_sampler():
    config = load_config(EMBEDDED_RECIPE, ["--output_dir=/tmp/unused", "--rollout.cache=dual",
                                           "--rollout.cache_dtype=fp8"])
    model = load_model(config.model_name_or_path, torch.float32)
    policy = build_policy(config, model.config, load_tokenizer(config.model_name_or_path))
    assert policy.sampler.config.cache_dtype == "fp8" and policy.sampler.config.exact().cache_dtype == "none"



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: the path GPU users' rollouts take"))])
@pytest.mark.parametrize("precision", REFERENCES)
def test_bfloat16_layers_match_torchao_reference_numerics_on_each_device(precision, device):
    """A bfloat16 layer fed bfloat16 activations, as the engine runs on a GPU, gives the reference numerics of its
    bfloat16 operands (scales computed in their dtype) up to the bfloat16 rounding of its output and the
    accumulation order, through the kernels kernel_path names: on CUDA, native FP8 scaled-mm on compute capability
    >= 8.9, native MX / NVFP4 on >= 10.0, the emulated or weight-only kernels otherwise."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=False, device=device, dtype=torch.bfloat16)
    weight = linear.weight.detach().clone()
    x = (torch.randn(12, 256, device=device) * torch.logspace(-2, 1, 12, device=device).unsqueeze(-1)).bfloat16()
    assert quantize_model_(nn.Sequential(linear), precision, skip=lambda name, module: False) == ["0"]
    quantize_activations, quantize_weight = REFERENCES[precision]
    with torch.no_grad():
        output = linear(x).float()
    expected = F.linear(quantize_activations(x).float(), quantize_weight(weight).float())
    error = (output - expected).abs().max().item()
    print(f"\n[{precision}] {device}: max |engine − torchao reference| = {error:.2e} (max |reference| "
          f"{expected.abs().max().item():.2e}); path: {kernel_path(precision, device)}")
    assert error <= 2e-2 * expected.abs().max().item()  # CUDA's FP8 matmul accumulates fast, at lower precision
    assert (output - F.linear(x.float(), weight.float())).abs().max() > error

"""Low-precision copies of a model's linear layers through torchao — the only module that imports torchao — and the
trainer's straight-through layer computing the same numerics (`StraightThroughQuantizedLinear`, the unified precision
flow: `straight_through_linears_`).

Precision modes of the rollout engine (design OVERVIEW, "Precision modes"):

- ``"bf16"``: no quantization; the engine runs in its high-precision dtype.
- ``"fp8"``: W8A8 dynamic FP8 with per-row scales. Weights are quantized once,
  W_q = round_e4m3(W / s_w) with one scale per output row s_w = max|W_row| / 448, and every
  activation row is quantized the same way at call time; the matmul runs on the FP8 values and
  rescales. On CUDA with compute capability ≥ 8.9 this is torchao's public
  ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``; elsewhere the same numerics
  are built directly from torchao's ``Float8Tensor`` with the plain-torch kernels (slow but
  faithful), so that every test of the rollout mismatch runs on CPU.
- ``"fp8_weight_only"``: torchao's ``Float8WeightOnlyConfig``: FP8 weights (per-row scales),
  dequantized for a high-precision matmul.
- ``"int8"``: W8A8 dynamic INT8 (QuRL's INT8 rollouts): torchao's
  ``Int8DynamicActivationInt8WeightConfig`` — symmetric per-row int8 weights, activations quantized
  per token at call time.
- ``"fp8_tensor"``: W8A8 dynamic FP8 with one scale per tensor, s = max|W| / 448 for the weight and
  s = max|x| / 448 for each activation tensor at call time: torchao's
  ``Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor())`` on CUDA ≥ 8.9, elsewhere the
  same ``Float8Tensor`` with plain-torch kernels (as "fp8").
- ``"int4"`` / ``"int4_g128"``: 4-bit weight-only: torchao's ``IntxWeightOnlyConfig(weight_dtype=torch.int4)``
  with symmetric scales per group of 32 (resp. 128) input features, dequantized for a high-precision
  matmul (runs on CPU and GPU alike; no speed-up without a packed int4 kernel, but the numerics of
  4-bit rollouts).
- ``"mxfp8"`` / ``"mxfp4"``: OCP microscaling W8A8 / W4A4 (torchao's ``MXDynamicActivationMXWeightConfig``):
  every block of 32 consecutive input features of a weight row and of an activation row shares one
  power-of-two scale 2^e (E8M0), e from the block's max|·| with torchao's RCEIL rounding, and the
  elements are round(x / 2^e) in e4m3 (mxfp8) or e2m1 (mxfp4); the matmul runs on those. On CUDA with
  compute capability ≥ 10.0 torchao's native MX kernels run; elsewhere torchao's own emulated kernel
  (``KernelPreference.EMULATED``: dequantize both operands, high-precision matmul), same numerics.
- ``"nvfp4_weight_only"``: torchao's ``NVFP4WeightOnlyConfig``: e2m1 weights in blocks of 16 input
  features with an e4m3 block scale under one float32 per-tensor scale (s_tensor = max|W| / (448·6)),
  dequantized for a high-precision matmul on any device.
- ``"nvfp4"``: NVFP4 W4A4 (QeRL's rollouts; torchao's ``NVFP4DynamicActivationNVFP4WeightConfig`` with a
  dynamic per-tensor scale): the weights as in ``"nvfp4_weight_only"``, and every activation tensor quantized
  the same way at call time (its per-tensor scale from the max|x| of the whole input, e4m3 scales per block of
  16 features). On CUDA with compute capability ≥ 10.0 torchao's native kernels run; elsewhere the weight is
  the weight-only NVFP4 tensor and a forward pre-hook replaces the layer's input by its NVFP4 round trip
  (torchao's ``NVFP4Tensor.to_nvfp4`` then ``dequantize``) before the high-precision matmul: the same numerics
  up to float32 accumulation order (torchao has no emulated NVFP4 matmul).

Stacked mixture-of-experts weights (LLaDA2's `LLaDA2MoeExperts`: [E, out, in], each expert's slice a Linear weight) are
quantized in ``"fp8"`` mode only (`quantize_stacked_experts_`): each expert's rows as a Linear's (torchao's
``Float8Tensor``, per-row scales [E, out, 1]), the activation rows per row at call time, and the grouped matmul
runs ``torch._scaled_grouped_mm`` on CUDA ≥ 9.0 (elsewhere the same FP8 operands dequantized through ``grouped_mm``,
float rounding aside the same numerics). In the other modes the experts keep their high-precision weights (a warning
says so): torchao has no grouped kernel for them.

The torchao imports below are partly semi-internal (``QuantizeTensorToFloat8Kwargs``,
``KernelPreference``, ``Float8MMConfig``, the config handler registry, the MX scale functions ``_to_mx_rceil`` and
``get_fp_scale``); they are pinned by the project's ``torchao==0.18.0``.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Iterable

import torch
from torch import nn
from torchao.float8.inference import Float8MMConfig
from torchao.prototype.mx_formats import (
    MXDynamicActivationMXWeightConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    NVFP4WeightOnlyConfig,
)
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import MXTensor, QuantizeTensorToMXKwargs, _to_mx_rceil, get_fp_scale
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
from torchao.quantization import (
    Float8DynamicActivationFloat8WeightConfig,
    Float8Tensor,
    Float8WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    IntxWeightOnlyConfig,
    PerGroup,
    PerRow,
    PerTensor,
)
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs
from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor
from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
from torchao.utils import TorchAOBaseTensor

from dllm_ais.choices import PRECISIONS
from dllm_ais.models.llada2 import LLaDA2MoeExperts
from dllm_ais.ops import check_choice

__all__ = ["PRECISIONS", "SkipRule", "StraightThroughQuantizedLinear", "check_precision", "kernel_path",
           "is_quantizable", "native_fp8_available", "native_mx_available", "quantize_model_",
           "quantize_stacked_experts_", "quantized_weight", "requantize_", "stacked_expert_modules",
           "straight_through_linears_"]

FP8_DTYPE = torch.float8_e4m3fn
# FP8 and INT8 matmul kernels need both matrix dimensions of the weight to be multiples of 16; the block formats also
# need their input dimension to be a multiple of their group (block) size. Other layers keep their weights.
DIM_MULTIPLE = 16
INT4_GROUP_SIZES = {"int4": 32, "int4_g128": 128}
MX_ELEMENT_DTYPES = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}
MX_BLOCK_SIZE = 32
E2M1_MAX = 6.0  # the largest e2m1 (FP4) number
FLOAT32_EXPONENT_BITS = 0x7F800000
NVFP4_BLOCK_SIZE = 16
NVFP4_MODES = ("nvfp4", "nvfp4_weight_only")
INPUT_MULTIPLES = {**INT4_GROUP_SIZES, **dict.fromkeys(MX_ELEMENT_DTYPES, MX_BLOCK_SIZE),
                   **dict.fromkeys(NVFP4_MODES, NVFP4_BLOCK_SIZE)}
FP8_GRANULARITIES = {"fp8": PerRow, "fp8_tensor": PerTensor}  # the W8A8 FP8 modes and their scale granularity
NATIVE_FP8_MIN_CAPABILITY = (8, 9)
NATIVE_FP8_GROUPED_MIN_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm (Hopper and later)
STACKED_EXPERT_PRECISIONS = ("fp8",)
NATIVE_MX_MIN_CAPABILITY = (10, 0)
# Lower bound on a row's absolute maximum before its FP8 scale is taken: an all-zero activation row (e.g. the
# embedding of a padding token, which `padding_idx` keeps at zero) would otherwise get scale 0 and turn into NaN.
AMAX_FLOOR = 1e-12

logger = logging.getLogger("dllm_ais")

SkipRule = Callable[[str, nn.Module], bool]


def check_precision(precision: str) -> None:
    """Raise ValueError naming the valid precision modes unless `precision` is one of PRECISIONS."""
    check_choice("precision", precision, PRECISIONS)


def native_fp8_available(device: torch.device | str | None) -> bool:
    """Whether `device` is a CUDA GPU with compute capability ≥ 8.9 (Ada, Hopper, Blackwell): native FP8 matmuls."""
    return _cuda_capability_at_least(device, NATIVE_FP8_MIN_CAPABILITY)


def native_mx_available(device: torch.device | str | None) -> bool:
    """Whether `device` is a CUDA GPU with compute capability ≥ 10.0 (Blackwell): torchao's native MX matmuls."""
    return _cuda_capability_at_least(device, NATIVE_MX_MIN_CAPABILITY)


def _cuda_capability_at_least(device: torch.device | str | None, capability: tuple[int, int]) -> bool:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= capability


def kernel_path(precision: str, device: torch.device | str | None) -> str:
    """One line naming the kernels that run the linear layers of `precision` on `device` (native or emulated)."""
    check_precision(precision)
    if precision in FP8_GRANULARITIES:
        return ("native: torchao FP8 scaled-mm kernels" if native_fp8_available(device) else
                "emulated: torchao Float8Tensor with plain-torch kernels (native numerics, no speed-up)")
    if precision in MX_ELEMENT_DTYPES:
        return ("native: torchao MX scaled-mm kernels" if native_mx_available(device) else
                "emulated: torchao MXTensor with its emulated kernel (native numerics, no speed-up)")
    if precision == "nvfp4":
        return ("native: torchao NVFP4 scaled-mm kernels" if native_mx_available(device) else
                "emulated: torchao NVFP4Tensor weights, activations NVFP4 round-tripped before a high-precision "
                "matmul (native numerics, no speed-up)")
    if precision == "int8":
        return "torchao Int8Tensor: per-token int8 activations, int8 matmul"
    if precision == "bf16":
        return "high precision: no quantization"
    return "weight-only: torchao dequantizes the weight for a high-precision matmul"


def quantize_model_(model: nn.Module, precision: str, skip: SkipRule) -> list[str]:
    """Quantize, in place, to `precision` every `nn.Linear` of `model` whose in/out features are multiples
    of 16 (inputs also a multiple of the mode's block size: INPUT_MULTIPLES) and for which `skip(name, module)`
    is False; return the names of the quantized modules.

    Other layers (and every layer in "bf16" mode) keep their high-precision weights. The W8A8 FP8 and MX modes
    on a CUDA GPU with their native kernels cast the selected layers to bf16 first (torchao's kernels want bf16
    weights; keep the model in bf16 there); elsewhere they use the emulated path. The kernel path is logged once
    per process and mode (a warning when emulated).
    """
    check_precision(precision)
    if precision == "bf16":
        return []
    names = [name for name, module in model.named_modules() if is_quantizable(name, module, skip, precision)]
    emulated_nvfp4 = bool(names) and _rounds_input_trip(precision, model.get_submodule(names[0]).weight.device)
    for name in names:
        linear = model.get_submodule(name)
        linear.weight = nn.Parameter(quantized_weight(precision, linear.weight.detach()), requires_grad=False)
        if emulated_nvfp4:
            linear.register_forward_pre_hook(_nvfp4_round_trip_input)
    if names:
        _log_kernel_path(precision, kernel_path(precision, model.get_submodule(names[0]).weight.device))
    return names + quantize_stacked_experts_(model, precision)


def stacked_expert_modules(model: nn.Module) -> list[tuple[str, LLaDA2MoeExperts]]:
    """(name, module) of every stack of routed experts in `model` (LLaDA2's `LLaDA2MoeExperts`)."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LLaDA2MoeExperts)]


def quantize_stacked_experts_(model: nn.Module, precision: str) -> list[str]:
    """In "fp8" mode, replace in place both weight stacks of every `stacked_expert_modules` entry whose dims are
    multiples of 16 by its per-row FP8 stack and its `grouped_mm` by `fp8_grouped_mm`; return the names of the
    modules quantized. Other modes leave the experts in high precision (a warning, once per mode)."""
    experts = stacked_expert_modules(model)
    if not experts or precision == "bf16":
        return []
    if precision not in STACKED_EXPERT_PRECISIONS:
        _warn_experts_kept(precision)
        return []
    names = []
    for name, module in experts:
        stacks = (module.gate_up_proj, module.down_proj)
        if any(dim % DIM_MULTIPLE for stack in stacks for dim in stack.shape[1:]):
            continue
        module.gate_up_proj, module.down_proj = (
            nn.Parameter(quantized_weight(precision, stack.detach()), requires_grad=False) for stack in stacks)
        module.grouped_mm = fp8_grouped_mm
        names.append(name)
    return names


def fp8_grouped_mm(rows: torch.Tensor, stacked: Float8Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """`dllm_ais.models.llada2.plain_grouped_mm` of FP8 experts: `rows` [N, in] quantized per row as a W8A8 Linear's
    activations, times the per-row FP8 `stacked` [E, out, in] group by group; [N, out] in rows' dtype."""
    activation = Float8Tensor.from_hp(rows, float8_dtype=FP8_DTYPE, granularity=PerRow(), hp_value_lb=AMAX_FLOOR,
                                      kernel_preference=KernelPreference.TORCH)
    if _cuda_capability_at_least(rows.device, NATIVE_FP8_GROUPED_MIN_CAPABILITY):
        return torch._scaled_grouped_mm(
            activation.qdata, stacked.qdata.transpose(1, 2), activation.scale.reshape(-1).float(),
            stacked.scale.reshape(stacked.shape[0], -1).float(), offs=group_ends, out_dtype=torch.bfloat16,
            use_fast_accum=True).to(rows.dtype)
    return torch.nn.functional.grouped_mm(activation.dequantize(torch.float32),
                                          stacked.dequantize(torch.float32).transpose(1, 2),
                                          offs=group_ends).to(rows.dtype)


@functools.cache
def _warn_experts_kept(precision: str) -> None:
    logger.warning("precision=%r quantizes no stacked experts (only %s does); they run in high precision.",
                   precision, ", ".join(STACKED_EXPERT_PRECISIONS))


def straight_through_linears_(linears: Iterable[tuple[str, nn.Module, str, nn.Linear]], precision: str,
                              skip: SkipRule) -> list[str]:
    """Replace, in place, each linear layer `linears` names — (name, holder, attribute, layer), the layer being
    `getattr(holder, attribute)` — that `quantize_model_` would quantize by a `StraightThroughQuantizedLinear` of
    `precision`; return the names replaced. The trainer's side of the unified precision flow."""
    check_precision(precision)
    if precision == "bf16":
        return []
    names = []
    for name, holder, attribute, linear in linears:
        if isinstance(linear, LLaDA2MoeExperts) and precision in STACKED_EXPERT_PRECISIONS:
            raise NotImplementedError(f"rollout.precision_flow=unified does not quantize the stacked experts ({name}) "
                                      "in the trainer: set rollout.precision_flow=split")
        if is_quantizable(name, linear, skip, precision):
            setattr(holder, attribute, StraightThroughQuantizedLinear(linear, precision))
            names.append(name)
            _log_kernel_path(precision, kernel_path(precision, linear.weight.device))
    return names


def _rounds_input_trip(precision: str, device: torch.device) -> bool:
    """Whether the layer's input goes through the emulated NVFP4 round trip before the matmul (`_nvfp4_round_trip_input`):
    W4A4 NVFP4 without torchao's native kernels."""
    return precision == "nvfp4" and not native_mx_available(device)


class StraightThroughQuantizedLinear(nn.Linear):
    """A trainer's linear layer computing the rollout engine's quantized numerics (`rollout.precision_flow: unified`).

    Forward: exactly the engine's layer of the same precision — the weight quantized by `quantized_weight`, the
    activations by the same quantizer inside torchao's matmul (NVFP4 emulated: the same round trip), so trainer and
    engine compute the same logits. Backward: the quantizers are passed straight through, in the input's dtype:
    ∂L/∂x = ∂L/∂y · deq(W_q) and, for a trainable weight, ∂L/∂W = (∂L/∂y)ᵀ · x and ∂L/∂b = Σ ∂L/∂y.

    A frozen weight (a LoRA base layer, a reference model) is quantized once and its high-precision copy dropped:
    `weight` is then None and `quantized` holds the only copy (a plain attribute, outside `state_dict` and
    `parameters()`, so optimizers, DDP and checkpoints see only what trains). A trainable weight (full fine-tuning)
    stays the high-precision master `weight`; `quantized` is its quantization, redone whenever the weight changed
    in place (an optimizer step bumps its version), so the forward always quantizes the current weight (QAT).

    MX modes on torchao's emulated kernel (`emulated_mx`) compute that kernel's matmul directly
    (`_emulated_mx_linear`): the activations take the vectorised round trip `_mx_round_trip` in place of torchao's
    bitwise encode and decode; the logits and gradients are the same bits as through torchao. deq(W_q) is made by
    each forward, as torchao's kernel makes it, and not kept: the layer holds no high-precision copy.
    """

    def __init__(self, linear: nn.Linear, precision: str):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.precision = precision
        self.bias = linear.bias
        self.round_trip_input = _rounds_input_trip(precision, linear.weight.device)
        self.emulated_mx = precision in MX_ELEMENT_DTYPES and not native_mx_available(linear.weight.device)
        self.quantized = quantized_weight(precision, linear.weight.detach())
        if linear.weight.requires_grad:
            self.weight = linear.weight
            self.quantized_version = linear.weight._version
        else:
            self.weight = None

    def current_quantized_weight(self) -> TorchAOBaseTensor:
        """The quantized weight the forward multiplies by: the frozen one, or the master weight's, requantized if the
        master weight changed since it was last quantized."""
        if self.weight is not None and self.weight._version != self.quantized_version:
            self.quantized = quantized_weight(self.precision, self.weight.detach())
            self.quantized_version = self.weight._version
        return self.quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StraightThroughLinear.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, precision={self.precision!r}, trainable_weight={self.weight is not None}"


class _StraightThroughLinear(torch.autograd.Function):
    """y = the engine's quantized linear of x; gradients straight through the quantizers (StraightThroughQuantizedLinear)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        quantized = layer.current_quantized_weight()
        ctx.quantized = quantized
        ctx.save_for_backward(x if weight is not None and weight.requires_grad else None)
        if layer.emulated_mx:
            dequantized = quantized.dequantize(quantized.dtype)
            return _emulated_mx_linear(x, dequantized, bias, MX_ELEMENT_DTYPES[layer.precision])
        return torch.nn.functional.linear(_nvfp4_round_trip(x) if layer.round_trip_input else x, quantized, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_output @ ctx.quantized.dequantize().to(grad_output.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = rows.T @ x.reshape(-1, x.shape[-1]).to(grad_output.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias, None


def _emulated_mx_linear(x: torch.Tensor, dequantized_weight: torch.Tensor, bias: torch.Tensor | None,
                        element_dtype: torch.dtype) -> torch.Tensor:
    """torchao's emulated MX linear (its `mx_linear` with KernelPreference.EMULATED) given deq(W_q): the input's
    rows round-tripped through MX (`_mx_round_trip`), then the same addmm (mm without bias) on the same operands."""
    rows = _mx_round_trip(x.reshape(-1, x.shape[-1]), element_dtype)
    weight = dequantized_weight.t()
    out = torch.mm(rows, weight) if bias is None else torch.addmm(bias, rows, weight)
    return out.view(*x.shape[:-1], out.shape[-1])


def _mx_round_trip(x: torch.Tensor, element_dtype: torch.dtype) -> torch.Tensor:
    """deq(MX(x)) in x's dtype, bit for bit torchao's `MXTensor.to_mx(x, ..., RCEIL)` then `dequantize`: per block of
    32 features the same E8M0 scale and scaled values (torchao's `_to_mx_rceil`), the values rounded to the element
    format — e4m3 by a cast, e2m1 by `_round_to_e2m1` in place of torchao's bitwise encode, pack and decode."""
    blocks = x.reshape(*x.shape[:-1], -1, MX_BLOCK_SIZE)
    max_abs = torch.amax(torch.abs(blocks), -1, keepdim=True).to(torch.float32)
    max_element = torch.finfo(torch.float8_e4m3fn).max if element_dtype == torch.float8_e4m3fn else E2M1_MAX
    exponent, scaled = _to_mx_rceil(blocks.to(torch.float32), max_abs, max_element)
    elements = scaled.to(torch.float8_e4m3fn) if element_dtype == torch.float8_e4m3fn else _round_to_e2m1(scaled)
    return (elements.to(x.dtype) * get_fp_scale(exponent).to(x.dtype)).reshape(x.shape)


def _round_to_e2m1(values: torch.Tensor) -> torch.Tensor:
    """`values` (float32, |v| ≤ 6) rounded to the nearest e2m1 number (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed), ties to
    the even code, as torchao's `f32_to_f4_unpacked` encodes them. The grid's spacing is 0.5 below 2, 1 below 4 and 2
    up to 6 — the float32 spacing between 2^22 and 2^23, 2^23 and 2^24, 2^24 and 2^25 — so (|v| + c) − c with
    c = 2^22 · max(1, 2^⌊log2 |v|⌋) is |v| rounded half to even on it by float32's own addition; the sign is then put
    back (-0.0 for negatives that round to 0)."""
    magnitude = values.abs()
    power_of_two = (magnitude.view(torch.int32) & FLOAT32_EXPONENT_BITS).view(torch.float32)
    offset = power_of_two.clamp_(min=1.0).mul_(2.0 ** 22)
    return torch.copysign((magnitude + offset).sub_(offset), values)


def quantized_weight(precision: str, weight: torch.Tensor) -> TorchAOBaseTensor:
    """`weight` [out, in] quantized as the engine stores it in mode `precision` (any mode but "bf16"); in the FP8 modes
    also a stack of experts' weights [E, out, in] (scales per row of each expert)."""
    if precision in FP8_GRANULARITIES and (weight.ndim == 3 or not native_fp8_available(weight.device)):
        return _emulated_w8a8_weight(weight, FP8_GRANULARITIES[precision]())  # a stack: its own grouped matmul
    if precision in MX_ELEMENT_DTYPES and not native_mx_available(weight.device):
        return _emulated_mx_weight(weight, MX_ELEMENT_DTYPES[precision])
    if precision == "nvfp4" and not native_mx_available(weight.device):
        precision = "nvfp4_weight_only"  # the same weight; quantize_model_ hooks the activations' round trip
    if precision in FP8_GRANULARITIES or precision in MX_ELEMENT_DTYPES or precision == "nvfp4":
        weight = weight.to(torch.bfloat16)
    config = _torchao_config(precision)
    holder = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    holder.weight = nn.Parameter(weight, requires_grad=False)  # no copy: the handler reads it and replaces it
    return _QUANTIZE_CONFIG_HANDLER[type(config)](holder, config).weight.detach()


@torch.no_grad()
def requantize_(param: nn.Parameter, high_precision_weight: torch.Tensor) -> None:
    """Write `high_precision_weight` into `param` in place, keeping its storage.

    A quantized parameter (any mode) gets the weight quantized in its own mode (read off its type and settings)
    and `copy_`-ed into its data and scales; any other parameter gets a plain `copy_` (casting dtype and device).
    """
    if not isinstance(param, TorchAOBaseTensor):
        param.copy_(high_precision_weight)
        return
    if high_precision_weight.shape != param.shape:
        raise ValueError(
            f"Cannot requantize a weight of shape {tuple(high_precision_weight.shape)} into a quantized parameter of "
            f"shape {tuple(param.shape)}; the trainer and the engine must share one architecture."
        )
    weight = high_precision_weight.to(device=param.device, dtype=param.dtype)
    param.copy_(quantized_weight(_precision_of(param), weight))


def _precision_of(param: TorchAOBaseTensor) -> str:
    """The precision mode a quantized engine parameter was made in."""
    if isinstance(param, Float8Tensor):
        if param.act_quant_kwargs is None:
            return "fp8_weight_only"
        return "fp8_tensor" if isinstance(param.act_quant_kwargs.granularity, PerTensor) else "fp8"
    if isinstance(param, Int8Tensor):
        return "int8"
    if isinstance(param, IntxUnpackedToInt8Tensor):
        return {size: name for name, size in INT4_GROUP_SIZES.items()}[param.block_size[-1]]
    if isinstance(param, MXTensor):
        return {dtype: name for name, dtype in MX_ELEMENT_DTYPES.items()}[param.elem_dtype]
    if isinstance(param, NVFP4Tensor):  # the emulated "nvfp4" stores the weight-only tensor: the same weight
        return "nvfp4_weight_only" if param.act_quant_kwargs is None else "nvfp4"
    raise TypeError(
        f"requantize_ supports the weights quantize_model_ makes, got {type(param).__name__}; "
        f"quantize the model with dllm_ais.quantization.quantize_model_."
    )


def _torchao_config(precision: str):
    """The torchao config of a mode that torchao's own `quantize_` handlers build (every mode but the emulated ones)."""
    if precision in FP8_GRANULARITIES:
        return Float8DynamicActivationFloat8WeightConfig(granularity=FP8_GRANULARITIES[precision](),
                                                         set_inductor_config=False, activation_value_lb=AMAX_FLOOR)
    if precision in INT4_GROUP_SIZES:
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_SIZES[precision]))
    if precision in MX_ELEMENT_DTYPES:
        element_dtype = MX_ELEMENT_DTYPES[precision]
        return MXDynamicActivationMXWeightConfig(block_size=MX_BLOCK_SIZE, activation_dtype=element_dtype,
                                                 weight_dtype=element_dtype, scaling_mode=ScaleCalculationMode.RCEIL)
    return {
        "fp8_weight_only": lambda: Float8WeightOnlyConfig(set_inductor_config=False),
        "int8": lambda: Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
        "nvfp4_weight_only": NVFP4WeightOnlyConfig,
        "nvfp4": lambda: NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False),
    }[precision]()


def is_quantizable(name: str, module: nn.Module, skip: SkipRule, precision: str) -> bool:
    """A linear layer the low-precision kernels accept (dims multiples of 16; inputs a multiple of the mode's
    block size) that the caller does not skip."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % INPUT_MULTIPLES.get(precision, DIM_MULTIPLE) == 0
        and module.out_features % DIM_MULTIPLE == 0
        and not skip(name, module)
    )


def _emulated_w8a8_weight(weight: torch.Tensor, granularity: PerRow | PerTensor) -> Float8Tensor:
    """The W8A8 FP8 weight of the native path (scales per row or per tensor), built with the plain-torch kernels
    that run on any device: W_q = round_e4m3(W / s), s = max|W| / 448 over the row (tensor); activations alike.

    A per-tensor weight records its block as (-1, -1), torchao's other spelling of "the whole tensor": its own
    (rows, columns) would read as 128 x 128 blockwise scaling for a 128 x 128 weight in torchao 0.18's matmul."""
    quantized = Float8Tensor.from_hp(
        weight,
        float8_dtype=FP8_DTYPE,
        granularity=granularity,
        mm_config=Float8MMConfig(use_fast_accum=True),
        kernel_preference=KernelPreference.TORCH,
        act_quant_kwargs=QuantizeTensorToFloat8Kwargs(
            float8_dtype=FP8_DTYPE, granularity=granularity, kernel_preference=KernelPreference.TORCH,
            hp_value_lb=AMAX_FLOOR,
        ),
    )
    if isinstance(granularity, PerTensor):
        quantized.block_size = [-1] * quantized.ndim
    return quantized


def _emulated_mx_weight(weight: torch.Tensor, element_dtype: torch.dtype) -> MXTensor:
    """The MX weight of torchao's native path with torchao's emulated kernel, on any device: per block b of 32 input
    features, scale 2^e_b (E8M0, RCEIL from max|W_b|) and elements round(W_b / 2^e_b) in `element_dtype`; activations
    are quantized alike at call time and the matmul runs on the dequantized operands."""
    return MXTensor.to_mx(
        weight, element_dtype, block_size=MX_BLOCK_SIZE, kernel_preference=KernelPreference.EMULATED,
        is_swizzled_scales=False, scaling_mode=ScaleCalculationMode.RCEIL,
        act_quant_kwargs=QuantizeTensorToMXKwargs(
            elem_dtype=element_dtype, block_size=MX_BLOCK_SIZE, kernel_preference=KernelPreference.EMULATED,
            is_swizzled_scales=False, scaling_mode=ScaleCalculationMode.RCEIL,
        ),
    )


def _nvfp4_round_trip_input(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of an emulated "nvfp4" layer: its input x replaced by dequantize(NVFP4(x)), torchao's
    dynamic activation recipe — one float32 scale max|x| / (448·6) over the whole input (floored at AMAX_FLOOR so
    that an all-zero input stays finite), e4m3 scales per block of 16 features, e2m1 elements."""
    x, *rest = args
    return (_nvfp4_round_trip(x), *rest)


def _nvfp4_round_trip(x: torch.Tensor) -> torch.Tensor:
    """dequantize(NVFP4(x)) with torchao's dynamic activation recipe (`_nvfp4_round_trip_input`)."""
    rows = x.reshape(-1, x.shape[-1])
    tensor_scale = per_tensor_amax_to_scale(rows.abs().max().clamp(min=AMAX_FLOOR))
    quantized = NVFP4Tensor.to_nvfp4(rows, block_size=NVFP4_BLOCK_SIZE, per_tensor_scale=tensor_scale)
    return quantized.dequantize(x.dtype).reshape(x.shape)


@functools.cache
def _log_kernel_path(precision: str, path: str) -> None:
    """Tell the user, once per process and mode, which kernels run the quantized layers (a warning when emulated)."""
    level = logging.WARNING if path.startswith("emulated") else logging.INFO
    logger.log(level, "precision=%r runs %s.", precision, path)

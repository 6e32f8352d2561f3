"""Low-precision copies of a model's linear layers through torchao — the only module that imports torchao.

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
- ``"int4"``: 4-bit weight-only: torchao's ``IntxWeightOnlyConfig(weight_dtype=torch.int4)`` with
  symmetric scales per group of 32 input features, dequantized for a high-precision matmul (runs on
  CPU and GPU alike; no speed-up without a packed int4 kernel, but the numerics of 4-bit rollouts).

The torchao imports below are partly semi-internal (``QuantizeTensorToFloat8Kwargs``,
``KernelPreference``, ``Float8MMConfig``, the config handler registry); they are pinned by the
project's ``torchao==0.18.0``.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch import nn
from torchao.float8.inference import Float8MMConfig
from torchao.quantization import (
    Float8DynamicActivationFloat8WeightConfig,
    Float8Tensor,
    Float8WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    IntxWeightOnlyConfig,
    PerGroup,
    PerRow,
)
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs
from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor
from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
from torchao.utils import TorchAOBaseTensor

from dllm_ais.choices import PRECISIONS
from dllm_ais.ops import check_choice

__all__ = ["PRECISIONS", "SkipRule", "check_precision", "native_fp8_available", "quantize_model_", "quantized_weight",
           "requantize_"]

FP8_DTYPE = torch.float8_e4m3fn
# FP8 and INT8 matmul kernels need both matrix dimensions of the weight to be multiples of 16 (and int4 groups of 32
# divide any such input dimension that is a multiple of 32; others keep their weights).
DIM_MULTIPLE = 16
INT4_GROUP_SIZE = 32
NATIVE_FP8_MIN_CAPABILITY = (8, 9)
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
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= NATIVE_FP8_MIN_CAPABILITY


def quantize_model_(model: nn.Module, precision: str, skip: SkipRule) -> list[str]:
    """Quantize, in place, to `precision` every `nn.Linear` of `model` whose in/out features are multiples
    of 16 (of 32 inputs for int4) and for which `skip(name, module)` is False; return the names of the
    quantized modules.

    Other layers (and every layer in "bf16" mode) keep their high-precision weights. "fp8" on a CUDA GPU
    with native FP8 casts the selected layers to bf16 first (torchao's per-row kernels want bf16 weights;
    keep the model in bf16 there); elsewhere it uses the emulated W8A8 path and logs a notice once per process.
    """
    check_precision(precision)
    if precision == "bf16":
        return []
    names = [name for name, module in model.named_modules() if _is_quantizable(name, module, skip, precision)]
    for name in names:
        linear = model.get_submodule(name)
        linear.weight = nn.Parameter(quantized_weight(precision, linear.weight.detach()), requires_grad=False)
    return names


def quantized_weight(precision: str, weight: torch.Tensor) -> TorchAOBaseTensor:
    """`weight` [out, in] quantized as the engine stores it in mode `precision` (any mode but "bf16")."""
    if precision == "fp8" and not native_fp8_available(weight.device):
        _log_emulated_fp8_notice()
        return _emulated_w8a8_weight(weight)
    if precision == "fp8":
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
        return "fp8" if param.act_quant_kwargs is not None else "fp8_weight_only"
    if isinstance(param, Int8Tensor):
        return "int8"
    if isinstance(param, IntxUnpackedToInt8Tensor):
        return "int4"
    raise TypeError(
        f"requantize_ supports the weights quantize_model_ makes, got {type(param).__name__}; "
        f"quantize the model with dllm_ais.quantization.quantize_model_."
    )


def _torchao_config(precision: str):
    """The torchao config of a mode that torchao's own `quantize_` handlers build (every mode but emulated fp8)."""
    return {
        "fp8": lambda: Float8DynamicActivationFloat8WeightConfig(
            granularity=PerRow(), set_inductor_config=False, activation_value_lb=AMAX_FLOOR),
        "fp8_weight_only": lambda: Float8WeightOnlyConfig(set_inductor_config=False),
        "int8": lambda: Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
        "int4": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_SIZE)),
    }[precision]()


def _is_quantizable(name: str, module: nn.Module, skip: SkipRule, precision: str) -> bool:
    """A linear layer the low-precision kernels accept (dims multiples of 16; int4: inputs a multiple of its
    group size) that the caller does not skip."""
    input_multiple = INT4_GROUP_SIZE if precision == "int4" else DIM_MULTIPLE
    return (
        isinstance(module, nn.Linear)
        and module.in_features % input_multiple == 0
        and module.out_features % DIM_MULTIPLE == 0
        and not skip(name, module)
    )


def _emulated_w8a8_weight(weight: torch.Tensor) -> Float8Tensor:
    """The W8A8 per-row FP8 weight of the native path, built with the plain-torch kernels that run on any device."""
    return Float8Tensor.from_hp(
        weight,
        float8_dtype=FP8_DTYPE,
        granularity=PerRow(),
        mm_config=Float8MMConfig(use_fast_accum=True),
        kernel_preference=KernelPreference.TORCH,
        act_quant_kwargs=QuantizeTensorToFloat8Kwargs(
            float8_dtype=FP8_DTYPE, granularity=PerRow(), kernel_preference=KernelPreference.TORCH,
            hp_value_lb=AMAX_FLOOR,
        ),
    )


@functools.cache
def _log_emulated_fp8_notice() -> None:
    """Tell the user, once per process, that fp8 runs on the emulated path."""
    logger.warning(
        "precision='fp8' runs the slow-but-faithful emulated W8A8 FP8 path (torchao Float8Tensor with plain-torch "
        "kernels) because no CUDA GPU with compute capability >= 8.9 is present; the numerics match the native "
        "path but rollouts are not faster than bf16."
    )

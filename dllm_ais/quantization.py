"""FP8 quantization of a model's linear layers through torchao — the only module that imports torchao.

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

The torchao imports below are partly semi-internal (``QuantizeTensorToFloat8Kwargs``,
``KernelPreference``, ``Float8MMConfig``); they are pinned by the project's ``torchao==0.18.0``.
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
    PerRow,
    PerTensor,
    quantize_,
)
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs
from torchao.quantization.utils import get_block_size
from torchao.utils import TorchAOBaseTensor

from dllm_ais.choices import PRECISIONS
from dllm_ais.ops import check_choice

__all__ = ["PRECISIONS", "SkipRule", "check_precision", "native_fp8_available", "quantize_model_", "requantize_"]

FP8_DTYPE = torch.float8_e4m3fn
# FP8 matmul kernels need both matrix dimensions of the weight to be multiples of 16.
FP8_DIM_MULTIPLE = 16
NATIVE_FP8_MIN_CAPABILITY = (8, 9)

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
    of 16 and for which `skip(name, module)` is False; return the names of the quantized modules.

    Other layers (and every layer in "bf16" mode) keep their high-precision weights. "fp8" on a CUDA GPU
    with native FP8 casts the selected layers to bf16 first (torchao's per-row kernels want bf16 weights;
    keep the model in bf16 there); elsewhere it uses the emulated W8A8 path and logs a notice once per process.
    """
    check_precision(precision)
    names = [name for name, module in model.named_modules() if _is_quantizable(name, module, skip)]
    if precision == "bf16" or not names:
        return []
    selected = set(names)

    def selects(module: nn.Module, name: str) -> bool:
        return name in selected

    if precision == "fp8_weight_only":
        quantize_(model, Float8WeightOnlyConfig(set_inductor_config=False), filter_fn=selects)
    elif native_fp8_available(model.get_submodule(names[0]).weight.device):
        for name in names:
            model.get_submodule(name).to(torch.bfloat16)
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False,
                                                           activation_value_lb=AMAX_FLOOR)
        quantize_(model, config, filter_fn=selects)
    else:
        _log_emulated_fp8_notice()
        for name in names:
            linear = model.get_submodule(name)
            linear.weight = nn.Parameter(_emulated_w8a8_weight(linear.weight.detach()), requires_grad=False)
    return names


@torch.no_grad()
def requantize_(param: nn.Parameter, high_precision_weight: torch.Tensor) -> None:
    """Write `high_precision_weight` into `param` in place, keeping its storage.

    For an FP8 parameter (either fp8 mode) the weight is quantized with the settings read off the
    existing tensor (float8 dtype, granularity, matmul config, activation quantization, kernel
    preference, high-precision dtype) and copied into its `qdata` and `scale`; any other parameter
    gets a plain `copy_` (casting dtype and device).
    """
    if isinstance(param, Float8Tensor):
        param.copy_(_quantize_like(param, high_precision_weight))
    elif isinstance(param, TorchAOBaseTensor):
        raise TypeError(
            f"requantize_ supports torchao Float8Tensor weights only, got {type(param).__name__}; "
            f"quantize the model with dllm_ais.quantization.quantize_model_."
        )
    else:
        param.copy_(high_precision_weight)


def _is_quantizable(name: str, module: nn.Module, skip: SkipRule) -> bool:
    """A linear layer FP8 kernels accept (dims multiples of 16) that the caller does not skip."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % FP8_DIM_MULTIPLE == 0
        and module.out_features % FP8_DIM_MULTIPLE == 0
        and not skip(name, module)
    )


# Lower bound on a row's absolute maximum before its FP8 scale is taken: an all-zero activation row (e.g. the
# embedding of a padding token, which `padding_idx` keeps at zero) would otherwise get scale 0 and turn into NaN.
AMAX_FLOOR = 1e-12


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


def _quantize_like(reference: Float8Tensor, high_precision_weight: torch.Tensor) -> Float8Tensor:
    """Quantize `high_precision_weight` with exactly the settings `reference` was built with."""
    if high_precision_weight.shape != reference.shape:
        raise ValueError(
            f"Cannot requantize a weight of shape {tuple(high_precision_weight.shape)} into an FP8 parameter of "
            f"shape {tuple(reference.shape)}; the trainer and the engine must share one architecture."
        )
    return Float8Tensor.from_hp(
        high_precision_weight.to(device=reference.device, dtype=reference.dtype),
        float8_dtype=reference.qdata.dtype,
        granularity=_granularity_of(reference),
        mm_config=reference.mm_config,
        kernel_preference=reference.kernel_preference,
        act_quant_kwargs=reference.act_quant_kwargs,
    )


def _granularity_of(tensor: Float8Tensor) -> PerRow | PerTensor:
    """The granularity whose block size is `tensor.block_size` (per-row or per-tensor scales)."""
    for granularity in (PerRow(), PerTensor()):
        if list(get_block_size(tuple(tensor.shape), granularity)) == list(tensor.block_size):
            return granularity
    raise NotImplementedError(
        f"requantize_ handles per-row and per-tensor FP8 weights; this one has block size {tensor.block_size} "
        f"for shape {tuple(tensor.shape)}."
    )


@functools.cache
def _log_emulated_fp8_notice() -> None:
    """Tell the user, once per process, that fp8 runs on the emulated path."""
    logger.warning(
        "precision='fp8' runs the slow-but-faithful emulated W8A8 FP8 path (torchao Float8Tensor with plain-torch "
        "kernels) because no CUDA GPU with compute capability >= 8.9 is present; the numerics match the native "
        "path but rollouts are not faster than bf16."
    )

"""The rollout engine: the low-precision model that samples rollouts and computes ℓ_rollout.

Two precision flows (`rollout.precision_flow`):

- ``split`` (the default): the engine is an inference copy of the trainer's policy — its weights are the trainer's
  with every LoRA adapter merged in (W + ΔW), cast to the engine dtype and, below bf16, quantized
  (dllm_ais.quantization); the LM head, embeddings and norms stay in high precision. `sync_from` refreshes it after
  each optimizer step by copying the merged weights into the existing (quantized) parameters, so the engine never
  re-allocates. The trainer computes in high precision; the correction sees the difference.
- ``unified``: one model. The trainer's own linear layers are made to compute the engine's quantized numerics
  (`quantization.StraightThroughQuantizedLinear`: a LoRA base or any frozen weight quantized once, a trained weight
  quantized on the fly), and the engine samples with the trainer's model itself, adapters running beside the
  quantized base; `sync_from` copies nothing.

Works for any transformers model (LLaDA, causal LMs such as Qwen3), trained with LoRA through peft or
fully fine-tuned, bare or wrapped by DDP / DataParallel / DeepSpeed / torch.compile (the unified flow: bare, DDP or
FSDP2, `components.check_unified_flow_launch`).
"""
from __future__ import annotations

import copy
import logging
import time
from typing import Iterator, NamedTuple

import torch
from accelerate.utils import extract_model_from_parallel
from peft import PeftModel
from peft.tuners.lora import LoraLayer, ParamWrapper
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dllm_ais.quantization import SkipRule, kernel_path, quantize_model_, requantize_, straight_through_linears_
from dllm_ais.sampling.forwards import EagerForwards, StaticForwards, compile_blocks

__all__ = ["RolloutEngine", "adapter_host", "load_merged_weights_", "lm_head_skip_rule", "merged_state_items",
           "quantize_trainer_model_"]

# Module names (a full name or its dotted suffix) of LM heads that `get_output_embeddings` may not report:
# LLaDA's untied head is the top-level `transformer.ff_out` (the per-block `blocks.N.ff_out` is an MLP layer).
LM_HEAD_NAMES = ("lm_head", "embed_out", "transformer.ff_out")

logger = logging.getLogger("dllm_ais")


class RolloutEngine:
    """The model that samples rollouts, in one of the precision modes (dllm_ais.choices.PRECISIONS).

    Attributes:
        model: the engine's model (a transformers model; call it like the trainer's model to sample rollouts and
            compute rollout-side log-probs): with the split flow its own copy (eval mode, no gradients), with the
            unified flow the trainer's model itself (a peft model as such, its adapters in place).
        forwards: the sampling forwards the engine hands to the samplers (``sample(..., forwards=engine.forwards)``,
            `dllm_ais.sampling.forwards`): `EagerForwards` of `model`, or, compiled, its `StaticForwards` (key/value
            buffers and CUDA graphs owned here).
        precision: the precision mode.
        precision_flow: "split" or "unified" (`rollout.precision_flow`).
        quantized_modules: names of the linear layers computed in low precision (empty for "bf16").
        kernel_path: which kernels run them (native or emulated; `dllm_ais.quantization.kernel_path`), also logged
            once per process and mode when the engine is built.
        holds_trainer_weights: whether the split engine is the trainer's policy itself, LoRA merged: "bf16" in the
            trainer's own dtypes, all float32 or wider, so that rounding W + ΔW loses nothing that matters (in
            bfloat16 it can round a small ΔW away).
        execution_path: how the engine's forwards run ("eager", the trainer's model, or compiled: blocks compiled,
            sampling forwards replayed as CUDA graphs on a GPU), logged once when the engine is built, beside the
            kernel path.
    """

    def __init__(self, trainer_model: nn.Module, precision: str = "fp8", dtype: torch.dtype | None = None,
                 compile: bool | None = False, precision_flow: str = "split"):
        """The engine of `trainer_model` at `precision`.

        Split flow: copy `trainer_model` (LoRA adapters merged in, the trainer's model left untouched), cast it to
        `dtype` (None keeps the trainer's parameter dtypes, so "bf16" reproduces the trainer bit for bit) and
        quantize its linear layers to `precision` (`quantize_model_` checks it is one of PRECISIONS). `compile`
        (None = on CUDA only): compile the engine's transformer blocks and give its model static forwards
        (`dllm_ais.sampling.forwards`), replayed as CUDA graphs on a GPU. Syncs write the weights in place, so
        compiled blocks and captured graphs stay valid across them.

        Unified flow: `quantize_trainer_model_` edits `trainer_model` in place and the engine samples with it;
        `dtype` does not apply, and `compile=True` is refused (the compiled engine compiles a copy of its own).
        """
        self.precision = precision
        self.precision_flow = precision_flow
        if precision_flow == "unified":
            if compile:
                raise ValueError("rollout.compile=true compiles the split engine's own copy of the model; the unified "
                                 "precision flow samples with the trainer's model: set rollout.compile=false (or null)")
            # The trainer's outermost module short of DDP: under FSDP2 its forward gathers the root's sharded weights.
            self.model = extract_model_from_parallel(trainer_model, keep_torch_compile=False)
            self.quantized_modules = quantize_trainer_model_(trainer_model, precision)
            self.holds_trainer_weights = False
            self.execution_path = "eager, the trainer's own model (unified precision flow)"
        else:
            self.model = self._split_copy(trainer_model, precision, dtype)
            self.holds_trainer_weights = precision == "bf16" and dtype is None and all(
                param.dtype in (torch.float32, torch.float64) for param in self.model.parameters()
                if param.is_floating_point())
            self.quantized_modules = quantize_model_(self.model, precision, skip=lm_head_skip_rule(self.model))
            self.execution_path = "eager"
        device = next(self.model.parameters()).device
        self.kernel_path = kernel_path(precision, device)
        self.forwards = EagerForwards(self.model)
        if precision_flow != "unified" and (compile or (compile is None and device.type == "cuda")):
            blocks = compile_blocks(self.model)
            self.forwards = StaticForwards(self.model, cuda_graphs=device.type == "cuda")
            self.execution_path = (f"compiled: {blocks} transformer blocks by torch.compile (one graph reused), "
                                   + ("sampling forwards replayed as CUDA graphs" if device.type == "cuda" else
                                      "sampling forwards at static shapes (CUDA graphs need a GPU)"))
        logger.info("rollout engine (%s, %s precision flow): %s; kernels: %s%s", precision, precision_flow,
                    self.execution_path, self.kernel_path,
                    "; ℓ_old is ℓ_rollout wherever both are the same forward (no old-log-prob pass)"
                    if self.shares_trainer_model else "")

    @staticmethod
    def _split_copy(trainer_model: nn.Module, precision: str, dtype: torch.dtype | None) -> nn.Module:
        """The split engine's own model: a copy of the trainer's, adapters merged, gradients off, in `dtype`."""
        # The copy drops the LoRA layers without merging them: the merged weights are loaded below by the
        # code `sync_from` uses, so a fresh engine and a synced one agree bit for bit.
        model = _without_adapters(copy.deepcopy(adapter_host(trainer_model)))
        model.eval()
        for param in model.parameters():
            param.requires_grad_(False)
            param.grad = None
        if dtype is not None:
            model.to(dtype)
        load_merged_weights_(model, trainer_model)
        return model

    @property
    def shares_trainer_model(self) -> bool:
        """Whether the engine is the trainer's own model (the unified precision flow): a forward of the engine and
        one of the trainer on the same input compute the same numbers."""
        return self.precision_flow == "unified"

    def sync_from(self, trainer_model: nn.Module) -> float:
        """Bring the engine to the trainer's current weights; return the seconds it took. Split: copy the
        (LoRA-merged) weights in place. Unified: nothing to copy (a trained weight is requantized by its next
        forward); the shared model is put in eval mode for sampling."""
        start = time.perf_counter()
        if self.shares_trainer_model:
            self.model.eval()
            return time.perf_counter() - start
        load_merged_weights_(self.model, trainer_model)
        if any(param.is_cuda for param in self.model.parameters()):
            torch.cuda.synchronize()
        return time.perf_counter() - start


def quantize_trainer_model_(trainer_model: nn.Module, precision: str) -> list[str]:
    """Make the trainer's model compute the rollout engine's numerics at `precision` (the unified precision flow):
    every linear layer the split engine would quantize (`quantize_model_`'s rule, the LM head kept) — the base layer
    of a LoRA-wrapped one included — becomes a `StraightThroughQuantizedLinear`; return their names in the plain
    model. Works through the trainer's wrappers (`adapter_host`)."""
    host = adapter_host(trainer_model)
    return straight_through_linears_(_plain_linears(host, ""), precision, skip=lm_head_skip_rule(host))


def _plain_linears(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(name in the plain model, holder, attribute, layer) of every module below `module` that is a layer of the plain
    model: a LoRA layer's base layer is held by the LoRA layer as `base_layer`; adapters' own layers are left out."""
    for attribute, child in module.named_children():
        name = f"{prefix}{attribute}"
        plain, lora_layer = _plain_module(child, name)
        if isinstance(child, ModulesToSaveWrapper):
            raise NotImplementedError(f"the unified precision flow does not take peft's modules_to_save ({name}): "
                                      "train it as a LoRA target, or use rollout.precision_flow=split")
        holder, attribute = (child, "base_layer") if lora_layer is not None else (module, attribute)
        yield name, holder, attribute, plain
        if lora_layer is None:
            yield from _plain_linears(plain, name + ".")


def adapter_host(trainer_model: nn.Module) -> nn.Module:
    """The transformers model inside the trainer's wrappers (DDP / DataParallel / DeepSpeed / torch.compile, then
    peft's PeftModel or LoraModel); its LoRA-wrapped layers, if any, are still in place.
    """
    model = extract_model_from_parallel(trainer_model, keep_torch_compile=False)
    if isinstance(model, PeftModel):
        return model.get_base_model()
    return model.model if isinstance(model, BaseTuner) else model


def lm_head_skip_rule(model: nn.Module) -> SkipRule:
    """A `skip(name, module)` rule for quantize_model_ that keeps the LM head in high precision: the module
    `get_output_embeddings()` returns, and any module named like an LM head (LM_HEAD_NAMES).
    """
    output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def is_lm_head(name: str, module: nn.Module) -> bool:
        return module is output_embeddings or any(name == head or name.endswith("." + head) for head in LM_HEAD_NAMES)

    return is_lm_head


class _ParameterSource(NamedTuple):
    """One parameter of the engine's plain model, as stored in the trainer's model.

    `parameter` is the trainer's tensor (for a LoRA-wrapped layer its base-layer tensor); `lora_layer` is
    set for the weight of a LoRA-wrapped layer (or a parameter peft's ParamWrapper adapts), whose active adapters add
    their ΔW.
    """

    name: str
    parameter: Tensor
    lora_layer: LoraLayer | None

    @torch.no_grad()
    def merged(self) -> Tensor:
        """W + Σ_adapters ΔW_adapter, each sum rounded to W's dtype as peft's merge does; W for other parameters."""
        value = self.parameter.detach()
        if self.lora_layer is not None:
            for adapter in _adapters_to_merge(self.lora_layer):
                value = (value + self.lora_layer.get_delta_weight(adapter)).to(self.parameter.dtype)
        # FSDP2 shards parameters as DTensors: every rank's engine holds the full weight.
        return value.full_tensor() if isinstance(value, DTensor) else value


def merged_state_items(trainer_model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, tensor) for every parameter of the trainer's model with LoRA merged in, under the names of
    the plain model: `base_model.model.<name>.base_layer.weight` of a peft model becomes `<name>.weight` with
    value W + ΔW of its active, unmerged adapters (none when adapters are disabled); LoRA matrices are left out;
    a `modules_to_save` copy replaces its original. Tied parameters appear once. Values are computed lazily,
    one at a time, and share storage with the trainer where no merging is needed (do not modify them).
    """
    for source in _parameter_sources(trainer_model):
        yield source.name, source.merged()


@torch.no_grad()
def load_merged_weights_(engine_model: nn.Module, trainer_model: nn.Module) -> None:
    """Copy `merged_state_items(trainer_model)` into the parameters of `engine_model` in place (FP8 ones requantized).

    Raises ValueError, before copying anything, if the two models' parameter names or shapes differ.
    """
    engine_params = dict(engine_model.named_parameters())
    sources = list(_parameter_sources(trainer_model))
    _check_same_parameters(engine_params, sources)
    for source in sources:
        requantize_(engine_params[source.name], source.merged())


def _parameter_sources(trainer_model: nn.Module) -> Iterator[_ParameterSource]:
    yield from _module_parameter_sources(adapter_host(trainer_model), prefix="", seen=set())


def _module_parameter_sources(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[_ParameterSource]:
    module, lora_layer = _plain_module(module, prefix.rstrip("."))
    adapted = _adapted_parameters(lora_layer)
    for name, param in module.named_parameters(recurse=False):
        if id(param) in seen:  # tied weights: listed once, like nn.Module.named_parameters()
            continue
        seen.add(id(param))
        yield _ParameterSource(prefix + name, param, adapted.get(name))
    for name, child in module.named_children():
        yield from _module_parameter_sources(child, f"{prefix}{name}.", seen)


def _adapted_parameters(lora_layer: LoraLayer | None) -> dict[str, LoraLayer]:
    """The base layer's parameters `lora_layer` adapts, each with the LoRA layer whose ΔW it gets: ``weight`` for a
    LoRA module; each targeted parameter's own wrapper for peft's ParamWrapper (``target_parameters``: nested, one
    wrapper per parameter, e.g. a stack of experts' gate_up_proj and down_proj)."""
    adapted, layer = {}, lora_layer
    while isinstance(layer, ParamWrapper):
        adapted[layer.parameter_name] = layer
        layer = layer.base_layer
    return adapted if adapted or lora_layer is None else {"weight": lora_layer}


def _without_adapters(module: nn.Module, name: str = "") -> nn.Module:
    """`module` with every LoRA layer replaced by its (unmerged) base layer and every modules_to_save wrapper by the
    module it runs, recursively; edits `module` in place.
    """
    module, _ = _plain_module(module, name)
    for child_name, child in list(module.named_children()):
        setattr(module, child_name, _without_adapters(child, f"{name}.{child_name}".lstrip(".")))
    return module


def _plain_module(module: nn.Module, name: str) -> tuple[nn.Module, LoraLayer | None]:
    """The module of the plain model that `module` (named `name`) stands for, and the LoRA layer wrapping it if any.

    A LoRA layer stands for its base layer, a peft modules_to_save wrapper for the module it runs; other peft
    adapter types are rejected.
    """
    if isinstance(module, LoraLayer):
        return module.get_base_layer(), module
    if isinstance(module, ModulesToSaveWrapper):
        return _module_in_effect(module), None
    if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
        raise NotImplementedError(
            f"RolloutEngine merges LoRA adapters and modules_to_save only; {name or 'the model'} is a "
            f"{type(module).__name__}. Merge that adapter into the model (merge_and_unload) or train with LoRA."
        )
    return module, None


def _module_in_effect(wrapper: ModulesToSaveWrapper) -> nn.Module:
    """The module a peft `modules_to_save` wrapper runs: the active adapter's trained copy, else the original."""
    adapter = None if wrapper.disable_adapters or not wrapper.active_adapters else wrapper.active_adapters[0]
    return wrapper.modules_to_save[adapter] if adapter in wrapper.modules_to_save else wrapper.original_module


def _adapters_to_merge(layer: LoraLayer) -> list[str]:
    """The active adapters of `layer` whose ΔW is not yet in its base weight (none when adapters are disabled)."""
    if layer.disable_adapters:
        return []
    adapters = [
        adapter for adapter in layer.active_adapters
        if adapter not in layer.merged_adapters and (adapter in layer.lora_A or adapter in layer.lora_embedding_A)
    ]
    unsupported = [adapter for adapter in adapters if adapter in layer.lora_variant or layer.lora_bias.get(adapter)]
    if unsupported:
        raise NotImplementedError(
            f"RolloutEngine merges plain LoRA (W + B·A·scaling); adapter(s) {unsupported} use a LoRA variant "
            f"(e.g. DoRA) or lora_bias. Train without them, or merge the adapter (merge_and_unload) before building "
            f"the engine."
        )
    return adapters


def _check_same_parameters(engine_params: dict[str, Tensor], sources: list[_ParameterSource]) -> None:
    trainer_shapes = {source.name: tuple(source.parameter.shape) for source in sources}
    engine_shapes = {name: tuple(param.shape) for name, param in engine_params.items()}
    problems = []
    missing = sorted(engine_shapes.keys() - trainer_shapes.keys())
    if missing:
        problems.append(f"{len(missing)} engine parameter(s) absent from the trainer, e.g. {missing[:3]}")
    unexpected = sorted(trainer_shapes.keys() - engine_shapes.keys())
    if unexpected:
        problems.append(f"{len(unexpected)} trainer parameter(s) absent from the engine, e.g. {unexpected[:3]}")
    mismatched = [
        f"{name}: trainer {trainer_shapes[name]} vs engine {engine_shapes[name]}"
        for name in sorted(trainer_shapes.keys() & engine_shapes.keys())
        if trainer_shapes[name] != engine_shapes[name]
    ]
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es), e.g. {mismatched[:3]}")
    if problems:
        raise ValueError(
            "The trainer's model does not match the rollout engine's: " + "; ".join(problems)
            + ". Sync the engine only from the model (same architecture and config) it was built from."
        )

"""Loading a checkpoint's files from the bytes read once and verified (`dllm_ais.run_dir.read_verified`), with safe
loaders only: safetensors for the weights, `torch.load(weights_only=True)` for the rest (for DeepSpeed ZeRO-2's
engine files with three DeepSpeed data classes allowed); a pickle holding code is refused in one line naming the
file. `dllm_ais.checkpoint.Checkpointer.resume` puts the loaded state back in place.
"""

from __future__ import annotations

import io
import pickle
import random
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from accelerate.utils import gather_object
from peft import PeftModel

from dllm_ais.config import ConfigError

PICKLED_WEIGHTS = re.compile(r"(adapter_model|pytorch_model|model).*\.(bin|pt|pth|pkl)")


def numpy_array_globals() -> list[Any]:
    """The numpy constructors an RNG state's array needs under `weights_only` (data only: no callable beyond
    rebuilding an array of a dtype)."""
    multiarray = getattr(np, "_core", None) or np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def deepspeed_optimizer_globals() -> list[Any]:
    """The DeepSpeed classes a ZeRO-2 optimizer partition (`zero_pp_rank_R_mp_rank_00_optim_states.pt`) holds
    besides tensors and plain values, each rebuilt from data only: its loss scaler's settings, the ZeRO stage and
    each parameter's offset in the flat partition."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_data(path: Path, data: bytes, numpy_arrays: bool = False, deepspeed_optimizer: bool = False) -> Any:
    """`torch.load(weights_only=True)` of the verified bytes `data` of `path` (with numpy arrays allowed when
    `numpy_arrays`, DeepSpeed's optimizer classes when `deepspeed_optimizer`); a pickle naming anything else, or
    bytes that do not load, is one ConfigError naming the file."""
    allowed = (numpy_array_globals() if numpy_arrays else []) + (deepspeed_optimizer_globals() if deepspeed_optimizer
                                                                 else [])
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        named = re.search(r"GLOBAL (\S+)", str(error))
        raise ConfigError(f"{path} holds more than tensors and plain values ({named.group(1) if named else 'code'}); "
                          "refusing to resume from it. Resume from a checkpoint you wrote.") from None
    except Exception as error:  # noqa: BLE001 - any other failure of the bytes to load, in one line
        raise ConfigError(f"{path} does not load ({type(error).__name__}); resume from another checkpoint.") from None


def weights_state(files: dict[str, bytes], directory: Path) -> dict[str, torch.Tensor]:
    """The state dict in a checkpoint's safetensors weights — the adapter's, or every `model*.safetensors` shard —
    from verified bytes; ConfigError naming the file when there are none (pickled weights are never loaded)."""
    from safetensors.torch import load as load_safetensors

    names = (["adapter_model.safetensors"] if "adapter_config.json" in files
             else sorted(n for n in files if re.fullmatch(r"model.*\.safetensors", n)))
    present = [name for name in names if name in files]
    if not present:
        pickled = sorted(n for n in files if PICKLED_WEIGHTS.fullmatch(n))
        found = f"{directory / pickled[0]} is a pickle and is never loaded" if pickled else "it lists none"
        raise ConfigError(f"{directory} holds no safetensors weights ({found}); resume from a checkpoint you wrote.")
    state: dict[str, torch.Tensor] = {}
    for name in present:
        try:
            state.update(load_safetensors(files[name]))
        except Exception as error:  # noqa: BLE001 - bytes that are not safetensors, in one line
            raise ConfigError(f"{directory / name} is not a safetensors file ({type(error).__name__}); resume from "
                              "another checkpoint.") from None
    return state


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Load `state` (see `weights_state`) in place: into a peft model's adapter, or all weights of a plain model.
    Every saved tensor must find its parameter; a parameter may only be missing when it is tied to a loaded one."""
    if isinstance(model, PeftModel):
        from peft import set_peft_model_state_dict

        result, missing = set_peft_model_state_dict(model, state), []
    else:
        result = model.load_state_dict(state, strict=False)
        loaded = {p.data_ptr() for name, p in model.state_dict().items() if name in state}
        missing = [k for k in result.missing_keys if model.state_dict()[k].data_ptr() not in loaded]
    if result.unexpected_keys or missing:
        raise ConfigError(f"{directory} does not match the model: unexpected {result.unexpected_keys[:5]}, "
                          f"missing {missing[:5]}.")


def refused_on_any_process(accelerator, load: Callable[[], Any]) -> Any:
    """`load()` on every process; a ConfigError on any of them (a file only that process reads refused: its RNG
    states, its optimizer partition) is raised on all, in that process' words, so that none goes on alone to wait
    for the others."""
    try:
        result, refusal = load(), None
    except ConfigError as error:
        result, refusal = None, str(error)
    refusals = gather_object([refusal]) if accelerator.num_processes > 1 else [refusal]
    if (first := next((found for found in refusals if found is not None), None)) is not None:
        raise ConfigError(first)
    return result


def restore_random_states(states: Any, path: Path) -> int:
    """Set Python's, numpy's, torch's (and CUDA's, where present) global RNGs to what accelerate's `save_state`
    stored in `path`; returns the accelerator's saved `step`. States that do not apply are one ConfigError."""
    try:
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
        return int(states.get("step", 0))
    except Exception as error:  # noqa: BLE001 - never resume with other random state than the checkpoint's
        raise ConfigError(f"{path}: its random states do not load ({type(error).__name__}: {error!s:.80}); resume "
                          "from another checkpoint.") from None

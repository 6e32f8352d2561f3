"""Loading a policy: its weights, tokenizer and config, and the special token ids its samplers need."""

from __future__ import annotations

import ctypes
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from dllm_ais.config import EMBEDDED_MODELS, ConfigError

END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>")
# glibc's mallopt parameters (malloc.h) and their environment variables.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
HOST_MEMORY_KEPT = 1 << 30


def resolve_model_path(name_or_path: str) -> str:
    """The directory or hub id to load: `embedded`, `embedded-qwen3`, `embedded-dream`, `embedded-llada-chain-sum` and
    `embedded-qwen3-chain-sum` name the tiny models shipped in the package."""
    if name_or_path in EMBEDDED_MODELS:
        directory = EMBEDDED_MODELS[name_or_path]
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"The embedded model is missing from {directory}; rebuild it with "
                                    "`python tools/build_tiny_model.py` (see its --help).")
        return str(directory)
    return name_or_path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


def check_tokenizer_files(name_or_path: str) -> None:
    """Raise FileNotFoundError (one line, naming the directory and the fix) when `name_or_path` is a local model
    directory without tokenizer files — transformers would otherwise suggest installing sentencepiece or tiktoken."""
    path = Path(resolve_model_path(name_or_path))
    if not path.is_dir() or any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return
    raise FileNotFoundError(f"{path} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); copy its "
                            "base model's tokenizer there (tokenizer.save_pretrained(path)) or pass the base model.")


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` = bfloat16 on CUDA, float32 on CPU (CPU matmuls in bf16 are slow and gain nothing here)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def keep_freed_host_memory(device: torch.device | str) -> bool:
    """On a CPU device under glibc: serve every allocation below 1 GiB from the process heap and keep what is freed
    there for the next one (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD); True when set.

    By default glibc maps each large block (activations of tens of MiB) from the system and returns it on free,
    raising that threshold only as frees come (up to 32 MiB): the first forwards of a run pay page faults on every
    allocation (what this saves is measured in docs/notes/long-completion-chain-sums.md). It does what `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` or a preloaded jemalloc / tcmalloc do, and
    steps aside when either variable is set."""
    if torch.device(device).type != "cpu" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in MALLOC_VARIABLES):
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, HOST_MEMORY_KEPT) and libc.mallopt(M_TRIM_THRESHOLD, HOST_MEMORY_KEPT))


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, left-padding (prompts are left padded so completions share one canvas offset)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def refuse_remote_code(path: str) -> None:
    """ConfigError, in one line, when the model directory `path` has a config.json whose `model_type` neither
    transformers nor dllm-ais provides, or that asks for code of its own (`auto_map`) for such a type: its code
    would have to run, and dllm-ais never runs a model directory's code (trust_remote_code stays off)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = json.loads((Path(path) / "config.json").read_bytes()[:1 << 20])
    except (OSError, ValueError):
        return  # no local config (a Hub id) or an unreadable one: transformers reports it
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        asks = " and asks for its own code (auto_map)" if "auto_map" in config else ""
        raise ConfigError(f"{path}: its config.json names model_type {model_type!r:.60}, which neither transformers "
                          f"nor dllm-ais provides{asks}; dllm-ais never runs a model directory's code "
                          "(trust_remote_code). Use a model of a supported architecture.")


def load_model(name_or_path: str, dtype: torch.dtype, trust_remote_code: bool = False,
               is_trainable: bool = False) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained` (safetensors only); LLaDA resolves to dllm_ais' native model.

    A directory holding a peft adapter (as `dllm-ais train` writes) loads as its base model with the adapter on
    (trainable when `is_trainable`, to continue training it). The model keeps `name_or_path` as given — a Hub id or
    `embedded`, not the package's asset path on this machine — so adapters and cards record a portable base.
    """
    path = resolve_model_path(name_or_path)
    if (Path(path) / "adapter_config.json").is_file():
        from peft import PeftConfig, PeftModel

        base = load_model(PeftConfig.from_pretrained(path).base_model_name_or_path, dtype, trust_remote_code)
        return PeftModel.from_pretrained(base, path, is_trainable=is_trainable)
    if not trust_remote_code:
        refuse_remote_code(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 use_safetensors=True)
    model.name_or_path = model.config.name_or_path = name_or_path
    return model


def load_model_config(name_or_path: str, trust_remote_code: bool = False):
    """The model's config; for an adapter directory, its base model's config."""
    path = resolve_model_path(name_or_path)
    if (Path(path) / "adapter_config.json").is_file():
        from peft import PeftConfig

        path = resolve_model_path(PeftConfig.from_pretrained(path).base_model_name_or_path)
    if not trust_remote_code:
        refuse_remote_code(path)
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the samplers need: the diffusion mask (None for causal LMs), completion terminators and padding."""

    mask_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int


def special_tokens(tokenizer: PreTrainedTokenizerBase, model_config, diffusion: bool) -> SpecialTokens:
    """Collect mask / end-of-completion / pad ids from the model config and tokenizer, with errors naming the fix."""
    mask_id = getattr(model_config, "mask_token_id", None)
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
    if diffusion and mask_id is None:
        raise ValueError("No mask token id: set `mask_token_id` in the model's config.json or the tokenizer's "
                         "mask_token (LLaDA-8B uses 126336, <|mdm_mask|>).")
    vocab = tokenizer.get_vocab()
    eos = {tokenizer.eos_token_id} | {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    config_eos = getattr(model_config, "eos_token_id", None)
    eos |= set(config_eos) if isinstance(config_eos, (list, tuple)) else {config_eos}
    eos.discard(None)
    pad_id = tokenizer.pad_token_id
    if diffusion and pad_id == mask_id:
        raise ValueError("The pad token equals the mask token; padding would be denoised. Set a distinct pad token.")
    return SpecialTokens(mask_token_id=mask_id, eos_token_ids=tuple(sorted(eos)), pad_token_id=pad_id)

"""Loading a policy: its weights, tokenizer and config, and the special token ids its samplers need."""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from dllm_ais.config import EMBEDDED_MODELS, ConfigError
from dllm_ais.safe_json import loads_bounded
from dllm_ais.validation import show

END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>")
# glibc's mallopt parameters (malloc.h) and their environment variables.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
HOST_MEMORY_KEPT = 1 << 30
# A model's config.json or tokenizer_config.json: a few KB, a tokenizer's list of added tokens a few MB.
MAX_MODEL_JSON_BYTES, MAX_MODEL_JSON_DEPTH = 64 << 20, 32
REMOTE_CODE_FIX = ("dllm-ais runs no code from a model's files unless your own command line says "
                   "--trust_remote_code=true (lm-eval: --model_args trust_remote_code=true)")


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


def load_tokenizer_as_saved(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of `name_or_path` as its files define it, after `refuse_remote_code`; transformers is told
    `trust_remote_code` explicitly, so it never asks at the terminal."""
    refuse_remote_code(name_or_path, trust_remote_code)
    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, left-padding (prompts are left padded so completions share one canvas offset)."""
    tokenizer = load_tokenizer_as_saved(name_or_path, trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def read_json_object(file: str | Path) -> dict:
    """The JSON object in `file`, a model's own file (bounded in size and nesting); ConfigError, in one line naming
    the file, when it holds anything else: a file that cannot be read cannot be checked either."""
    try:
        value = loads_bounded(Path(file).read_bytes(), MAX_MODEL_JSON_BYTES, MAX_MODEL_JSON_DEPTH)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{file}: not a readable JSON file ({str(error).splitlines()[0]:.120}); restore it from "
                          "the model's source") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{file}: holds a JSON {type(value).__name__}, not an object; restore it from the model's "
                          "source")
    return value


def model_file(name_or_path: str, file_name: str) -> str | None:
    """The local path of the file `file_name` of a model directory or Hub repository (a Hub file is fetched into
    the cache, as from_pretrained would fetch it); None when there is none or it cannot be fetched (from_pretrained
    then reports why)."""
    if os.path.isdir(name_or_path):
        path = Path(name_or_path) / file_name
        return str(path) if path.is_file() else None
    from transformers.utils import cached_file

    try:
        return cached_file(name_or_path, file_name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except (OSError, ValueError):
        return None


def adapter_base(name_or_path: str) -> str | None:
    """The base model the adapter directory `name_or_path` names (its adapter_config.json's
    base_model_name_or_path, as written); None when it holds no adapter."""
    file = Path(resolve_model_path(name_or_path)) / "adapter_config.json"
    if not file.is_file():
        return None
    base = read_json_object(file).get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{file}: base_model_name_or_path names no base model; set it to the base model's Hub id "
                          "or directory")
    return base


def model_sources(name_or_path: str) -> list[str]:
    """The model directories (or Hub ids) that loading `name_or_path` reads: itself and, for an adapter directory,
    the base its adapter_config.json names, in turn (an adapter may sit on another adapter). ConfigError, in one
    line naming the adapter_config.json, when that chain comes back to a directory already in it."""
    sources, seen = [], set()
    source: str | None = resolve_model_path(name_or_path)
    while source is not None:
        identity = os.path.realpath(source) if os.path.isdir(source) else source
        if identity in seen:
            raise ConfigError(f"{Path(sources[-1]) / 'adapter_config.json'}: its base_model_name_or_path leads back "
                              f"to {source}, an adapter cannot be its own base; point it at the base model")
        seen.add(identity)
        sources.append(source)
        base = adapter_base(source)
        source = None if base is None else resolve_model_path(base)
    return sources


def config_code_problem(source: str) -> str | None:
    """Why loading the config.json of `source` would need code from the model's own files (an `auto_map` for a
    model_type, or a causal-LM class of it, that neither transformers nor dllm-ais provides), or name an
    architecture that cannot load at all; None when it needs neither."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    file = model_file(source, "config.json")
    if file is None:
        return None
    config = read_json_object(file)
    model_type, auto_map = config.get("model_type"), config.get("auto_map")
    provided = isinstance(model_type, str) and model_type in CONFIG_MAPPING
    if auto_map and not (provided and CONFIG_MAPPING[model_type] in MODEL_FOR_CAUSAL_LM_MAPPING):
        return (f"{file}: its auto_map {show(auto_map)} asks to run the model's own code (model_type "
                f"{show(model_type)}, which neither transformers nor dllm-ais provides as a causal LM); "
                + REMOTE_CODE_FIX)
    if isinstance(model_type, str) and not provided:
        return (f"{file}: model_type {show(model_type)}, which neither transformers nor dllm-ais provides; use a "
                "model of a supported architecture")
    return None


def tokenizer_code_problem(source: str) -> str | None:
    """Why loading the tokenizer of `source` would need code from the model's own files: an `auto_map` in its
    tokenizer_config.json naming a tokenizer whose `tokenizer_class` transformers does not provide; None otherwise
    (transformers, with trust_remote_code off, then loads its own class)."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    file = model_file(source, "tokenizer_config.json")
    if file is None:
        return None
    tokenizer_config = read_json_object(file)
    auto_map = tokenizer_config.get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    if not entry:
        return None
    name = tokenizer_config.get("tokenizer_class")
    provided = isinstance(name, str) and (tokenizer_class_from_name(name) or tokenizer_class_from_name(name + "Fast"))
    if provided and provided.__module__.startswith("transformers."):
        return None
    return (f"{file}: its auto_map names the model's own tokenizer code ({show(entry)}) for tokenizer_class "
            f"{show(name)}, which transformers does not provide; " + REMOTE_CODE_FIX)


def refuse_remote_code(name_or_path: str, trust_remote_code: bool = False) -> None:
    """ConfigError, in one line naming the file and the fix, when loading `name_or_path` (for an adapter directory:
    with each base model it names) would run code from the model's own files (`config_code_problem`,
    `tokenizer_code_problem`), or its adapters name each other as base (`model_sources`). It reads the files
    itself, before any transformers call that could import such code. `trust_remote_code` comes from the user's own
    command line, never from a file inside a checkpoint (`dllm_ais.inference_commands.checkpoint_settings`)."""
    sources = model_sources(name_or_path)
    if trust_remote_code:
        return
    for source in sources:
        if problem := config_code_problem(source) or tokenizer_code_problem(source):
            raise ConfigError(problem)


def load_model(name_or_path: str, dtype: torch.dtype, trust_remote_code: bool = False,
               is_trainable: bool = False) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained` (safetensors only), after `refuse_remote_code`; LLaDA resolves to
    dllm_ais' native model.

    A directory holding a peft adapter (as `dllm-ais train` writes) loads as its base model with the adapter on
    (trainable when `is_trainable`, to continue training it). The model keeps `name_or_path` as given — a Hub id or
    `embedded`, not the package's asset path on this machine — so adapters and cards record a portable base.
    """
    refuse_remote_code(name_or_path, trust_remote_code)
    return _load_checked_model(name_or_path, dtype, trust_remote_code, is_trainable)


def _load_checked_model(name_or_path: str, dtype: torch.dtype, trust_remote_code: bool,
                        is_trainable: bool) -> torch.nn.Module:
    """`load_model` of a model whose sources `refuse_remote_code` passed."""
    path = resolve_model_path(name_or_path)
    base = adapter_base(path)
    refuse_pickled_weights(path, "adapter_model" if base is not None else "model")
    if base is not None:
        from peft import PeftModel

        return PeftModel.from_pretrained(_load_checked_model(base, dtype, trust_remote_code, False), path,
                                         is_trainable=is_trainable)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 use_safetensors=True)
    model.name_or_path = model.config.name_or_path = name_or_path
    return model


def refuse_pickled_weights(path: str, stem: str) -> None:
    """ConfigError, in one line naming the file and how to convert it, when the local directory `path` holds its
    weights (`stem`: model, or adapter_model for an adapter) only as a pickle (`pytorch_model*.bin`,
    `adapter_model.bin`): only safetensors are loaded, since unpickling can run code."""
    directory = Path(path)
    if not directory.is_dir() or any(directory.glob(f"{stem}*.safetensors*")):
        return
    pickled = sorted(directory.glob("adapter_model.bin" if stem == "adapter_model" else "pytorch_model*.bin"))
    if not pickled:
        return
    file = pickled[0]
    target = file.with_name(file.name.removeprefix("pytorch_")).with_suffix(".safetensors")
    shards = " (likewise every shard, and the index's file names)" if len(pickled) > 1 else ""
    raise ConfigError(f"{file}: pickled weights, never loaded (unpickling can run code); dllm-ais loads safetensors "
                      "only. If you trust the file, convert it: python -c \"import torch, safetensors.torch as st; "
                      f"st.save_file({{k: v.clone() for k, v in torch.load('{file}', weights_only=True).items()}}, "
                      f"'{target}', metadata={{'format': 'pt'}})\"{shards}")


def load_model_config(name_or_path: str, trust_remote_code: bool = False):
    """The model's config (after `refuse_remote_code`); for an adapter directory, its base model's config."""
    refuse_remote_code(name_or_path, trust_remote_code)
    path = model_sources(name_or_path)[-1]
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

"""Loading policies and tokenizers, and writing checkpoints that a crash cannot corrupt."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from dllm_ais.config import (  # noqa: F401  (EMBEDDED_* are re-exported)
    EMBEDDED_MODEL, EMBEDDED_MODEL_DIR, EMBEDDED_MODELS, EMBEDDED_RECIPE, ConfigError, GRPOConfig,
)
from dllm_ais.validation import read_recipe, show

END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>")


def resolve_model_path(name_or_path: str) -> str:
    """The directory or hub id to load: `embedded` / `embedded-qwen3` name the tiny models shipped in the package."""
    if name_or_path in EMBEDDED_MODELS:
        directory = EMBEDDED_MODELS[name_or_path]
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"The embedded model is missing from {directory}; rebuild it with "
                                    "`python scripts/build_tiny_model.py`.")
        return str(directory)
    return name_or_path


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` = bfloat16 on CUDA, float32 on CPU (CPU matmuls in bf16 are slow and gain nothing here)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, left-padding (prompts are left padded so completions share one canvas offset)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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


# ------------------------------------------------------------------------------------------ safe directory writes
MARKER = ".dllm-ais.json"  # provenance file inside every directory dllm-ais writes; its proof of ownership
LEFTOVER_PREFIXES = (".tmp-", ".old-", ".trash-")


class OutputExistsError(FileExistsError):
    """A destination is in the way (not empty, or not written by dllm-ais); the message names the way out."""


def provenance(directory: str | Path) -> dict[str, Any] | None:
    """The marker dllm-ais leaves in each directory it writes; None when absent or unreadable (not provably ours)."""
    try:
        marker = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("written_by") == "dllm-ais" else None


def is_leftover(entry: Path) -> bool:
    """A staging, displaced or half-deleted directory of an interrupted dllm-ais write."""
    return entry.name.startswith(LEFTOVER_PREFIXES) and entry.is_dir() and provenance(entry) is not None


def describe_contents(directory: Path, limit: int = 4) -> str:
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in directory.iterdir() if not is_leftover(e))
    return ", ".join(names[:limit]) + (f", … ({len(names)} entries)" if len(names) > limit else "")


def check_destination(final: Path, overwrite: bool, flag: str = "--overwrite") -> None:
    """Raise OutputExistsError unless `final` may be written: absent, empty, or — with `overwrite` — a directory
    that dllm-ais wrote. Nothing else is ever replaced, so no command can delete what it did not create."""
    if not final.exists() or (final.is_dir() and not any(final.iterdir())):
        return
    if not final.is_dir():
        raise OutputExistsError(f"{final} is a file; choose a directory path that does not exist yet.")
    if not overwrite:
        raise OutputExistsError(f"{final} is not empty (holds {describe_contents(final)}); choose a new directory "
                                f"(e.g. {final / 'NAME'}) or pass {flag} to replace a directory that dllm-ais wrote.")
    marker = provenance(final)
    if marker is None:
        raise OutputExistsError(f"{final} holds files dllm-ais did not write ({describe_contents(final)}); {flag} only "
                                "replaces directories dllm-ais wrote. Choose a new directory or move this one away.")
    if marker.get("run_directory"):
        raise OutputExistsError(f"{final} is the output_dir of a training run (its checkpoints and metrics); {flag} "
                                "never replaces one. Choose a new directory.")


def fsync_directory(path: str | Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to the disk (a rename is only durable after its content is)."""
    for directory, _, files in os.walk(root):
        for name in files:
            descriptor = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        fsync_directory(directory)


def remove_directory(path: Path) -> None:
    """Delete a directory dllm-ais wrote, its marker last: a crash midway leaves a leftover still provably ours."""
    for child in path.iterdir():
        if child.name == MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (path / MARKER).unlink(missing_ok=True)
    path.rmdir()


def discard_directory(path: Path, name: str | None = None) -> None:
    """Delete a directory dllm-ais wrote: first renamed to `.trash-<name>-*`, so it never stays half-deleted under
    a name that a resume or a leftover recovery would trust."""
    trash = path.with_name(f".trash-{name or path.name}-{secrets.token_hex(4)}")
    os.rename(path, trash)
    fsync_directory(path.parent)
    remove_directory(trash)


def _writer_is_running(marker: dict[str, Any]) -> bool:
    pid = marker.get("pid")
    if marker.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(parent: str | Path, name: str | None = None) -> None:
    """Finish what interrupted atomic writes left in `parent` (for directory `name`, or for all): a `.tmp-<name>-*`
    staging directory is deleted unless its writer still runs; `.old-<name>` (a complete previous copy moved aside)
    is renamed back when `<name>` is missing — the crash fell between the two renames — and deleted otherwise;
    `.trash-*` is deleted. Only directories carrying dllm-ais' marker are touched."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        if not is_leftover(entry):
            continue
        prefix, _, rest = entry.name[1:].partition("-")
        target = rest if prefix == "old" else rest.rpartition("-")[0]
        if name is not None and target != name:
            continue
        if prefix == "tmp" and _writer_is_running(provenance(entry)):
            continue
        if prefix == "old" and not (parent / target).exists():
            os.rename(entry, parent / target)
            fsync_directory(parent)
        else:
            remove_directory(entry)


def staging_directory(final: Path, token: str) -> Path:
    """Where `final` is staged: `.tmp-<name>-<token>` beside it (processes writing one checkpoint share `token`)."""
    return final.parent / f".tmp-{final.name}-{token}"


def begin_staging(final: Path, token: str | None = None, **fields: Any) -> Path:
    """Create the staging directory of `final`, marked as dllm-ais' (with `fields`)."""
    staging = staging_directory(final, token or secrets.token_hex(4))
    staging.mkdir(parents=True)
    marker = {"written_by": "dllm-ais", "pid": os.getpid(), "host": socket.gethostname(), **fields}
    (staging / MARKER).write_text(json.dumps(marker))
    return staging


def commit_staging(staging: Path, final: Path, overwrite: bool = False) -> None:
    """Make the finished `staging` directory `final` by renames only, after flushing it to disk.

    `final` may be absent or empty, or (with `overwrite`) a directory dllm-ais wrote: that one is first renamed to
    `.old-<name>` and deleted once the new copy is in place, so a complete copy always exists under one of the names.
    Nothing beside `final` is touched. On failure the staging directory is removed.
    """
    try:
        fsync_tree(staging)
        check_destination(final, overwrite)
        displaced = None
        if final.is_dir() and any(final.iterdir()):
            displaced = final.with_name(f".old-{final.name}")
            os.rename(final, displaced)
        elif final.is_dir():
            final.rmdir()
        os.rename(staging, final)
        fsync_directory(final.parent)
    except BaseException:
        if staging.exists():
            remove_directory(staging)
        raise
    if displaced is not None:
        discard_directory(displaced, final.name)


@contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False, flag: str = "--overwrite") -> Iterator[Path]:
    """Yield a staging directory beside `final`; once the block has written everything, it becomes `final`.

    `final` must be absent or empty unless `overwrite` allows replacing a directory dllm-ais wrote (checked before
    the block runs, so a refused destination costs nothing); `flag` is how the user says "overwrite" in the error.
    A crash leaves `final` as it was plus a leftover that the next write to `final` cleans up.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(final.parent, final.name)
    check_destination(final, overwrite, flag)
    staging = begin_staging(final)
    try:
        yield staging
    except BaseException:
        remove_directory(staging)
        raise
    commit_staging(staging, final, overwrite)


def load_saved_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load, in place, what `save_pretrained` wrote into `directory`: the adapter into a peft model, all weights
    (one file or shards) into a plain model. Every saved tensor must find its parameter; a parameter may only be
    missing from the files when it is tied to one that was loaded."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / "adapter_config.json").is_file():
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        result = set_peft_model_state_dict(model, load_peft_weights(str(directory), device="cpu"))
        missing = []
    else:
        state: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("model*.safetensors")):
            state.update(load_file(file))
        result = model.load_state_dict(state, strict=False)
        loaded = {p.data_ptr() for name, p in model.state_dict().items() if name in state}
        missing = [k for k in result.missing_keys if model.state_dict()[k].data_ptr() not in loaded]
    if result.unexpected_keys or missing:
        raise ValueError(f"{directory} does not match the model: unexpected {result.unexpected_keys[:5]}, "
                         f"missing {missing[:5]}.")


# ------------------------------------------------------------------------------------------ run directories
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
RESUMABLE_CHANGES = frozenset({  # fields a resumed run may change: they do not alter the training trajectory
    "max_steps", "logging_steps", "save_steps", "save_total_limit", "output_dir", "overwrite_output_dir",
    "resume_from_checkpoint", "report_to", "run_name", "dry_run", "max_consecutive_skipped_batches", "eval_steps",
    "log_completions", "num_completions_to_print"})  # not eval_size: the held-out baseline is paired with the end
RUN_OUTPUTS = ("final",)  # directories a run writes besides its checkpoint-N
RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.png", "completions.jsonl", "best_checkpoint.json")


def run_checkpoints(output_dir: str | Path, run_id: str | None = None) -> list[tuple[int, Path]]:
    """The `checkpoint-N` directories dllm-ais wrote in `output_dir` (of run `run_id` if given), oldest step first."""
    output_dir = Path(output_dir)
    found = []
    for entry in output_dir.iterdir() if output_dir.is_dir() else ():
        match = CHECKPOINT_NAME.fullmatch(entry.name)
        marker = provenance(entry) if match and entry.is_dir() else None
        if marker is not None and (run_id is None or marker.get("run") == run_id):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def prune_checkpoints(output_dir: str | Path, run_id: str, keep: int, protect: str | Path | None = None) -> None:
    """`save_total_limit`: delete the oldest checkpoint-N directories this run wrote beyond the newest `keep`, never
    `protect` (the best checkpoint by validation score)."""
    protected = Path(protect).resolve() if protect is not None else None
    for _, path in run_checkpoints(output_dir, run_id)[:-keep]:
        if path.resolve() != protected:
            discard_directory(path)


def resumable(directory: Path) -> bool:
    """A complete training checkpoint: written by dllm-ais, with the trainer state accelerate's save_state wrote."""
    return (provenance(directory) is not None and (directory / "custom_checkpoint_0.pkl").is_file()
            and (directory / "dllm_ais_config.yaml").is_file())


def resume_checkpoint(config: GRPOConfig) -> Path | None:
    """The checkpoint `resume_from_checkpoint` names (true = the latest checkpoint-N in output_dir), checked to be a
    complete dllm-ais checkpoint whose run the current config continues unchanged; None for a fresh run."""
    wanted = config.resume_from_checkpoint
    if wanted is None or wanted is False:
        return None
    if wanted is True:
        complete = [path for _, path in run_checkpoints(config.output_dir) if resumable(path)]
        if not complete:
            raise ConfigError(f"resume_from_checkpoint=true: {config.output_dir} holds no checkpoint-N written by "
                              "dllm-ais. Pass a checkpoint directory, or start a fresh run without it.")
        checkpoint = complete[-1]
    else:
        checkpoint = Path(wanted)
        if not resumable(checkpoint):
            raise ConfigError(f"resume_from_checkpoint={wanted}: not a complete dllm-ais training checkpoint (a "
                              "checkpoint-N directory written by `dllm-ais train`, with its trainer state).")
    saved = read_recipe(checkpoint / "dllm_ais_config.yaml")
    defaults = GRPOConfig().to_dict()
    changed = [f"{name}: {show(saved.get(name, defaults[name]))} -> {show(value)}" for name, value in config.to_dict().items()
               if name not in RESUMABLE_CHANGES and saved.get(name, defaults[name]) != value]
    if changed:
        raise ConfigError(f"Cannot resume from {checkpoint}: these fields change the run (only "
                          f"{', '.join(sorted(RESUMABLE_CHANGES))} may change on resume):\n  - " + "\n  - ".join(changed)
                          + "\nResume with the run's own settings, or start a new run in another output_dir.")
    return checkpoint


def prepare_output_dir(config: GRPOConfig, is_main_process: bool = True) -> Path | None:
    """Check, before anything loads, that this run may write into `output_dir`; return the checkpoint to resume
    from (None for a fresh run).

    A resumed run continues in its own directory. A fresh run needs an empty `output_dir`, or
    `overwrite_output_dir=true`: then the `checkpoint-N/` and `final/` that dllm-ais wrote there are discarded (so a
    later `resume_from_checkpoint=true` can never pick up a stale one) and the run's files (`RUN_FILES`) are
    rewritten — only when the directory itself carries the marker of an earlier run; nothing else in the directory
    is touched. Every process checks; only the main process changes the directory (it first cleans the leftovers of
    interrupted writes, then marks the directory as a run's).
    """
    output_dir = Path(config.output_dir)
    checkpoint = resume_checkpoint(config)
    present = sorted(e for e in output_dir.iterdir() if not is_leftover(e) and e.name != MARKER) \
        if output_dir.is_dir() else []
    continues_here = checkpoint is not None and checkpoint.parent.resolve() == output_dir.resolve()
    if present and not continues_here and not config.overwrite_output_dir:
        replace = "--overwrite_output_dir=true to replace the outputs dllm-ais wrote there"
        ways = (f"--resume_from_checkpoint=true to continue its run, {replace}" if run_checkpoints(output_dir)
                else f"{replace} (it holds no checkpoint-N for --resume_from_checkpoint)")
        raise ConfigError(f"output_dir {output_dir} is not empty (holds {describe_contents(output_dir)}). Pass {ways}, "
                          "or choose another --output_dir.")
    ours = {path for _, path in run_checkpoints(output_dir)} | {output_dir / n for n in RUN_OUTPUTS}
    foreign = [e.name for e in present if (CHECKPOINT_NAME.fullmatch(e.name) or e.name in RUN_OUTPUTS)
               and provenance(e) is None]
    if provenance(output_dir) is None:
        foreign += [e.name for e in present if e.name in RUN_FILES]
    if foreign:
        raise ConfigError(f"output_dir {output_dir} holds {', '.join(foreign)} that dllm-ais did not write; the run "
                          "would replace them. Move them away or choose another --output_dir.")
    if is_main_process:
        clean_leftovers(output_dir)
        if not continues_here:
            for path in sorted(p for p in ours if p.is_dir()):
                discard_directory(path)
        output_dir.mkdir(parents=True, exist_ok=True)
        if provenance(output_dir) is None:
            (output_dir / MARKER).write_text(json.dumps({"written_by": "dllm-ais", "run_directory": True}))
            fsync_directory(output_dir)
    return checkpoint

"""Loading policies and tokenizers, and writing checkpoints that a crash cannot corrupt."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from dllm_ais.config import (  # noqa: F401  (EMBEDDED_* are re-exported)
    EMBEDDED_MODEL, EMBEDDED_MODEL_DIR, EMBEDDED_MODELS, EMBEDDED_RECIPE, ConfigError, GRPOConfig,
)
from dllm_ais.metrics import sync_logs_in
from dllm_ais.run_lock import LOCK_FILE, check_not_in_use, give_up_run_lock, hold_run_lock, holds_run_lock
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
BOOKKEEPING = (MARKER, LOCK_FILE)  # files of dllm-ais' own in a directory, never counted as its contents
MIB = 1024 * 1024
TOKENED_LEFTOVER = re.compile(r"\.(tmp|trash)-.+-[0-9a-f]{8}")  # the names staging_directory / discard_directory give


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
    """A staging, displaced or half-deleted directory of an interrupted dllm-ais write: one carrying the marker, or
    an empty `.tmp-`/`.trash-<name>-<token>` one (a staging directory killed before its marker was written, or a
    deletion killed after its marker went: removing it loses nothing)."""
    if not (entry.name.startswith(LEFTOVER_PREFIXES) and entry.is_dir() and not entry.is_symlink()):
        return False
    return provenance(entry) is not None or (TOKENED_LEFTOVER.fullmatch(entry.name) is not None
                                             and not any(entry.iterdir()))


def describe_contents(directory: Path, limit: int = 4) -> str:
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in directory.iterdir()
                   if not is_leftover(e) and e.name not in BOOKKEEPING)
    return ", ".join(names[:limit]) + (f", … ({len(names)} entries)" if len(names) > limit else "")


def check_destination(final: Path, overwrite: bool, flag: str = "--overwrite") -> None:
    """Raise OutputExistsError unless `final` may be written: absent, empty, or — with `overwrite` — a directory
    that dllm-ais wrote. Nothing else is ever replaced, so no command can delete what it did not create. A directory
    (or the parent of one) that a live run holds is refused whatever `overwrite` says."""
    check_not_in_use(final.parent)
    check_not_in_use(final)
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
    `.trash-*` is deleted. Only directories carrying dllm-ais' marker are touched, and empty ones (an interrupted
    deletion's last step)."""
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
        marker = provenance(entry)
        if marker is None:  # empty: see is_leftover
            entry.rmdir()
        elif prefix == "tmp" and _writer_is_running(marker):
            continue
        elif prefix == "old" and not (parent / target).exists():
            os.rename(entry, parent / target)
            fsync_directory(parent)
        elif prefix == "trash":
            remove_directory(entry)
        else:
            discard_directory(entry, target)


def staging_directory(final: Path, token: str) -> Path:
    """Where `final` is staged: `.tmp-<name>-<token>` beside it (processes writing one checkpoint share `token`)."""
    return final.parent / f".tmp-{final.name}-{token}"


def begin_staging(final: Path, token: str | None = None, **fields: Any) -> Path:
    """Create the staging directory of `final`, marked as dllm-ais' (with `fields`), after checking that the disk
    has room for it (see `check_free_space`)."""
    check_free_space(final)
    staging = staging_directory(final, token or secrets.token_hex(4))
    staging.mkdir(parents=True)
    marker = {"written_by": "dllm-ais", "pid": os.getpid(), "host": socket.gethostname(), **fields}
    (staging / MARKER).write_text(json.dumps(marker))
    return staging


def commit_staging(staging: Path, final: Path, overwrite: bool = False) -> None:
    """Make the finished `staging` directory `final` by renames only, after recording every file's size and hash in
    its marker (`verify_checkpoint` checks them) and flushing it — and the run's open JSONL logs — to disk.

    `final` may be absent or empty, or (with `overwrite`) a directory dllm-ais wrote: that one is first renamed to
    `.old-<name>` and deleted once the new copy is in place, so a complete copy always exists under one of the names.
    Nothing beside `final` is touched. On failure the staging directory is removed.
    """
    try:
        record_manifest(staging)
        fsync_tree(staging)
        sync_logs_in(final.parent)
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
    A crash leaves `final` as it was plus a leftover that the next write to `final` cleans up; an exception removes
    the staging directory (a full disk is reported as `NoSpaceLeft`).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(final.parent, final.name)
    check_destination(final, overwrite, flag)
    with staged_directory(final, overwrite=overwrite) as staging:
        yield staging


@contextmanager
def staged_directory(final: str | Path, token: str | None = None, is_main_process: bool = True,
                     overwrite: bool = True, **fields: Any) -> Iterator[Path]:
    """Yield the staging directory of `final` (see `begin_staging`; `fields` go into its marker); once the block
    has written everything, it becomes `final` (`commit_staging`). The trainer's checkpoints use this with the run's
    `token`, so that every process writes into one staging directory; only the main process creates and commits it.

    Any exception removes the staging directory (it never stays, holding the space); a full disk — ENOSPC, or a
    library's write error while the disk has no room left — is raised as `NoSpaceLeft`, saying how much a
    checkpoint needs.
    """
    final = Path(final)
    staging = begin_staging(final, token, **fields) if is_main_process else staging_directory(final, token)
    try:
        yield staging
    except BaseException as error:
        no_space = no_space_error(error, final)
        if is_main_process and staging.exists():
            remove_directory(staging)
        if no_space is not None:
            raise no_space from error
        raise
    if is_main_process:
        commit_staging(staging, final, overwrite)


# ------------------------------------------------------------------------------------------ integrity and space
class NoSpaceLeft(OSError):
    """The disk has no room for what is being written; the message says where and how much is needed."""

    def __str__(self) -> str:
        return self.strerror


def directory_size(directory: Path) -> int:
    """Bytes of the files under `directory` (0 when it does not exist)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, files in os.walk(directory) for name in files)


def checkpoint_size_estimate(parent: Path) -> int:
    """Bytes the next checkpoint in `parent` needs: the size of the newest checkpoint-N there (0 when none)."""
    newest = run_checkpoints(parent)
    return directory_size(newest[-1][1]) if newest else 0


def no_space_message(where: Path, needed: int, free: int | None = None, at_least: bool = False) -> str:
    free_text = f"{free / MIB:.1f} MB free; " if free is not None else ""
    amount = f"more than {needed / MIB:.1f}" if at_least else f"~{needed / MIB:.1f}"
    return f"no space left on {where} ({free_text}a checkpoint needs {amount} MB)"


def check_free_space(final: Path) -> None:
    """Raise NoSpaceLeft before writing `final` when its disk has less room than the newest checkpoint beside it
    took (plus 10 %): better a clear refusal than a library's error halfway through the write."""
    needed = int(1.1 * checkpoint_size_estimate(final.parent))
    free = shutil.disk_usage(final.parent).free if final.parent.is_dir() else None
    if needed and free is not None and free < needed:
        raise NoSpaceLeft(errno.ENOSPC, no_space_message(final.parent, needed, free))


def no_space_error(error: BaseException, final: Path) -> NoSpaceLeft | None:
    """`error` as NoSpaceLeft when it came from a full disk — ENOSPC or EDQUOT anywhere in its chain, or any write
    error while less than 1 MB is left on `final`'s disk (torch reports a full disk as `RuntimeError: ... unexpected
    pos`) — else None. The size needed is the newest checkpoint's; without one, more than the staging directories
    beside `final` held when the write failed."""
    if isinstance(error, NoSpaceLeft):
        return error
    cause: BaseException | None = error
    full = False
    while cause is not None and not full:
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        cause = cause.__cause__ or cause.__context__
    parent = final.parent
    if not full and isinstance(error, (OSError, RuntimeError)) and parent.is_dir():
        full = shutil.disk_usage(parent).free < MIB
    if not full:
        return None
    needed = checkpoint_size_estimate(parent)
    if needed:
        return NoSpaceLeft(errno.ENOSPC, no_space_message(parent, needed))
    written = sum(directory_size(entry) for entry in parent.glob(".tmp-*") if entry.is_dir())
    return NoSpaceLeft(errno.ENOSPC, no_space_message(parent, written, at_least=True))


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


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(4 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def record_manifest(directory: Path) -> None:
    """Add to `directory`'s marker the size and sha256 of every file in it (its `files`, by relative path)."""
    marker = json.loads((directory / MARKER).read_text())
    marker["files"] = {str(path.relative_to(directory)): {"size": path.stat().st_size, "sha256": file_digest(path)}
                       for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MARKER}
    (directory / MARKER).write_text(json.dumps(marker))


def verify_checkpoint(directory: str | Path) -> str | None:
    """Why `directory` is damaged — a file its marker lists that is missing, of another size or with other bytes
    than when it was written — or None when every file verifies (or the marker predates manifests)."""
    directory = Path(directory)
    files = (provenance(directory) or {}).get("files")
    for name, expected in (files or {}).items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path} is damaged ({size} bytes, {expected['size']} when written)"
        if file_digest(path) != expected["sha256"]:
            return f"{path} is damaged (its bytes changed since it was written)"
    return None


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


def newest_intact_checkpoint(output_dir: str | Path, before: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint-N in `output_dir` (with N < `before` if given) whose files verify, and why
    each newer one was skipped (one line each)."""
    skipped = []
    for step, path in reversed(run_checkpoints(output_dir)):
        if before is not None and step >= before:
            continue
        problem = "incomplete (no trainer state)" if not resumable(path) else verify_checkpoint(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipped {path}: {problem}")
    return None, skipped


def resume_checkpoint(config: GRPOConfig, report_skipped: bool = True) -> Path | None:
    """The checkpoint `resume_from_checkpoint` names (true = the newest checkpoint-N in output_dir that verifies;
    the damaged ones skipped are reported on stderr when `report_skipped`), checked to be a complete, intact
    dllm-ais checkpoint whose run the current config continues unchanged; None for a fresh run."""
    wanted = config.resume_from_checkpoint
    if wanted is None or wanted is False:
        return None
    if wanted is True:
        checkpoint, skipped = newest_intact_checkpoint(config.output_dir)
        if checkpoint is None:
            found = f" ({'; '.join(skipped)})" if skipped else ""
            raise ConfigError(f"resume_from_checkpoint=true: {config.output_dir} holds no intact checkpoint-N written "
                              f"by dllm-ais{found}. Pass a checkpoint directory, or start a fresh run without it.")
        for line in skipped if report_skipped else ():
            print(f"warning: resume_from_checkpoint=true {line}; resuming from {checkpoint}", file=sys.stderr)
    else:
        checkpoint = Path(wanted)
        if not resumable(checkpoint):
            raise ConfigError(f"resume_from_checkpoint={wanted}: not a complete dllm-ais training checkpoint (a "
                              "checkpoint-N directory written by `dllm-ais train`, with its trainer state).")
        if (problem := verify_checkpoint(checkpoint)) is not None:
            match = CHECKPOINT_NAME.fullmatch(checkpoint.name)
            previous = newest_intact_checkpoint(checkpoint.parent, int(match.group(1)))[0] if match else None
            fix = (f"resume from the previous intact checkpoint: --resume_from_checkpoint={previous}"
                   if previous is not None else "no earlier intact checkpoint exists; start a fresh run")
            raise ConfigError(f"resume_from_checkpoint={wanted}: {problem}; {fix}.")
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
    """Take the run directory for this run and check, before anything loads, that it may write there; return the
    checkpoint to resume from (None for a fresh run).

    The main process first takes `output_dir`'s exclusive lock (`dllm_ais.run_lock`), held until the process ends:
    a second run, a resume or an export into a directory a live run holds is refused with the holder's pid and host.
    A refused run gives the lock up and leaves nothing it created behind.

    A resumed run continues in its own directory. A fresh run needs an empty `output_dir`, or
    `overwrite_output_dir=true`: then the `checkpoint-N/` and `final/` that dllm-ais wrote there are discarded (so a
    later `resume_from_checkpoint=true` can never pick up a stale one) and the run's files (`RUN_FILES`) are
    rewritten — only when the directory itself carries the marker of an earlier run; nothing else in the directory
    is touched. Every process checks; only the main process changes the directory (it first cleans the leftovers of
    interrupted writes, then marks the directory as a run's).
    """
    output_dir = Path(config.output_dir)
    if not is_main_process:
        return _check_output_dir(config, is_main_process)
    if holds_run_lock(output_dir):  # an earlier run of this process took it
        return _check_output_dir(config, is_main_process)
    existed = output_dir.is_dir()
    created_lock = hold_run_lock(output_dir)
    try:
        return _check_output_dir(config, is_main_process)
    except BaseException:
        give_up_run_lock(output_dir, created_lock)
        if not existed and output_dir.is_dir() and not any(output_dir.iterdir()):
            output_dir.rmdir()
        raise


def _check_output_dir(config: GRPOConfig, is_main_process: bool) -> Path | None:
    """`prepare_output_dir` once the main process holds the lock."""
    output_dir = Path(config.output_dir)
    checkpoint = resume_checkpoint(config, report_skipped=is_main_process)
    present = sorted(e for e in output_dir.iterdir() if not is_leftover(e) and e.name not in BOOKKEEPING) \
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

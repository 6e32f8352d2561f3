"""What a checkpoint holds and how a run continues from one: the run's state (`RunState`), saving it with the
weights, optimizer, scheduler and RNGs (`Checkpointer.save_checkpoint`), choosing the checkpoint to resume from and
taking the run directory (`prepare_output_dir`), and resuming (`Checkpointer.resume`).

A resume reads every file of the checkpoint once into memory, verifies it against the checkpoint's manifest
(`dllm_ais.run_dir.read_verified`) and loads from those bytes only, with safe loaders: safetensors for the weights,
`torch.load(weights_only=True)` for the rest (for DeepSpeed ZeRO-2's engine files with three DeepSpeed data classes
allowed). Nothing is read again from disk after its check, so a file swapped in the meantime is never loaded, and a
pickle holding code is refused in one line naming the file.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import os
import random
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from accelerate.utils import DistributedType, gather_object, send_to_device
from peft import PeftModel

from dllm_ais.components import StepComponents
from dllm_ais.config import ConfigError, GRPOConfig, changed_settings, save_config
from dllm_ais.evaluation import EvalResult, held_out_record, result_identity
from dllm_ais.grpo import GenerationBatch, any_process
from dllm_ais.interruption import note_set_aside
from dllm_ais.run_dir import (BOOKKEEPING, CHECKPOINT_NAME, MARKER, RUN_OUTPUTS, DamagedCheckpoint,
                              atomic_directory, carries_marker, checkpoint_manifest, clean_leftovers,
                              describe_contents, directory_kind, discard_directory, dllm_ais_record, fsync_tree,
                              is_leftover, link_refusal, provenance, prune_checkpoints, read_verified,
                              run_checkpoints, staged_directory, verify_checkpoint)
from dllm_ais.run_lock import give_up_run_lock, hold_run_lock, holds_run_lock
from dllm_ais.safe_files import copy_regular_file, read_regular_file, sync_directory, write_file
from dllm_ais.safe_json import loads_bounded

RESUMABLE_CHANGES = frozenset({  # fields a resumed run may change: they do not alter the training trajectory
    "max_steps", "logging_steps", "save_steps", "save_total_limit", "output_dir", "overwrite_output_dir",
    "resume_from_checkpoint", "report_to", "run_name", "dry_run", "max_consecutive_skipped_batches", "eval_steps",
    "log_completions", "num_completions_to_print"})  # not eval_size: the held-out baseline is paired with the end
HELD_OUT_FILE = "held_out.json"  # the per-prompt held-out values of a finished run (`write_held_out`)
MAX_HELD_OUT_BYTES, MAX_HELD_OUT_DEPTH = 1 << 30, 4  # it holds a few numbers per held-out prompt
RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.png", "completions.jsonl", "best_checkpoint.json", HELD_OUT_FILE)
BEST_CHECKPOINT_FILE = "best_checkpoint.json"
RUN_STATE_FILE = "custom_checkpoint_0.pkl"  # the name accelerate's register_for_checkpointing gave it
CONFIG_FILE = "dllm_ais_config.yaml"
RESUME_FILES = (RUN_STATE_FILE, CONFIG_FILE)
RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")  # accelerate's save_state writes one per process
PICKLED_WEIGHTS = re.compile(r"(adapter_model|pytorch_model|model).*\.(bin|pt|pth|pkl)")


class NonFiniteError(FloatingPointError):
    """Training stopped: `max_consecutive_skipped_batches` batches in a row were non-finite, or weights to be saved are."""


# ------------------------------------------------------------------------------------------ the run's state
@dataclass
class RunState:
    """What a checkpoint restores besides weights, optimizer, scheduler and the global RNGs: the trainer's counters
    (steps, generation batches, tokens seen), prompt order and cursor, the AIS α EMA, the adaptive rollout
    fidelity's rung and calm-batch count, the skip counters, the best validation score so far (TRL's `best_metric`,
    `best_global_step`, `best_model_checkpoint`), the completion samples not yet logged, the held-out baseline and
    the generation batch in flight on this process. The trainer's attributes of the same names; the samplers' and
    estimators' generators are seeded from `generation_index`."""

    run_id: str
    global_step: int = 0
    generation_index: int = 0
    previous_alpha: float | None = None
    rollout_fidelity_state: dict[str, int] = field(default_factory=lambda: {"level": 0, "calm_batches": 0})
    prompt_order: torch.Tensor | None = None
    prompt_cursor: int = 0
    batch_iteration: int = 0
    skipped_batches: int = 0
    consecutive_skipped_batches: int = 0
    num_input_tokens_seen: int = 0
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    completion_samples: list[dict[str, Any]] | None = None
    batch: GenerationBatch | None = None
    eval_before: EvalResult | None = None

    SAVED_APART = ("batch", "eval_before")  # stored as their state dicts (`to_state_dict`)
    ADDED_LATER = {"rollout_fidelity_state": {"level": 0, "calm_batches": 0}}
    """Fields that checkpoints written before them lack, with the value that run had (so they still resume)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names, which are also the trainer's attribute names."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_state_dict(self, batches: list[dict[str, Any] | None]) -> dict[str, Any]:
        """The state as tensors and plain values (what `torch.load(weights_only=True)` reads back), with `batches`,
        the state dicts of every process' generation batch in flight."""
        plain = {name: getattr(self, name) for name in self.names() if name not in self.SAVED_APART}
        return {**plain, "batches": batches,
                "eval_before": None if self.eval_before is None else self.eval_before.state_dict()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], process_index: int, device: torch.device | str) -> "RunState":
        """The state `to_state_dict` wrote, with process `process_index`'s generation batch on `device`; a field
        written before it existed takes its `ADDED_LATER` value, any other missing field is a KeyError."""
        values = {}
        for name in cls.names():
            if name not in cls.SAVED_APART:
                values[name] = state[name] if name in state or name not in cls.ADDED_LATER else cls.ADDED_LATER[name]
        batch, eval_before = state["batches"][process_index], state["eval_before"]
        return cls(**values, batch=None if batch is None else GenerationBatch.from_state_dict(batch, device),
                   eval_before=None if eval_before is None else EvalResult.from_state_dict(eval_before))


# ------------------------------------------------------------------------------------------ safe loading from bytes
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


# ------------------------------------------------------------------------------------------ choosing a checkpoint
def checkpoint_problem(directory: Path) -> str | None:
    """Why `directory` cannot be resumed — its marker or a file damaged (`verify_checkpoint`), or the manifest
    missing the trainer state or the config — or None."""
    if (problem := verify_checkpoint(directory)) is not None:
        return problem
    missing = [name for name in RESUME_FILES if name not in checkpoint_manifest(directory)]
    return f"incomplete (no {', '.join(missing)})" if missing else None


def newest_intact_checkpoint(output_dir: str | Path, before: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint-N in `output_dir` (with N < `before` if given) whose marker and files verify,
    and why each newer one was skipped (one line each)."""
    skipped = []
    for step, path in reversed(run_checkpoints(output_dir)):
        if before is not None and step >= before:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipped {path}: {problem}")
    return None, skipped


START_AFRESH = ("start afresh: drop --resume_from_checkpoint and pass --overwrite_output_dir=true (replaces what "
                "dllm-ais wrote in output_dir), or choose another --output_dir")  # what `_check_output_dir` accepts


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
                              f"by dllm-ais{found}. Pass a checkpoint directory, or {START_AFRESH}.")
        for line in skipped if report_skipped else ():
            print(f"warning: resume_from_checkpoint=true {line}; resuming from {checkpoint}", file=sys.stderr)
    else:
        checkpoint = Path(wanted)
        if not carries_marker(checkpoint):
            raise ConfigError(f"resume_from_checkpoint={wanted}: not a dllm-ais training checkpoint (a "
                              "checkpoint-N directory written by `dllm-ais train`, with its trainer state).")
        if (problem := checkpoint_problem(checkpoint)) is not None:
            match = CHECKPOINT_NAME.fullmatch(checkpoint.name)
            previous = newest_intact_checkpoint(checkpoint.parent, int(match.group(1)))[0] if match else None
            fix = (f"resume from the previous intact checkpoint: --resume_from_checkpoint={previous}"
                   if previous is not None else f"no earlier intact checkpoint exists; {START_AFRESH}")
            raise ConfigError(f"resume_from_checkpoint={wanted}: {problem}; {fix}.")
    changed = changed_settings(checkpoint / CONFIG_FILE, config, RESUMABLE_CHANGES)
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

    A resumed run continues in its own directory; the later steps of a branch of its history that it leaves are set
    aside, kept (`set_abandoned_steps_aside`). A fresh run needs an empty `output_dir`, or
    `overwrite_output_dir=true`: then the `checkpoint-N/` and `final/` that dllm-ais wrote there are discarded (so a
    later `resume_from_checkpoint=true` can never pick up a stale one) and the run's files (`RUN_FILES`) are
    rewritten — only when the directory itself carries the marker of an earlier run; nothing else in the directory
    is touched. Every process checks; only the main process changes the directory (it first cleans the leftovers of
    interrupted writes, then marks the directory as a run's).

    An `output_dir` that is itself a symbolic link (a run folder kept on another disk) is followed once, here: the
    run writes to its target, named in one line (`follow_output_dir_link`). Links inside the run are refused.
    """
    output_dir = follow_output_dir_link(config, report=is_main_process)
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


def follow_output_dir_link(config: GRPOConfig, report: bool = True) -> Path:
    """`config.output_dir`, resolved once when it is a symbolic link — the run then writes to the link's target,
    and `config.output_dir` names that target from here on (one line on stderr says so when `report`); as given
    otherwise. ConfigError when the link does not resolve (a loop)."""
    named = Path(config.output_dir)
    if not named.is_symlink():
        return named
    try:
        target = named.resolve(strict=False)
    except (OSError, RuntimeError) as error:
        raise ConfigError(f"output_dir {named} is a link that does not resolve ({error}); point it at a directory, "
                          "or choose another --output_dir.") from None
    if report:
        print(f"output_dir {named} is a link: writing to its target {target}", file=sys.stderr)
    config.output_dir = str(target)
    return target


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
    linked = [e for e in present if e.is_symlink() and (CHECKPOINT_NAME.fullmatch(e.name) or e.name in RUN_OUTPUTS)]
    if linked:
        raise ConfigError(link_refusal(linked[0]))
    foreign = [e.name for e in present if (CHECKPOINT_NAME.fullmatch(e.name) and (
                   not carries_marker(e) or directory_kind(e) not in (None, "checkpoint")))
               or (e.name in RUN_OUTPUTS and directory_kind(e) != "final")]
    if provenance(output_dir) is None:
        foreign += [e.name for e in present if e.name in RUN_FILES]
    odd = [e.name for e in present if e.name in RUN_FILES and (e.is_symlink() or not e.is_file())]
    if odd:
        raise ConfigError(f"output_dir {output_dir} holds {', '.join(odd)} that is not a regular file (a directory or "
                          "a link) where the run writes that file. Move it away or choose another --output_dir.")
    if foreign:
        raise ConfigError(f"output_dir {output_dir} holds {', '.join(foreign)} that dllm-ais did not write; the run "
                          "would replace them. Move them away or choose another --output_dir.")
    if is_main_process:
        clean_leftovers(output_dir)
        if not continues_here:
            for path in sorted(p for p in ours if p.is_dir()):
                discard_directory(path)
            (output_dir / HELD_OUT_FILE).unlink(missing_ok=True)  # the replaced run's mark of having finished
        else:
            set_abandoned_steps_aside(output_dir, checkpoint)
        output_dir.mkdir(parents=True, exist_ok=True)
        if provenance(output_dir) is None:
            write_file(output_dir / MARKER, json.dumps({"written_by": "dllm-ais", "run_directory": True}))
    return checkpoint


def checkpoint_step(checkpoint: Path) -> int | None:
    """The step of a checkpoint directory: N of its `checkpoint-N` name, else the step its marker records."""
    match = CHECKPOINT_NAME.fullmatch(checkpoint.name)
    step = int(match.group(1)) if match else (provenance(checkpoint) or {}).get("step")
    return step if isinstance(step, int) else None


def set_abandoned_steps_aside(output_dir: Path, checkpoint: Path) -> Path | None:
    """Before a run continues in `output_dir` from `checkpoint` (step N): when checkpoints of later steps are there
    (resumed from an earlier checkpoint, or newer ones skipped as damaged), those steps are a branch of the run's
    history that this resume leaves: it is kept, never deleted and never resumed from here. Its checkpoint-M
    (M > N), its final/ (when written after step N) and held_out.json are moved, and the run's other files
    (metrics.jsonl, completions.jsonl, ...) copied as they are, into `abandoned-after-step-N-<time>/`, named in one
    line on stderr; the run's logs then continue from step N. Returns that directory (None when nothing is later:
    a resume from the newest checkpoint only redoes the steps after it that no checkpoint saved)."""
    step = checkpoint_step(checkpoint)
    moved = [path for number, path in run_checkpoints(output_dir) if step is not None and number > step]
    if not moved:
        return None
    for name in RUN_OUTPUTS:
        written_at = (provenance(output_dir / name) or {}).get("step")  # none recorded: written by an older version
        if (output_dir / name).is_dir() and (not isinstance(written_at, int) or written_at > step):
            moved.append(output_dir / name)
    if (output_dir / HELD_OUT_FILE).is_file():
        moved.append(output_dir / HELD_OUT_FILE)  # the mark of the finished branch
    aside = output_dir / f"abandoned-after-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    aside.mkdir()
    note_set_aside(output_dir, aside)
    for name in RUN_FILES:
        path = output_dir / name
        if name != HELD_OUT_FILE and path.is_file() and not path.is_symlink():
            copy_regular_file(path, aside / name)
    for path in moved:
        os.rename(path, aside / path.name)
    fsync_tree(aside)
    sync_directory(output_dir)
    print(f"warning: resuming from {checkpoint} leaves the later steps of this run behind: "
          f"{', '.join(path.name for path in moved)} and the run's logs are kept in {aside} (never resumed from "
          "here; resume from one of them into another --output_dir to go on with that branch)", file=sys.stderr)
    return aside


# ------------------------------------------------------------------------------------------ saving and resuming a run
def write_held_out(config: GRPOConfig, held_out, before: EvalResult | None, after: EvalResult) -> Path:
    """Write `held_out.json` into a finished run's `output_dir`: `held_out_record` — what made the result (`config`
    and the `held_out` prompts, `result_identity`) and the per-prompt values of its final held-out evaluation
    (`after`) and baseline (`before`). Written last, in one rename: its presence marks a finished run, and `dllm-ais
    compare` reuses the run when its identity is the planned one, pairing runs prompt by prompt through it."""
    path = Path(config.output_dir) / HELD_OUT_FILE
    write_file(path, json.dumps(held_out_record(result_identity(config, held_out), before, after)) + "\n")
    return path


def read_held_out(output_dir: str | Path) -> Any:
    """The parsed `held_out.json` of a finished run (see `write_held_out`), read through no link and bounded in size
    and nesting; None when the run has not finished. OSError when it is not a regular file (FileTooLarge when over
    `MAX_HELD_OUT_BYTES`), ValueError when it is not JSON."""
    path = Path(output_dir) / HELD_OUT_FILE
    if not os.path.lexists(path):
        return None
    return loads_bounded(read_regular_file(path, MAX_HELD_OUT_BYTES), MAX_HELD_OUT_BYTES, MAX_HELD_OUT_DEPTH)


class Checkpointer:
    """Saving and resuming one training run in `config.output_dir`: the model directory (`save_model`), resumable
    `checkpoint-N` directories (`save_checkpoint`, `resume`) and the best-score record (`write_best_record`).

    Saving uses accelerate's `save_state` for the optimizer, scheduler and RNGs (its hook leaves the weights to
    save_pretrained's files) and writes the run's `RunState` itself; resuming reads nothing through accelerate or
    DeepSpeed's engine."""

    def __init__(self, config: GRPOConfig, parts: StepComponents, tokenizer):
        self.config, self.parts, self.tokenizer = config, parts, tokenizer
        self.output_dir = Path(config.output_dir)
        self.last_checkpoint: tuple[int, Path] | None = None
        parts.accelerator.register_save_state_pre_hook(self._leave_weights_to_save_pretrained)

    def checkpoint_directory(self, step: int) -> Path:
        """Where the checkpoint of `step` is written."""
        return self.output_dir / f"checkpoint-{step}"

    def write_best_record(self, state: RunState) -> None:
        """`output_dir/best_checkpoint.json`: the best validation score so far, its step, and the directory holding
        the weights of that step (a checkpoint-N, final/ when the last step scored best, or null when that step was
        not saved). Written atomically; without a score yet, a record an earlier run left there is removed."""
        path = self.output_dir / BEST_CHECKPOINT_FILE
        if state.best_global_step is None:
            if dllm_ais_record(path) is not None:
                path.unlink()
            return
        record = {"written_by": "dllm-ais", "run": state.run_id, "metric_for_best_model": self.config.best_metric_key,
                  "greater_is_better": self.config.greater_is_better, "best_metric": state.best_metric,
                  "best_global_step": state.best_global_step, "best_model_checkpoint": state.best_model_checkpoint}
        write_file(path, json.dumps(record, indent=2) + "\n")

    def checked_state_dict(self, step: int) -> dict[str, torch.Tensor]:
        """The model's state dict to save (a collective under FSDP / ZeRO-3: every process calls this); raises
        NonFiniteError when a trainable weight is NaN or inf, so nothing non-finite is ever written."""
        accelerator = self.parts.accelerator
        accelerator.wait_for_everyone()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.parts.trainable_parameters]
        if any_process(accelerator, not all(torch.isfinite(p).all() for p in local))[0]:
            raise NonFiniteError(f"refusing to save non-finite weights at step {step}; the last checkpoint holds "
                                 "finite ones.")
        return accelerator.get_state_dict(self.parts.model)

    def write_model(self, directory: Path, state_dict: dict[str, torch.Tensor]) -> None:
        """The adapter (or full model) via save_pretrained, the tokenizer and the config: a directory that
        `dllm-ais eval --model`, `generate` and `export` load."""
        model = self.parts.unwrapped_model
        # The vocabulary is never resized here; peft's "auto" would look the base model up on the Hub to check.
        peft_only = {"save_embedding_layers": False} if isinstance(model, PeftModel) else {}
        model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True, **peft_only)
        self.tokenizer.save_pretrained(directory)
        save_config(self.config, directory / CONFIG_FILE)

    def save_model(self, directory: Path, step: int) -> None:
        """Write the model directory (see `write_model`) of `step` atomically into `directory`."""
        state_dict = self.checked_state_dict(step)
        if self.parts.accelerator.is_main_process:
            with atomic_directory(directory, overwrite=True, kind="final", step=step) as staging:
                self.write_model(staging, state_dict)

    def save_checkpoint(self, state: RunState, validation: dict[str, float] | None = None) -> Path:
        """Write `checkpoint_directory(state.global_step)` atomically: the model directory, accelerate's
        `save_state` (optimizer, scheduler, every process' RNGs) and `state` (with every process' generation batch),
        from which `resume` continues the run exactly; then keep only the newest `save_total_limit` checkpoints of
        this run (and the best one). The directory's marker records the step's `validation` scores when scored."""
        accelerator, step = self.parts.accelerator, state.global_step
        directory = self.checkpoint_directory(step)
        if self.saved_now(step):
            return directory
        state_dict = self.checked_state_dict(step)
        batches = [None if state.batch is None else send_to_device(state.batch.state_dict(), "cpu")]
        if accelerator.num_processes > 1:
            batches = gather_object(batches)
        with staged_directory(directory, state.run_id[:8], accelerator.is_main_process, overwrite=True,
                              kind="checkpoint", run=state.run_id, step=step, validation=validation) as staging:
            if accelerator.is_main_process:
                self.write_model(staging, state_dict)
            accelerator.wait_for_everyone()
            accelerator.save_state(str(staging))
            if accelerator.is_main_process:
                torch.save(state.to_state_dict(batches), staging / RUN_STATE_FILE)
            accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if self.config.save_total_limit:
                prune_checkpoints(self.output_dir, state.run_id, self.config.save_total_limit,
                                  protect=state.best_model_checkpoint)
            self.write_best_record(state)
        accelerator.wait_for_everyone()
        self.last_checkpoint = (step, directory)
        return directory

    def saved_now(self, step: int) -> bool:
        """Whether a checkpoint of `step` exists."""
        return self.last_checkpoint is not None and self.last_checkpoint[0] == step

    def resume(self, checkpoint: Path, num_prompts: int) -> RunState:
        """Restore what `save_checkpoint` wrote — weights, optimizer, scheduler, this process' RNGs — and return
        the run's state; the run must have `num_prompts` training prompts, as the checkpoint's did. Every file is
        read once and verified (`read_verified`), then loaded from those bytes (`load_data`, `weights_state`)."""
        accelerator = self.parts.accelerator
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        try:
            files = read_verified(checkpoint)
        except DamagedCheckpoint as damage:
            raise ConfigError(f"Cannot resume from {checkpoint}: {damage}.") from None
        written_by = sum(1 for name in files if RANDOM_STATES.fullmatch(name))
        if written_by != accelerator.num_processes:
            raise ConfigError(f"Cannot resume from {checkpoint}: it was written by {written_by} process(es), this run "
                              f"has {accelerator.num_processes}; launch it with --num_processes {written_by}.")
        states = ("scheduler.bin",) if deepspeed else ("optimizer.bin", "scheduler.bin")  # DeepSpeed's: in its files
        missing = [name for name in (*states, RUN_STATE_FILE) if name not in files]
        if missing:
            raise ConfigError(f"Cannot resume from {checkpoint}: it holds no {', '.join(missing)}; resume from a "
                              "complete checkpoint.")
        loaded = {name: load_data(checkpoint / name, files[name]) for name in states}
        rng_file = f"random_states_{accelerator.process_index}.pkl"
        rng, engine_state = refused_on_any_process(accelerator, lambda: (  # the files only this process reads
            load_data(checkpoint / rng_file, files[rng_file], numpy_arrays=True),
            self._deepspeed_engine_state(checkpoint, files) if deepspeed else None))
        saved_state = load_data(checkpoint / RUN_STATE_FILE, files[RUN_STATE_FILE])
        try:
            state = RunState.from_state_dict(saved_state, accelerator.process_index, accelerator.device)
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise ConfigError(f"{checkpoint / RUN_STATE_FILE} is not a run state dllm-ais wrote ({type(error).__name__}"
                              f": {error!s:.80}); resume from another checkpoint.") from None
        if accelerator.distributed_type == DistributedType.FSDP:
            self._load_sharded(checkpoint, files, loaded["optimizer.bin"])
        else:
            load_weights(self.parts.unwrapped_model, weights_state(files, checkpoint), checkpoint)
            if deepspeed:
                self._load_deepspeed_engine(*engine_state)
            else:
                self.parts.optimizer.load_state_dict(loaded["optimizer.bin"])
        self.parts.scheduler.load_state_dict(loaded["scheduler.bin"])
        accelerator.step = restore_random_states(rng, checkpoint / rng_file)
        trained_on = len(state.prompt_order)
        if trained_on != num_prompts:
            raise ConfigError(f"Cannot resume from {checkpoint}: it was trained on {trained_on} prompts, "
                              f"the dataset now has {num_prompts}.")
        self.last_checkpoint = (state.global_step, checkpoint)
        return state

    def _load_sharded(self, checkpoint: Path, files: dict[str, bytes], optimizer_state: dict[str, Any]) -> None:
        """Under FSDP: the full model state accelerate saved (`pytorch_model_fsdp.bin`) and the full optimizer
        state, from verified bytes, distributed into this process' shards."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        name = "pytorch_model_fsdp.bin"
        if name not in files:
            raise ConfigError(f"Cannot resume from {checkpoint}: it holds no {name} (written by a run without FSDP?); "
                              "resume it with the launch that wrote it.")
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.parts.model, load_data(checkpoint / name, files[name]), options=options)
        set_optimizer_state_dict(self.parts.model, self.parts.optimizer, optimizer_state, options=options)

    def _deepspeed_engine_state(self, checkpoint: Path, files: dict[str, bytes]) -> tuple[list, dict[str, Any]]:
        """Under DeepSpeed ZeRO-2: what its engine's `load_checkpoint` restores besides the weights (loaded from the
        save_pretrained files), from verified bytes: this process' partition of the optimizer (AdamW moments and fp32
        master weights, `zero_pp_rank_R_..._optim_states.pt`, in a list by rank) and the engine's step counters
        (`mp_rank_00_model_states.pt`), both in the directory accelerate's `save_state` has the engine write
        (`pytorch_model/`); `_load_deepspeed_engine` loads them."""
        import torch.distributed as dist
        from accelerate.utils.constants import MODEL_NAME

        engine = self.parts.model
        if engine.zero_optimization_stage() != 2:
            raise ConfigError(f"Cannot resume from {checkpoint} under DeepSpeed ZeRO stage "
                              f"{engine.zero_optimization_stage()}: dllm-ais resumes DeepSpeed runs under ZeRO-2 "
                              "(recipes/accelerate/deepspeed_zero2.yaml); resume it under that config.")

        def engine_file(path: str) -> tuple[Path, bytes]:
            name = Path(path).relative_to(checkpoint).as_posix()
            if name not in files:
                raise ConfigError(f"Cannot resume from {checkpoint}: it holds no {name} (written by another launch "
                                  "than this DeepSpeed config?); resume it with the launch that wrote it.")
            return checkpoint / name, files[name]

        group = engine.optimizer.dp_process_group
        own_rank = dist.get_rank(group=group)
        partitions = [None] * dist.get_world_size(group=group)  # DeepSpeed reads only its own, unless elastic
        for rank in range(len(partitions)):
            if rank == own_rank or engine.zero_elastic_checkpoint():
                path = engine._get_rank_zero_ckpt_name(str(checkpoint), MODEL_NAME, engine.checkpoint_mp_rank, rank,
                                                       engine.bfloat16_enabled())
                partitions[rank] = load_data(*engine_file(path), deepspeed_optimizer=True)["optimizer_state_dict"]
        return partitions, load_data(*engine_file(engine._get_ckpt_name(str(checkpoint), MODEL_NAME)))

    def _load_deepspeed_engine(self, partitions: list, counters: dict[str, Any]) -> None:
        """Load what `_deepspeed_engine_state` read into the DeepSpeed engine: the optimizer partitions and the
        step counters."""
        engine = self.parts.model
        engine.optimizer.load_state_dict(partitions, load_optimizer_states=True,
                                         load_from_fp32_weights=engine.zero_load_from_fp32_weights())
        engine.global_steps, engine.skipped_steps = counters["global_steps"], counters["skipped_steps"]
        engine.global_samples = counters["global_samples"]

    def _leave_weights_to_save_pretrained(self, models, weights, output_dir) -> None:
        """accelerate's save_state hook: it would store the full state dict (a LoRA run's frozen base included); the
        checkpoint's save_pretrained files hold the weights instead. (Under FSDP and DeepSpeed accelerate writes
        its own model files and passes no state dicts.)"""
        weights.clear()

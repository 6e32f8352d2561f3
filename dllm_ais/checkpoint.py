"""What a checkpoint holds and how a run continues from one: the run's state (`RunState`), saving it with the
weights, optimizer, scheduler and RNGs (`Checkpointer.save_checkpoint`), and resuming (`Checkpointer.resume`).
Choosing the checkpoint to resume from and taking the run directory: `dllm_ais.checkpoint_choice`.

A resume reads every file of the checkpoint once into memory, verifies it against the checkpoint's manifest
(`dllm_ais.run_dir.read_verified`) and loads from those bytes only (`dllm_ais.checkpoint_loading`: safe loaders
only). Nothing is read again from disk after its check, so a file swapped in the meantime is never loaded, and a
pickle holding code is refused in one line naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, gather_object, send_to_device
from peft import PeftModel

from dllm_ais.checkpoint_choice import BEST_CHECKPOINT_FILE, CONFIG_FILE, RUN_STATE_FILE
from dllm_ais.checkpoint_loading import (load_data, load_weights, refused_on_any_process, restore_random_states,
                                         weights_state)
from dllm_ais.components import StepComponents
from dllm_ais.config import ConfigError, GRPOConfig, save_config
from dllm_ais.evaluation import EvalResult
from dllm_ais.grpo import GenerationBatch, any_process
from dllm_ais.run_dir import (DamagedCheckpoint, atomic_directory, dllm_ais_record, prune_checkpoints, read_verified,
                              staged_directory)
from dllm_ais.safe_files import write_file

RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")  # accelerate's save_state writes one per process


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

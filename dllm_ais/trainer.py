"""The GRPO trainer: setup, then the loop — a generation batch, `num_iterations` optimisation passes over it,
validation, reporting and checkpoints — until `max_steps`.

The step itself is `dllm_ais.grpo`; saving and resuming `dllm_ais.checkpoint`; the collaborators a step uses are
built by `dllm_ais.components`. The trainer keeps the run's progress (counters, prompt cursor, best score) and its
failure policy (skipped non-finite batches, signals).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate.utils import broadcast_object_list, set_seed
from tqdm.auto import tqdm

from dllm_ais import grpo
from dllm_ais.checkpoint import Checkpointer, NonFiniteError, RunState
from dllm_ais.checkpoint_choice import write_held_out
from dllm_ais.components import build_components, high_precision_base, make_accelerator, with_trained_weights_
from dllm_ais.config import GRPOConfig, save_config
from dllm_ais.correction import RolloutCorrection
from dllm_ais.data import load_task_dataset
from dllm_ais.evaluation import EvalResult, evaluate_policy, held_out_line, held_out_metrics
from dllm_ais.fidelity import FidelityState, RolloutFidelity
from dllm_ais.grpo import GenerationBatch, SkippedBatch
from dllm_ais.interruption import StopSignals, TrainingInterrupted, loading_checkpoint
from dllm_ais.launch import (check_metric_for_best_model, check_processes, check_prompt_lengths, check_run_environment,
                             join_deepspeed_processes_on_cpu, note_too_few_groups, note_unseen_approximation,
                             prepare_output_dir_in_turn, use_fsdp_on_cpu)
from dllm_ais.loading import load_tokenizer
from dllm_ais.policy import CustomSampler, Policy
from dllm_ais.reporting import RunReporter
from dllm_ais.run_lock import release_run_lock
from dllm_ais.rewards import resolve_reward_functions, reward_function_names
from dllm_ais.tasks import get_task

__all__ = ["GRPOTrainer", "NonFiniteError", "SkippedBatch", "TrainResult"]

@dataclass
class TrainResult:
    steps: int
    history: list[dict[str, Any]]
    eval_before: EvalResult | None
    eval_after: EvalResult | None
    output_dir: Path


class GRPOTrainer:
    """GRPO with a low-precision rollout engine and importance-sampling correction, on accelerate.

    Args:
        config: a validated `GRPOConfig`.
        model / tokenizer: optional preloaded policy; by default loaded from `config.model_name_or_path` (then a
            unified-flow run also scores its policy on the high-precision base, reloaded from there).
        reward_funcs: callables with TRL's signature; by default the task preset or `config.reward_funcs`.
        train_dataset / eval_dataset: `datasets.Dataset` with a `prompt` column (+ reward columns).
        ais_rule: optional callable diagnostics → α replacing `config.correction.ais_rule`.
        eval_reward_funcs: reward functions of the held-out evaluation (default: `reward_funcs`), e.g. the task's
            own rewards for a run trained on shaped or control rewards.
        sampler: a `MaskedDiffusionSampler` to roll out with instead of the plain sampler: an instance (its settings
            must equal the config's) or a callable building one from the config's `DiffusionSamplerConfig` (its
            subclass, a `functools.partial`); every estimator scores its `block_logits` as sampled.
        policy: any object with the `dllm_ais.policy.Policy` protocol, to sample and score with instead of the
            config's (not with `sampler`).
        Held-out validation decodes with d1's protocol whatever samples the rollouts; a custom sampler's
        own greedy score is reported after training as `eval/rollout_sampler/*` (`components.training_policies`).
    """

    def __init__(self, config: GRPOConfig, model=None, tokenizer=None, reward_funcs: list[Callable] | None = None,
                 train_dataset=None, eval_dataset=None, ais_rule: Callable[[dict], float] | None = None,
                 eval_reward_funcs: list[Callable] | None = None, sampler: CustomSampler | None = None,
                 policy: Policy | None = None):
        self.config = config.validate()
        check_run_environment(config)
        join_deepspeed_processes_on_cpu()
        self.accelerator = make_accelerator(config)
        use_fsdp_on_cpu(self.accelerator)
        check_processes(self.accelerator)
        self.resume_from = prepare_output_dir_in_turn(config, self.accelerator)  # before anything loads
        self.accelerator.wait_for_everyone()
        set_seed(config.seed, device_specific=True)
        self.reward_funcs = resolve_reward_functions(reward_funcs or config.reward_funcs or config.task)
        self.eval_reward_funcs = resolve_reward_functions(eval_reward_funcs) if eval_reward_funcs else self.reward_funcs
        self.train_dataset = train_dataset if train_dataset is not None else load_task_dataset(
            config.task, split="train", path=config.dataset_path, size=config.dataset_size, seed=config.seed,
            task_args=config.task_args)
        self.eval_dataset = eval_dataset if eval_dataset is not None or not config.eval_size else load_task_dataset(
            config.task, split="validation", path=config.dataset_path, size=config.eval_size, seed=config.seed,
            task_args=config.task_args)
        check_metric_for_best_model(config, reward_function_names(self.eval_reward_funcs))
        self.tokenizer = tokenizer or load_tokenizer(config.model_name_or_path, config.trust_remote_code)
        check_prompt_lengths(self.tokenizer, {"train": self.train_dataset, "eval": self.eval_dataset},
                             config.max_prompt_length)

        self.base_on_disk = model is None  # the unified flow's high-precision base reloads from model_name_or_path
        self.parts = build_components(config, self.tokenizer, self.accelerator, model, sampler, policy)
        self.policy, self.model, self.engine = self.parts.policy, self.parts.model, self.parts.engine
        self.optimizer, self.scheduler = self.parts.optimizer, self.parts.scheduler
        self.correction = RolloutCorrection(config.correction, config.num_generations, ais_rule)
        if self.accelerator.is_main_process:
            note_too_few_groups(config, self.correction.rule, self.accelerator.num_processes)
            note_unseen_approximation(config)

        self.run_id = broadcast_object_list([uuid.uuid4().hex])[0]  # names this run and its resumptions
        self.global_step = self.generation_index = self.prompt_cursor = self.batch_iteration = 0
        self.prompt_order = torch.randperm(len(self.train_dataset), generator=torch.Generator().manual_seed(config.seed))
        self.batch: GenerationBatch | None = None  # the generation batch in use, for `num_iterations` passes
        self.skipped_batches = self.consecutive_skipped_batches = self.num_input_tokens_seen = 0
        self.eval_before: EvalResult | None = None
        self.latest_eval: tuple[int, EvalResult] | None = None  # (step, result) of the last validation
        self.best_metric: float | None = None
        self.best_global_step: int | None = None
        self.best_model_checkpoint: str | None = None
        self.completion_samples: list[dict[str, Any]] | None = None  # of the newest generation batch, until logged
        self.checkpointer = Checkpointer(config, self.parts, self.tokenizer)
        self.fidelity = RolloutFidelity.from_config(config, self.policy)
        if self.resume_from is not None:
            with loading_checkpoint(self.resume_from):
                self.restore(self.checkpointer.resume(self.resume_from, len(self.train_dataset)))
        if self.accelerator.is_main_process and (note := self.fidelity.start_note()):
            print(note)

    def run_state(self) -> RunState:
        """What a checkpoint of the current step restores (the attributes `RunState` names)."""
        return RunState(**{name: getattr(self, name) for name in RunState.names()})

    def restore(self, state: RunState) -> None:
        """Continue from `state` (a resumed checkpoint's)."""
        for name in RunState.names():
            setattr(self, name, getattr(state, name))

    @property
    def unwrapped_model(self):
        return self.parts.unwrapped_model

    @property
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.parts.trainable_parameters

    @property
    def previous_alpha(self) -> float | None:
        """The AIS α moving average the correction carries across generation batches (checkpointed)."""
        return self.correction.previous_alpha

    @previous_alpha.setter
    def previous_alpha(self, value: float | None) -> None:
        self.correction.previous_alpha = value

    @property
    def rollout_fidelity_state(self) -> dict[str, int]:
        """The adaptive-fidelity controller's rung and calm-batch count (checkpointed)."""
        return dataclasses.asdict(self.fidelity.state)

    @rollout_fidelity_state.setter
    def rollout_fidelity_state(self, value: dict[str, int]) -> None:
        self.fidelity.state = FidelityState(**value)

    # ----------------------------------------------------------------------------------------------- the step
    def next_prompts(self) -> dict[str, list]:
        """The next `generation_batch_size / G` dataset rows of this process, each repeated G times (one group each)."""
        per_device = self.config.generation_batch_size // self.config.num_generations
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        rows = []
        for _ in range(per_device * world):
            if self.prompt_cursor == len(self.prompt_order):
                self.prompt_cursor = 0
            rows.append(int(self.prompt_order[self.prompt_cursor]))
            self.prompt_cursor += 1
        local = self.train_dataset.select(rows[rank * per_device:(rank + 1) * per_device])
        return grpo.grouped_prompts(local, self.config.num_generations)

    def make_generation_batch(self) -> GenerationBatch:
        """`grpo.make_generation_batch` on the next prompts; the batch's prompts and seeds are used up even when it
        raises SkippedBatch."""
        index = self.generation_index
        self.generation_index += 1
        batch = grpo.make_generation_batch(self.config, self.parts, self.tokenizer, self.reward_funcs,
                                           self.next_prompts(), index, self.correction, self.num_input_tokens_seen,
                                           self.fidelity)
        self.num_input_tokens_seen = int(batch.metrics["num_tokens"])
        if batch.completion_samples is not None:
            self.completion_samples = batch.completion_samples
        return batch

    def optimisation_pass(self, batch: GenerationBatch, iteration: int) -> dict[str, float]:
        """`grpo.optimisation_pass`: one optimizer step over the batch (SkippedBatch when non-finite)."""
        metrics = grpo.optimisation_pass(self.config, self.parts, batch, iteration, self.correction)
        self.global_step += 1
        return metrics

    def training_step(self) -> dict[str, float] | None:
        """One optimizer step: a new generation batch when the current one has had its `num_iterations` passes, then
        one optimisation pass. Returns the step's metrics, or None when a non-finite value skipped the batch."""
        try:
            if self.batch is None:
                start = time.perf_counter()
                self.batch = self.make_generation_batch()
                self.batch.metrics["timing/generation_batch_s"] = time.perf_counter() - start
                self.batch_iteration = 0
            start = time.perf_counter()
            metrics = {"step": self.global_step + 1, **self.batch.metrics,
                       **self.optimisation_pass(self.batch, self.batch_iteration)}
        except SkippedBatch as skip:
            self.batch = None
            self.record_skip(skip)
            return None
        metrics["timing/optimisation_pass_s"] = time.perf_counter() - start
        self.consecutive_skipped_batches = 0
        metrics["skipped_batches"] = self.skipped_batches
        self.batch_iteration += 1
        if self.batch_iteration == self.config.num_iterations:
            self.batch = None
        return metrics

    def record_skip(self, skip: SkippedBatch) -> None:
        """Count a skipped generation batch; stop the run after `max_consecutive_skipped_batches` in a row."""
        self.skipped_batches += 1
        self.consecutive_skipped_batches += 1
        limit = self.config.max_consecutive_skipped_batches
        if self.consecutive_skipped_batches >= limit:
            raise NonFiniteError(f"stopped at step {self.global_step}: {self.consecutive_skipped_batches} generation "
                                 f"batches in a row were skipped, the last for {skip}. {skip.hint}.")
        if self.accelerator.is_main_process:
            tqdm.write(f"step {self.global_step + 1}: skipped a generation batch, {skip}; weights unchanged "
                       f"({self.consecutive_skipped_batches} in a row, the run stops at {limit}).")

    # ----------------------------------------------------------------------------------------------- validation
    def evaluate_high_precision_base(self) -> tuple[EvalResult, EvalResult] | None:
        """With the unified precision flow below bf16, the held-out scores of the policy on the high-precision base
        (`components.high_precision_base`) before and after training — the in-run evaluation scores the quantized
        model, as the run deploys it; None for another run, or when the trainer was given its model (the base is
        reloaded from `model_name_or_path`)."""
        if not (self.engine.shares_trainer_model and self.base_on_disk) or self.config.rollout.precision == "bf16":
            return None
        model = high_precision_base(self.config, self.accelerator.device)
        before = self.evaluate(model=model)
        after = self.evaluate(model=with_trained_weights_(model, self.unwrapped_model))
        return before, after

    def evaluate(self, dataset=None, policy=None, model=None) -> EvalResult:
        """Per-prompt rewards and accuracy of greedy completions of the trainer's (full-precision) policy on the
        held-out (validation) prompts.

        When the rollout engine holds the trainer's weights in the trainer's precision (`rollout_precision=bf16` on
        float32 weights: `RolloutEngine.holds_trainer_weights`), it decodes them, synced now: its LoRA adapters are
        merged, so a forward runs no adapter matmuls (a quarter fewer seconds per forward on the embedded chain-sum
        LLaDA). `model` (default: the trainer's) is another model to score with the same protocol."""
        self.model.eval()
        model = model or self.unwrapped_model
        if model is self.unwrapped_model and self.engine.holds_trainer_weights:
            self.engine.sync_from(model)
            model = self.engine.model
        return evaluate_policy(model, self.tokenizer, policy or self.parts.greedy_policy,
                               dataset if dataset is not None else self.eval_dataset, self.eval_reward_funcs,
                               self.config.reward_weights, self.config.eval_batch_size,
                               self.config.max_prompt_length, accuracy=get_task(self.config.task).accuracy)

    def validate(self) -> dict[str, float]:
        """Score the validation split now (every `eval_steps`): its `eval/*` metrics; the best score so far
        (`best_metric` at `best_global_step`, by `metric_for_best_model`) is updated."""
        result = self.evaluate()
        self.latest_eval = (self.global_step, result)
        metrics = result.summary()
        value = metrics[self.config.best_metric_key]
        improved = self.best_metric is None or (value > self.best_metric if self.config.greater_is_better
                                                 else value < self.best_metric)
        if math.isfinite(value) and improved:
            self.best_metric, self.best_global_step = value, self.global_step
        return metrics

    def scored_now(self) -> EvalResult | None:
        """The validation result of the current step, when it was scored."""
        return self.latest_eval[1] if self.latest_eval is not None and self.latest_eval[0] == self.global_step else None

    # ----------------------------------------------------------------------------------------------- saving
    def save(self, directory: Path) -> None:
        self.checkpointer.save_model(directory, self.global_step)

    def save_checkpoint(self) -> Path:
        """`checkpoint-<step>` (see `Checkpointer.save_checkpoint`), its marker holding the step's finite scores."""
        scored = self.scored_now()
        validation = None if scored is None else {k: v for k, v in scored.summary().items() if math.isfinite(v)}
        if self.best_global_step == self.global_step:
            self.best_model_checkpoint = str(self.checkpointer.checkpoint_directory(self.global_step))
        return self.checkpointer.save_checkpoint(self.run_state(), validation)

    def stop_if_signalled(self, signals: StopSignals) -> None:
        """After SIGINT/SIGTERM reached any process: checkpoint the current step and raise TrainingInterrupted."""
        if not grpo.any_process(self.accelerator, signals.received is not None)[0]:
            return
        checkpoint = self.save_checkpoint() if self.global_step > 0 else None
        raise TrainingInterrupted(signals.received or signal.SIGTERM, self.global_step, checkpoint)

    # ----------------------------------------------------------------------------------------------- the loop
    def train(self) -> TrainResult:
        """Run to `max_steps` (from the checkpoint's step when resuming). SIGINT/SIGTERM end the run after the current
        step with a checkpoint (TrainingInterrupted); too many non-finite batches in a row end it (NonFiniteError)."""
        cfg, final, is_main = self.config, Path(self.config.output_dir) / "final", self.accelerator.is_main_process
        self.reporter = RunReporter.open(cfg, self.accelerator, self.global_step, self.resume_from)
        if is_main:
            save_config(cfg, Path(cfg.output_dir) / "config.yaml")
            self.checkpointer.write_best_record(self.run_state())
        eval_after = rollout_sampler = high_precision = None
        try:
            with StopSignals() as signals:
                if self.eval_dataset is not None and self.global_step == 0:
                    self.eval_before = self.evaluate()
                    if is_main:
                        tqdm.write(f"held-out reward before training: {self.eval_before.summary()['eval/reward']:.4f}")
                while self.global_step < cfg.max_steps:
                    metrics = self.training_step()
                    if metrics is not None:
                        self.reporter.progress.update(1)
                        if cfg.eval_steps and self.global_step % cfg.eval_steps == 0:
                            metrics.update(self.validate())
                        self.report(metrics)
                        if cfg.save_steps and self.global_step % cfg.save_steps == 0:
                            self.save_checkpoint()
                    self.stop_if_signalled(signals)
                self.reporter.progress.close()
                if self.eval_dataset is not None:
                    eval_after = self.scored_now() or self.evaluate()
                    if self.parts.rollout_sampler_policy is not None and cfg.experimental.eval_rollout_sampler:
                        rollout_sampler = self.evaluate(policy=self.parts.rollout_sampler_policy)
                    high_precision = self.evaluate_high_precision_base()
                self.stop_if_signalled(signals)
                self.save(final)
                if self.best_global_step == self.global_step and not self.checkpointer.saved_now(self.global_step):
                    self.best_model_checkpoint = str(final)
            if is_main:
                self.checkpointer.write_best_record(self.run_state())
                held_out = eval_after and {"step": self.global_step,
                                           **held_out_metrics(self.eval_before, eval_after, rollout_sampler,
                                                              high_precision)}
                self.reporter.finish(held_out, eval_after and held_out_line(self.eval_before, eval_after,
                                                                            rollout_sampler, high_precision), final)
                if eval_after:
                    write_held_out(cfg, self.eval_dataset, self.eval_before, eval_after)
        except TrainingInterrupted:
            if is_main:
                self.reporter.plot()
            raise
        finally:
            self.reporter.close()
        if self.parts.accelerator.is_main_process:  # a failed run keeps it: the CLI cleans up what the run left
            release_run_lock(self.config.output_dir)
        return TrainResult(self.global_step, self.reporter.records, self.eval_before, eval_after, final.parent)

    def report(self, metrics: dict[str, float]) -> None:
        """`RunReporter.report` of this step, with the best score so far and the newest batch's samples (logged once)."""
        best = ("no best yet" if self.best_metric is None else
                f"best {self.config.best_metric_key} {self.best_metric:.4f} at step {self.best_global_step}")
        if self.reporter.report(self.global_step, metrics, self.completion_samples, best):
            self.completion_samples = None

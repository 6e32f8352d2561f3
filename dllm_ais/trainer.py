"""The GRPO trainer: wires sampling → rewards → likelihood → correction → loss → update, nothing more.

One generation batch (per device: `per_device_train_batch_size × gradient_accumulation_steps` completions):

1. sync the rollout engine (FP8 copy of the policy) from the trainer, in place;
2. sample G completions per prompt with the engine;
3. score them with the reward functions; group advantages over the batch gathered from every process;
4. log-probs with one estimator on both sides, per estimator seed: ℓ_rollout (engine), ℓ_old (trainer, no grad),
   ℓ_ref (adapter disabled, if β > 0);
5. correction weights (AIS by default) from ℓ_old vs ℓ_rollout;
6. `num_iterations` passes of the clipped GRPO loss × weights, one optimizer step per pass.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import pickle
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object, send_to_device, set_seed
from peft import LoraConfig, PeftModel, get_peft_model
from tqdm.auto import tqdm
from transformers import get_scheduler

from dllm_ais.checkpoint import (atomic_directory, begin_staging, commit_staging, load_model, load_saved_weights,
                                 load_tokenizer, prepare_output_dir, prune_checkpoints, resolve_dtype, special_tokens,
                                 staging_directory)
from dllm_ais.config import ConfigError, GRPOConfig, save_config
from dllm_ais.correction import MIN_GROUPS_FOR_NOISE, correct
from dllm_ais.data import load_task_dataset, tokenize_prompts
from dllm_ais.engine import RolloutEngine
from dllm_ais.evaluation import EvalResult, evaluate_policy, paired_difference
from dllm_ais.interruption import StopSignals, TrainingInterrupted
from dllm_ais.launch import check_processes, check_prompt_lengths, check_run_environment, use_fsdp_on_cpu
from dllm_ais.loss import grpo_loss, group_advantages
from dllm_ais.metrics import (MetricsLog, completion_metrics, console_line, distinct_completions, ends_with_eos,
                              eval_line, mismatch_warnings, plot_metrics, reward_metrics)
from dllm_ais.ops import masked_mean
from dllm_ais.policy import AutoregressivePolicy, DiffusionPolicy, Policy, lora_target_modules
from dllm_ais.rewards import (NonFiniteRewardError, completion_texts, resolve_reward_functions, reward_function_names,
                              score_rollout_table)
from dllm_ais.sampling.autoregressive import AutoregressiveSamplerConfig
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig
from dllm_ais.sampling.rollout import Rollout
from dllm_ais.tasks import get_task
from dllm_ais.trackers import log_table, tracker_init_kwargs


def is_diffusion(config: GRPOConfig, model_config) -> bool:
    if config.policy == "auto":
        return getattr(model_config, "model_type", None) == "llada"
    return config.policy == "diffusion"


def build_policy(config: GRPOConfig, model_config, tokenizer, temperature: float | None = None) -> Policy:
    """The diffusion or autoregressive policy for this config (`temperature` overrides, e.g. 0 for greedy eval)."""
    diffusion = is_diffusion(config, model_config)
    tokens = special_tokens(tokenizer, model_config, diffusion)
    temperature = config.temperature if temperature is None else temperature
    if diffusion:
        sampler = DiffusionSamplerConfig(
            gen_length=config.max_completion_length, block_length=config.block_length, steps=config.diffusion_steps,
            temperature=temperature, remasking=config.remasking, mask_token_id=tokens.mask_token_id,
            eos_token_ids=tokens.eos_token_ids, pad_token_id=tokens.pad_token_id, cfg_scale=config.cfg_scale,
            cache=config.rollout_cache, threshold=config.rollout_threshold)
        return DiffusionPolicy(sampler, estimator=config.likelihood_estimator, p_mask_prompt=config.p_mask_prompt,
                               likelihood_order=config.likelihood_order)
    sampler = AutoregressiveSamplerConfig(
        max_new_tokens=config.max_completion_length, temperature=temperature, top_k=config.top_k, top_p=config.top_p,
        eos_token_ids=tokens.eos_token_ids, pad_token_id=tokens.pad_token_id)
    return AutoregressivePolicy(sampler)


def micro_seed(seed: int, micro_batch: int) -> int:
    """The estimator seed of one micro-batch: distinct across micro-batches and across inner iterations' seeds."""
    return seed + 100_003 * micro_batch


@dataclass
class GenerationBatch:
    """Everything the loss needs from one generation batch, computed once before the μ optimisation passes."""

    rollout: Rollout
    advantages: torch.Tensor  # [B]
    logp_old: list[torch.Tensor]  # per estimator seed: [B, L]
    logp_ref: list[torch.Tensor | None]
    weights: list[torch.Tensor]
    clip_scale: list[torch.Tensor | None]
    diagnostics: list[dict[str, float]]
    seeds: list[int]
    metrics: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only: a checkpoint keeps the batch a run is in the middle of."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device) -> "GenerationBatch":
        def to_device(values):
            return [None if v is None else v.to(device) for v in values]

        return cls(Rollout(**state["rollout"]).to(device), state["advantages"].to(device), to_device(state["logp_old"]),
                   to_device(state["logp_ref"]), to_device(state["weights"]), to_device(state["clip_scale"]),
                   state["diagnostics"], state["seeds"], state["metrics"])


class SkippedBatch(Exception):
    """A NaN or inf at `stage` (reward, a log-prob, the loss or the gradient): the generation batch is dropped before
    any optimizer step, so the weights and the optimizer state stay untouched."""

    def __init__(self, stage: str, detail: str = ""):
        self.stage = stage
        super().__init__(f"non-finite {stage}" + (f": {detail}" if detail else ""))


BEST_CHECKPOINT_FILE = "best_checkpoint.json"


def written_by_dllm_ais(path: Path) -> bool:
    """Whether the JSON file at `path` is a record dllm-ais wrote (its `written_by` field says so)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("written_by") == "dllm-ais"


class NonFiniteError(FloatingPointError):
    """Training stopped: `max_consecutive_skipped_batches` batches in a row were non-finite, or weights to be saved are."""


SKIP_HINTS = {
    "reward": "check the reward functions (return a finite float, or None to exclude a completion)",
    "loss": "try a lower learning_rate or max_grad_norm",
    "gradient": "try a lower learning_rate or max_grad_norm",
}
LOGPROB_HINT = "NaN/inf log-probs usually mean an overflow in low precision: try dtype=float32 or rollout_precision=bf16"


def non_finite(tensors: list[torch.Tensor | None], mask: torch.Tensor) -> bool:
    """Whether any [B, L] tensor holds NaN or inf at a completion position (padding is never read)."""
    return any(t is not None and not torch.isfinite(t.detach()[mask]).all() for t in tensors)


class TrainingProgress:
    """What a checkpoint needs besides weights, optimizer, scheduler and the global RNGs (accelerate saves those):
    the trainer's counters (steps, generation batches, tokens seen), prompt order and cursor, the α EMA, the held-out
    baseline, the best validation score so far (TRL's `best_metric`, `best_global_step`, `best_model_checkpoint`),
    the skip counters, the completion samples not yet logged and the generation batch in flight on every process
    (each holds its own prompts' rollouts). The samplers' and estimators' generators are seeded from
    `generation_index`.

    This is the object `accelerator.register_for_checkpointing` stores (state_dict / load_state_dict); it holds
    tensors and plain values only, so resuming can check the file loads with `torch.load(weights_only=True)`.
    accelerate writes it from the main process only, so `state_dict` (called on every process) gathers the batches.
    """

    FIELDS = ("run_id", "global_step", "generation_index", "previous_alpha", "prompt_order", "prompt_cursor",
              "batch_iteration", "skipped_batches", "consecutive_skipped_batches", "num_input_tokens_seen",
              "best_metric", "best_global_step", "best_model_checkpoint", "completion_samples")

    def __init__(self, trainer: "GRPOTrainer"):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        batch, eval_before = self.trainer.batch, self.trainer.eval_before
        batches = [None if batch is None else send_to_device(batch.state_dict(), "cpu")]
        if self.trainer.accelerator.num_processes > 1:
            batches = gather_object(batches)
        return {**{name: getattr(self.trainer, name) for name in self.FIELDS}, "batches": batches,
                "eval_before": None if eval_before is None else eval_before.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.FIELDS:
            setattr(self.trainer, name, state[name])
        batch, eval_before = state["batches"][self.trainer.accelerator.process_index], state["eval_before"]
        self.trainer.batch = None if batch is None else GenerationBatch.from_state_dict(batch, self.trainer.accelerator.device)
        self.trainer.eval_before = None if eval_before is None else EvalResult.from_state_dict(eval_before)


def held_out_metrics(before: EvalResult | None, after: EvalResult) -> dict[str, float]:
    """`eval/*` after training, the same `_before` (when there is a baseline) and the paired change of the reward
    (`eval/reward_delta`, `eval/reward_delta_se`)."""
    metrics = after.summary()
    if before is not None:
        metrics.update({f"{key}_before": value for key, value in before.summary().items()})
        delta = paired_difference(before.per_prompt_reward, after.per_prompt_reward)
        metrics.update({"eval/reward_delta": delta.mean, "eval/reward_delta_se": delta.standard_error})
    return metrics


def rollout_sampler_metrics(result: EvalResult | None) -> dict[str, float]:
    """`eval/rollout_sampler/*`: the held-out scores of greedy completions decoded by the run's own (fast) sampler,
    beside the exact-decoding `eval/*` ones; {} without such a result."""
    if result is None:
        return {}
    return {f"eval/rollout_sampler/{key.removeprefix('eval/')}": value for key, value in result.summary().items()}


def held_out_line(before: EvalResult | None, after: EvalResult) -> str:
    """The run's closing line: greedy held-out reward (and accuracy) before → after training, with the paired
    per-prompt difference and its standard error; just the final value when there is no baseline (a resumed run
    that turned evaluation on)."""
    if before is None:
        return f"held-out reward after training: {after.summary()['eval/reward']:.4f} ({after.num_prompts} prompts, greedy)"
    parts = [f"held-out reward: before {before.per_prompt_reward.mean():.4f} → after {after.per_prompt_reward.mean():.4f} "
             f"({paired_difference(before.per_prompt_reward, after.per_prompt_reward)}, greedy)"]
    if before.per_prompt_accuracy is not None and after.per_prompt_accuracy is not None:
        accuracy = paired_difference(before.per_prompt_accuracy, after.per_prompt_accuracy)
        parts.append(f"accuracy {before.per_prompt_accuracy.mean():.4f} → {after.per_prompt_accuracy.mean():.4f} "
                     f"(Δ {accuracy.mean:+.4f} ± {accuracy.standard_error:.4f} SE)")
    return "; ".join(parts)


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
        model / tokenizer: optional preloaded policy; by default loaded from `config.model_name_or_path`.
        reward_funcs: callables with TRL's signature; by default the task preset or `config.reward_funcs`.
        train_dataset / eval_dataset: `datasets.Dataset` with a `prompt` column (+ reward columns).
        ais_rule: optional callable diagnostics → α replacing `config.ais_rule`.
        eval_reward_funcs: reward functions of the held-out evaluation (default: `reward_funcs`), e.g. the task's
            own rewards for a run trained on shaped or control rewards.
    """

    def __init__(self, config: GRPOConfig, model=None, tokenizer=None, reward_funcs: list[Callable] | None = None,
                 train_dataset=None, eval_dataset=None, ais_rule: Callable[[dict], float] | None = None,
                 eval_reward_funcs: list[Callable] | None = None):
        self.config = config.validate()
        check_run_environment(config)
        # No autocast: the trainer computes in its weights' dtype (bf16 on GPU by default), the same dtype as the
        # rollout engine, so the `bf16` engine reproduces the trainer's log-probs exactly. The scheduler steps once
        # per optimizer step whatever the number of processes.
        self.accelerator = Accelerator(
            log_with=config.report_to or None, project_dir=config.output_dir, mixed_precision="no",
            gradient_accumulation_steps=config.gradient_accumulation_steps, step_scheduler_with_optimizer=False)
        use_fsdp_on_cpu(self.accelerator)
        check_processes(self.accelerator)
        self.resume_from = prepare_output_dir(config, self.accelerator.is_main_process)  # before anything loads
        self.accelerator.wait_for_everyone()
        set_seed(config.seed, device_specific=True)
        self.ais_rule = ais_rule or config.ais_rule
        self.reward_funcs = resolve_reward_functions(reward_funcs or config.reward_funcs or config.task)
        self.eval_reward_funcs = resolve_reward_functions(eval_reward_funcs) if eval_reward_funcs else self.reward_funcs
        self.train_dataset = train_dataset if train_dataset is not None else load_task_dataset(
            config.task, split="train", path=config.dataset_path, size=config.dataset_size, seed=config.seed)
        self.eval_dataset = eval_dataset if eval_dataset is not None or not config.eval_size else load_task_dataset(
            config.task, split="validation", path=config.dataset_path, size=config.eval_size, seed=config.seed)
        self.check_metric_for_best_model()

        self.tokenizer = tokenizer or load_tokenizer(config.model_name_or_path)
        check_prompt_lengths(self.tokenizer, {"train": self.train_dataset, "eval": self.eval_dataset},
                             config.max_prompt_length)
        model = model or load_model(config.model_name_or_path, resolve_dtype(config.dtype), config.trust_remote_code,
                                    is_trainable=True)
        self.policy = build_policy(config, model.config, self.tokenizer)
        self.greedy_policy = build_policy(config.decoding(exact=True), model.config, self.tokenizer, temperature=0.0)
        self.rollout_sampler_policy = (build_policy(config.decoding(exact=False), model.config, self.tokenizer,
                                                    temperature=0.0) if config.fast_rollouts else None)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if config.use_peft and not isinstance(model, PeftModel):
            targets = config.lora_target_modules or lora_target_modules(model.config.model_type)
            model = get_peft_model(model, LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha,
                                                     lora_dropout=config.lora_dropout, target_modules=targets))
        model.to(self.accelerator.device)
        self.reference_model = None
        if config.beta > 0 and not isinstance(model, PeftModel):
            self.reference_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.engine = RolloutEngine(model, precision=config.rollout_precision)

        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay,
                                      betas=(config.adam_beta1, config.adam_beta2))
        scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=config.warmup_steps,
                                  num_training_steps=config.max_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]  # as prepared (sharded)

        groups = config.generation_batch_size * self.accelerator.num_processes // config.num_generations
        if (config.correction == "ais" and self.ais_rule in ("adaptive", "oracle") and groups < MIN_GROUPS_FOR_NOISE
                and self.accelerator.is_main_process):
            print(f"note: a generation batch holds {groups} GRPO group(s) over all processes; ais_rule={self.ais_rule} "
                  f"needs {MIN_GROUPS_FOR_NOISE} to measure the batch's gradient noise, so alpha follows the k3 gate "
                  f"(ais_kl_scale={config.ais_kl_scale:g}). Raise per_device_train_batch_size * "
                  f"gradient_accumulation_steps * processes / num_generations to {MIN_GROUPS_FOR_NOISE} to use it.")
        if config.unseen_approximation and self.accelerator.is_main_process:
            print(f"note: rollout_cache={config.rollout_cache}, rollout_threshold={config.rollout_threshold}: "
                  f"{config.unseen_approximation}. Exact rollouts: --rollout_cache=none --rollout_threshold=null.")
        self.run_id = broadcast_object_list([uuid.uuid4().hex])[0]  # names this run and its resumptions
        self.global_step = 0
        self.generation_index = 0
        self.previous_alpha: float | None = None
        self.prompt_order = torch.randperm(len(self.train_dataset), generator=torch.Generator().manual_seed(config.seed))
        self.prompt_cursor = 0
        self.batch: GenerationBatch | None = None  # the generation batch in use, for `num_iterations` passes
        self.batch_iteration = 0
        self.skipped_batches = 0
        self.consecutive_skipped_batches = 0
        self.eval_before: EvalResult | None = None
        self.latest_eval: tuple[int, EvalResult] | None = None  # (step, result) of the last validation
        self.num_input_tokens_seen = 0
        self.best_metric: float | None = None
        self.best_global_step: int | None = None
        self.best_model_checkpoint: str | None = None
        self.completion_samples: list[dict[str, Any]] | None = None  # of the newest generation batch, until logged
        self.warned: set[str] = set()  # mismatch metrics whose verl warning level was reported
        self.last_checkpoint: tuple[int, Path] | None = None
        self.accelerator.register_save_state_pre_hook(self._leave_weights_to_save_pretrained)
        self.accelerator.register_load_state_pre_hook(self._load_weights_from_save_pretrained)
        self.accelerator.register_for_checkpointing(TrainingProgress(self))
        if self.resume_from is not None:
            self.resume(self.resume_from)

    # ----------------------------------------------------------------------------------------------- pipeline
    @property
    def unwrapped_model(self):
        return self.accelerator.unwrap_model(self.model)

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
        return {column: [v for v in local[column] for _ in range(self.config.num_generations)]
                for column in local.column_names}

    def sample(self, policy: Policy, model, columns: dict[str, list], generator: torch.Generator | None) -> Rollout:
        """Roll out the prompts in micro-batches of `per_device_train_batch_size` and stitch one canvas."""
        input_ids, attention_mask = tokenize_prompts(self.tokenizer, columns["prompt"], self.config.max_prompt_length,
                                                     self.accelerator.device)
        size = self.config.per_device_train_batch_size
        parts = [policy.sample(model, input_ids[i:i + size], attention_mask[i:i + size], generator)
                 for i in range(0, len(input_ids), size)]
        return Rollout.concatenate(parts)

    def estimator_seeds(self, generation_index: int) -> list[int]:
        """One estimator seed per inner iteration (one-step surrogate) or a single one (exact estimators)."""
        count = self.policy.num_estimator_seeds(self.config.num_iterations)
        base = self.config.seed * 1_000_003 + generation_index * 1_009 + self.accelerator.process_index * 7_919_001
        return [base + n for n in range(count)]

    def micro_batches(self, size: int) -> list[slice]:
        step = self.config.per_device_train_batch_size
        return [slice(start, start + step) for start in range(0, size, step)]

    def micro_batched_logprobs(self, model, rollout: Rollout, seed: int, rollout_side: bool = False) -> torch.Tensor:
        """Log-probs [B, L] computed micro-batch by micro-batch, micro-batch j with estimator seed `micro_seed(seed, j)`.

        ℓ_θ is computed per micro-batch during the optimisation passes; computing ℓ_rollout, ℓ_old and ℓ_ref over
        the very same slices with the very same seeds gives every side identical random masks.
        """
        score = self.policy.rollout_logprobs if rollout_side else self.policy.logprobs
        return torch.cat([score(model, rollout.select(rows), micro_seed(seed, j))
                          for j, rows in enumerate(self.micro_batches(len(rollout.sequences)))])

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout, seed: int) -> torch.Tensor | None:
        if self.config.beta == 0:
            return None
        if self.reference_model is not None:
            return self.micro_batched_logprobs(self.reference_model, rollout, seed)
        with self.unwrapped_model.disable_adapter():
            return self.micro_batched_logprobs(self.model, rollout, seed)

    def any_process(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over all processes (one gather), so that every process takes the same branch."""
        local = torch.tensor([[float(flag) for flag in flags]], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            local = self.accelerator.gather(local)
        return [bool(value) for value in local.amax(0).tolist()]

    def make_generation_batch(self) -> GenerationBatch:
        """Sample the next prompts with the engine, score them, and compute log-probs and correction weights.

        Raises SkippedBatch (on every process alike) when a reward or a log-prob is NaN or inf; the batch's prompts
        and seeds are used up all the same.
        """
        cfg = self.config
        index = self.generation_index
        self.generation_index += 1
        timings = {"timing/sync_s": self.engine.sync_from(self.unwrapped_model)}
        columns = self.next_prompts()
        generator = torch.Generator(self.accelerator.device).manual_seed(
            cfg.seed + 7919 * index + 104_729 * self.accelerator.process_index)
        start = time.perf_counter()
        rollout = self.sample(self.policy, self.engine.model, columns, generator)
        timings["timing/sample_s"] = time.perf_counter() - start
        tokens = rollout.attention_mask[:, :rollout.prompt_length].sum() + rollout.completion_mask.sum()
        self.num_input_tokens_seen += int(self.accelerator.gather(tokens.reshape(1)).sum())

        problem, table = "", None
        try:
            table = score_rollout_table(self.tokenizer, self.reward_funcs, columns, rollout)
            rewards, per_function_metrics = table.weighted_sum(cfg.reward_weights), table.metrics()
        except NonFiniteRewardError as error:
            rewards, per_function_metrics, problem = torch.full((len(rollout.sequences),), math.nan), {}, str(error)
        all_rewards = self.accelerator.gather(rewards.to(self.accelerator.device))
        if not torch.isfinite(all_rewards).all():
            raise SkippedBatch("reward", problem)
        all_advantages = group_advantages(all_rewards, cfg.num_generations, cfg.scale_rewards)
        local = slice(self.accelerator.process_index * len(rewards), (self.accelerator.process_index + 1) * len(rewards))
        advantages = all_advantages[local]

        start = time.perf_counter()
        seeds = self.estimator_seeds(index)
        self.model.eval()
        with torch.no_grad():
            logp_rollout = [self.micro_batched_logprobs(self.engine.model, rollout, s, rollout_side=True) for s in seeds]
            logp_old = [self.micro_batched_logprobs(self.model, rollout, s) for s in seeds]
        logp_ref = [self.reference_logprobs(rollout, s) for s in seeds]
        timings["timing/logprob_s"] = time.perf_counter() - start
        logprobs = {"rollout log-probs": logp_rollout, "old log-probs": logp_old, "reference log-probs": logp_ref}
        bad = self.any_process(*(non_finite(values, rollout.completion_mask) for values in logprobs.values()))
        if any(bad):
            raise SkippedBatch(next(stage for stage, flag in zip(logprobs, bad) if flag))

        start = time.perf_counter()
        # Weights and diagnostics (ESS, α, ...) are computed over the whole batch, gathered from every process.
        gather = self.accelerator.gather
        global_mask = gather(rollout.completion_mask.long()).bool()
        corrections = [correct(
            cfg.correction, gather(old), gather(ro), all_advantages, global_mask, clip=cfg.is_clip,
            clip_low=cfg.is_clip_low, level=cfg.is_level, normalize=cfg.is_normalize, rule=self.ais_rule,
            snr_scale=cfg.ais_snr_scale, kl_scale=cfg.ais_kl_scale, alpha_max=cfg.ais_alpha_max,
            previous_alpha=self.previous_alpha, alpha_ema=cfg.ais_alpha_ema, group_size=cfg.num_generations)
            for old, ro in zip(logp_old, logp_rollout)]
        if cfg.correction == "ais":  # the EMA advances once per generation batch, over its estimator seeds
            self.previous_alpha = sum(c.diagnostics["ais/alpha"] for c in corrections) / len(corrections)
        timings["timing/correction_s"] = time.perf_counter() - start

        lengths = gather(rollout.completion_mask.sum(1))
        terminated = gather(ends_with_eos(rollout.completion_ids, self.policy.sampler_config.eos_token_ids).long())
        distinct = gather(distinct_completions(rollout.completion_ids, rollout.completion_mask, cfg.num_generations)
                          .to(self.accelerator.device))
        metrics = {
            **reward_metrics(all_rewards, cfg.num_generations), **completion_metrics(lengths, terminated),
            "completions/distinct_per_group": distinct.mean().item(),
            **({} if rollout.num_steps is None else {"completions/mean_steps": rollout.num_steps.float().mean().item()}),
            "num_tokens": float(self.num_input_tokens_seen), **per_function_metrics, **timings,
        }
        if cfg.log_completions and self.accelerator.is_main_process:
            self.completion_samples = self.sample_records(columns, rollout, table, rewards, advantages)
        return GenerationBatch(rollout, advantages, logp_old, logp_ref, [c.weights[local] for c in corrections],
                               [None if c.clip_scale is None else c.clip_scale[local] for c in corrections],
                               [c.diagnostics for c in corrections], seeds, metrics)

    def sample_records(self, columns: dict[str, list], rollout: Rollout, table, rewards: torch.Tensor,
                       advantages: torch.Tensor) -> list[dict[str, Any]]:
        """`num_completions_to_print` of this process' completions, for `log_completions`: the prompt (its last
        message), the completion, the reward, each reward function's value and the advantage."""
        rows = slice(0, self.config.num_completions_to_print)
        prompts = [p[-1]["content"] if isinstance(p, list) else str(p) for p in columns["prompt"][rows]]
        texts = completion_texts(self.tokenizer, rollout.select(rows))
        values = table.values[rows].tolist()
        return [{"prompt": prompt, "completion": text, "reward": reward, "advantage": advantage,
                 **{f"rewards/{name}": value for name, value in zip(table.names, row)}}
                for prompt, text, reward, advantage, row in zip(prompts, texts, rewards[rows].tolist(),
                                                                advantages[rows].tolist(), values)]

    def optimisation_pass(self, batch: GenerationBatch, iteration: int) -> dict[str, float]:
        """One optimizer step over the generation batch: gradient accumulation over its micro-batches.

        accelerate divides each micro-batch loss by gradient_accumulation_steps; `dapo` already normalises by the
        token count of the whole generation batch (averaged over processes), so its loss is scaled back up.
        The step is taken only when the policy log-probs, the loss and the gradient norm are finite on every
        process; otherwise the gradients are dropped and SkippedBatch raised before `optimizer.step` (which would
        move AdamW's moments and, through weight decay, the weights even for a zero gradient).
        """
        cfg = self.config
        k = iteration % len(batch.seeds)
        self.model.train()
        local_tokens = batch.rollout.completion_mask.sum().float()
        total_tokens = self.accelerator.gather(local_tokens.reshape(1)).mean().clamp(min=1).item()
        micro_batches = self.micro_batches(len(batch.advantages))
        summed: dict[str, float] = dict(batch.diagnostics[k])
        first_pass = iteration == 0  # the policy's entropy on the batch: once, at θ_old (a full-vocabulary pass)
        losses, entropies, finite = [], [], []
        for j, rows in enumerate(micro_batches):
            with self.accelerator.accumulate(self.model):
                part = batch.rollout.select(rows)
                scored = self.policy.logprobs(self.model, part, micro_seed(batch.seeds[k], j),
                                              compute_entropy=first_pass)
                logp, entropy = scored if first_pass else (scored, None)
                loss, loss_metrics = grpo_loss(
                    logp, batch.logp_old[k][rows], batch.advantages[rows], part.completion_mask,
                    weights=batch.weights[k][rows],
                    clip_scale=None if batch.clip_scale[k] is None else batch.clip_scale[k][rows],
                    logp_ref=None if batch.logp_ref[k] is None else batch.logp_ref[k][rows],
                    beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, loss_type=cfg.loss_type,
                    max_completion_length=cfg.max_completion_length, num_items_in_batch=total_tokens,
                    ratio_type=cfg.ratio_type)
                finite.append(torch.stack([torch.isfinite(logp.detach()[part.completion_mask]).all(),
                                           torch.isfinite(loss.detach())]))
                scale = len(micro_batches) if cfg.loss_type == "dapo" else 1
                # Non-finite or not, every process joins the gradient all-reduce; the step is decided below.
                self.accelerator.backward(loss * scale)
            losses.append(loss.detach() * scale)
            if entropy is not None:
                entropies.append(masked_mean(entropy.detach(), part.completion_mask))
            for key, value in loss_metrics.items():
                summed[key] = summed.get(key, 0.0) + value / len(micro_batches)
        summed["loss"] = torch.stack(losses).mean().item()
        if entropies:  # logged with every pass of this batch
            summed["entropy"] = batch.metrics["entropy"] = torch.stack(entropies).mean().item()
        bad_logprobs, bad_loss = (not flag for flag in torch.stack(finite).all(dim=0).tolist())
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        bad_logprobs, bad_loss = self.any_process(bad_logprobs, bad_loss)
        # DeepSpeed clips inside its engine and reports no norm: there only the log-prob and loss checks apply.
        bad_gradient = grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)).item()
        if bad_logprobs or bad_loss or bad_gradient:
            self.optimizer.zero_grad(set_to_none=True)
            raise SkippedBatch("policy log-probs" if bad_logprobs else "loss" if bad_loss else "gradient",
                               f"grad norm {float(grad_norm)}" if bad_gradient else "")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        return {**summed, "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                "learning_rate": self.scheduler.get_last_lr()[0]}

    def training_step(self) -> dict[str, float] | None:
        """One optimizer step: a new generation batch when the current one has had its `num_iterations` passes, then
        one optimisation pass. Returns the step's metrics, or None when a non-finite value skipped the batch."""
        cfg = self.config
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
        if self.batch_iteration == cfg.num_iterations:
            self.batch = None
        return metrics

    def record_skip(self, skip: SkippedBatch) -> None:
        """Count a skipped generation batch; stop the run after `max_consecutive_skipped_batches` in a row."""
        self.skipped_batches += 1
        self.consecutive_skipped_batches += 1
        hint = SKIP_HINTS.get(skip.stage, LOGPROB_HINT)
        if self.consecutive_skipped_batches >= self.config.max_consecutive_skipped_batches:
            raise NonFiniteError(f"stopped at step {self.global_step}: {self.consecutive_skipped_batches} generation "
                                 f"batches in a row were skipped, the last for {skip}. {hint}.")
        if self.accelerator.is_main_process:
            tqdm.write(f"step {self.global_step + 1}: skipped a generation batch, {skip}; weights unchanged "
                       f"({self.consecutive_skipped_batches} in a row, the run stops at "
                       f"{self.config.max_consecutive_skipped_batches}).")

    # ----------------------------------------------------------------------------------------------- driver
    def evaluate(self, dataset=None, policy: Policy | None = None) -> EvalResult:
        """Per-prompt rewards and accuracy of greedy completions of the trainer's (full-precision) policy on the
        held-out (validation) prompts, decoded exactly (d1's protocol: no cache, no parallel commits) unless another
        `policy` is given."""
        self.model.eval()
        return evaluate_policy(self.unwrapped_model, self.tokenizer, policy or self.greedy_policy,
                               dataset if dataset is not None else self.eval_dataset, self.eval_reward_funcs,
                               self.config.reward_weights, self.config.per_device_train_batch_size,
                               self.config.max_prompt_length, accuracy=get_task(self.config.task).accuracy)

    def check_metric_for_best_model(self) -> None:
        """With eval_steps, `metric_for_best_model` must name a validation score this run produces (ConfigError)."""
        cfg = self.config
        if not cfg.eval_steps:
            return
        known = ["eval/reward", *(["eval/accuracy"] if get_task(cfg.task).accuracy is not None else []),
                 *(f"eval/rewards/{name}/mean" for name in reward_function_names(self.eval_reward_funcs))]
        if cfg.best_metric_key not in known:
            raise ConfigError(f"metric_for_best_model={cfg.metric_for_best_model!r} is not a validation score of this "
                              f"run; choose one of {', '.join(key.removeprefix('eval/') for key in known)}.")

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

    def write_best_record(self) -> None:
        """`output_dir/best_checkpoint.json`: the best validation score so far, its step, and the directory holding
        the weights of that step (a checkpoint-N, final/ when the last step scored best, or null when that step was
        not saved). Written atomically; without a score yet, a record an earlier run left there is removed."""
        path = Path(self.config.output_dir) / BEST_CHECKPOINT_FILE
        if self.best_global_step is None:
            if written_by_dllm_ais(path):
                path.unlink()
            return
        record = {"written_by": "dllm-ais", "run": self.run_id, "metric_for_best_model": self.config.best_metric_key,
                  "greater_is_better": self.config.greater_is_better, "best_metric": self.best_metric,
                  "best_global_step": self.best_global_step, "best_model_checkpoint": self.best_model_checkpoint}
        staging = path.with_name(f".tmp-{path.name}")
        staging.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(staging, path)

    def train(self) -> TrainResult:
        """Run to `max_steps` (from the checkpoint's step when resuming). SIGINT/SIGTERM end the run after the current
        step with a checkpoint (TrainingInterrupted); too many non-finite batches in a row end it (NonFiniteError)."""
        cfg = self.config
        output_dir = Path(cfg.output_dir)
        is_main = self.accelerator.is_main_process
        log = completions_log = None
        if is_main:
            resume_step = self.global_step if self.resume_from else None
            previous = self.resume_from and self.resume_from.parent
            log = MetricsLog(output_dir, resume_step, previous and previous / "metrics.jsonl")
            if cfg.log_completions:
                completions_log = MetricsLog(output_dir, resume_step, previous and previous / "completions.jsonl",
                                             name="completions.jsonl")
            save_config(cfg, output_dir / "config.yaml")
            self.write_best_record()
        if cfg.report_to:
            self.accelerator.init_trackers("dllm-ais", config=cfg.to_dict(),
                                           init_kwargs=tracker_init_kwargs(cfg.run_name, cfg.output_dir))
        progress = tqdm(total=cfg.max_steps, initial=self.global_step, desc="GRPO", disable=not is_main,
                        dynamic_ncols=True)
        try:
            with StopSignals() as signals:
                if self.eval_dataset is not None and self.global_step == 0:
                    self.eval_before = self.evaluate()
                    if is_main:
                        tqdm.write(f"held-out reward before training: {self.eval_before.summary()['eval/reward']:.4f}")
                while self.global_step < cfg.max_steps:
                    metrics = self.training_step()
                    if metrics is not None:
                        progress.update(1)
                        if cfg.eval_steps and self.global_step % cfg.eval_steps == 0:
                            metrics.update(self.validate())
                        self.report(metrics, log, completions_log, progress)
                        if cfg.save_steps and self.global_step % cfg.save_steps == 0:
                            self.save_checkpoint()
                    self.stop_if_signalled(signals)
                progress.close()
                eval_after = eval_after_rollout_sampler = None
                if self.eval_dataset is not None:
                    scored_now = self.latest_eval is not None and self.latest_eval[0] == self.global_step
                    eval_after = self.latest_eval[1] if scored_now else self.evaluate()
                    if self.rollout_sampler_policy is not None:
                        eval_after_rollout_sampler = self.evaluate(policy=self.rollout_sampler_policy)
                self.stop_if_signalled(signals)
                self.save(output_dir / "final")
                saved_now = self.last_checkpoint is not None and self.last_checkpoint[0] == self.global_step
                if self.best_global_step == self.global_step and not saved_now:
                    self.best_model_checkpoint = str(output_dir / "final")
            if is_main:
                self.write_best_record()
                if eval_after:
                    log.write({"step": self.global_step, **held_out_metrics(self.eval_before, eval_after),
                               **rollout_sampler_metrics(eval_after_rollout_sampler)})
                    tqdm.write(held_out_line(self.eval_before, eval_after))
                if eval_after_rollout_sampler:
                    tqdm.write(f"held-out reward decoded by the rollout sampler (cache {cfg.rollout_cache}, threshold "
                               f"{cfg.rollout_threshold}): {eval_after_rollout_sampler.summary()['eval/reward']:.4f}")
                plot = plot_metrics(log.records, output_dir / "metrics.png")
                tqdm.write(f"metrics: {log.path}" + (f" | plot: {plot}" if plot else "")
                           + f" | model: {output_dir / 'final'}")
        except TrainingInterrupted:
            if is_main:
                plot_metrics(log.records, output_dir / "metrics.png")
            raise
        finally:
            progress.close()
            for jsonl in (log, completions_log):
                if jsonl is not None:
                    jsonl.close()
            if cfg.report_to:
                self.accelerator.end_training()
        return TrainResult(self.global_step, log.records if log else [], self.eval_before, eval_after, output_dir)

    def report(self, metrics: dict[str, float], log: MetricsLog | None, completions_log: MetricsLog | None,
               progress) -> None:
        """Every `logging_steps` and at every validation: a metrics.jsonl line, the progress bar, a console line and,
        with `log_completions`, the newest generation batch's samples (completions.jsonl and a tracker table);
        trackers get the metrics every step. A mismatch metric crossing verl's warning level is reported once."""
        step = self.global_step
        logged = step % self.config.logging_steps == 0 or "eval/reward" in metrics
        if log is not None:
            if logged:
                log.write(metrics)
                progress.set_postfix(reward=f"{metrics['reward']:.3f}", alpha=f"{metrics.get('ais/alpha', 0.0):.2f}")
                tqdm.write(console_line(step, self.config.max_steps, metrics))
            if "eval/reward" in metrics:
                best = ("no best yet" if self.best_metric is None else
                        f"best {self.config.best_metric_key} {self.best_metric:.4f} at step {self.best_global_step}")
                tqdm.write(eval_line(step, metrics, best))
            for key, message in mismatch_warnings(metrics).items():
                if key not in self.warned:
                    self.warned.add(key)
                    tqdm.write(f"warning: step {step}: {message}")
        samples = None
        if logged and self.completion_samples is not None:  # set on the main process only
            samples = [{"step": step, **sample} for sample in self.completion_samples]
            self.completion_samples = None
            for sample in samples if completions_log is not None else ():
                completions_log.write(sample)
        if self.config.report_to:
            self.accelerator.log(metrics, step=step)
            if samples:
                log_table(self.accelerator.trackers, "completions", samples, step)

    def stop_if_signalled(self, signals: StopSignals) -> None:
        """After SIGINT/SIGTERM reached any process: checkpoint the current step and raise TrainingInterrupted."""
        if not self.any_process(signals.received is not None)[0]:
            return
        checkpoint = self.save_checkpoint() if self.global_step > 0 else None
        raise TrainingInterrupted(signals.received or signal.SIGTERM, self.global_step, checkpoint)

    # ----------------------------------------------------------------------------------------------- saving
    def checked_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict to save (a collective under FSDP / ZeRO-3: every process calls this); raises
        NonFiniteError when a trainable weight is NaN or inf, so nothing non-finite is ever written."""
        self.accelerator.wait_for_everyone()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.trainable_parameters]
        if self.any_process(not all(torch.isfinite(p).all() for p in local))[0]:
            raise NonFiniteError(f"refusing to save non-finite weights at step {self.global_step}; the last checkpoint "
                                 "holds finite ones.")
        return self.accelerator.get_state_dict(self.model)

    def write_model(self, directory: Path, state_dict: dict[str, torch.Tensor]) -> None:
        """The adapter (or full model) via save_pretrained, the tokenizer and the config: a directory that
        `dllm-ais eval --model`, `generate` and `export` load."""
        # The vocabulary is never resized here; peft's "auto" would look the base model up on the Hub to check.
        peft_only = {"save_embedding_layers": False} if isinstance(self.unwrapped_model, PeftModel) else {}
        self.unwrapped_model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True, **peft_only)
        self.tokenizer.save_pretrained(directory)
        save_config(self.config, directory / "dllm_ais_config.yaml")

    def save(self, directory: Path) -> None:
        """Write the model directory (see `write_model`) atomically into `directory`."""
        state_dict = self.checked_state_dict()
        if self.accelerator.is_main_process:
            with atomic_directory(directory, overwrite=True) as staging:
                self.write_model(staging, state_dict)

    def save_checkpoint(self) -> Path:
        """Write `output_dir/checkpoint-<step>` atomically: the model directory plus accelerate's `save_state`
        (optimizer, scheduler, every process' RNGs and `TrainingProgress`), from which `resume` continues the run
        exactly; then keep only the newest `save_total_limit` checkpoints of this run (and the best one). The
        directory's marker records the step's validation scores when it was scored."""
        directory = Path(self.config.output_dir) / f"checkpoint-{self.global_step}"
        if self.last_checkpoint is not None and self.last_checkpoint[0] == self.global_step:
            return self.last_checkpoint[1]
        if self.best_global_step == self.global_step:
            self.best_model_checkpoint = str(directory)
        scored = self.latest_eval is not None and self.latest_eval[0] == self.global_step
        validation = {key: value for key, value in self.latest_eval[1].summary().items()
                      if math.isfinite(value)} if scored else None
        state_dict = self.checked_state_dict()
        staging = staging_directory(directory, self.run_id[:8])
        if self.accelerator.is_main_process:
            begin_staging(directory, self.run_id[:8], run=self.run_id, step=self.global_step, validation=validation)
            self.write_model(staging, state_dict)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(staging))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            commit_staging(staging, directory, overwrite=True)
            if self.config.save_total_limit:
                prune_checkpoints(self.config.output_dir, self.run_id, self.config.save_total_limit,
                                  protect=self.best_model_checkpoint)
            self.write_best_record()
        self.accelerator.wait_for_everyone()
        self.last_checkpoint = (self.global_step, directory)
        return directory

    def resume(self, checkpoint: Path) -> None:
        """Restore what `save_checkpoint` wrote: weights, optimizer, scheduler, RNGs and the trainer's progress."""
        for file in sorted(checkpoint.glob("custom_checkpoint_*.pkl")):
            try:  # accelerate unpickles this file without restriction: first make sure it holds only data
                torch.load(file, weights_only=True)
            except pickle.UnpicklingError as error:
                raise ConfigError(f"{file} holds more than tensors and plain values; refusing to resume from it "
                                  f"({error}).") from error
        written_by = len(list(checkpoint.glob("random_states_*.pkl")))  # accelerate writes one per process
        if written_by != self.accelerator.num_processes:
            raise ConfigError(f"Cannot resume from {checkpoint}: it was written by {written_by} process(es), this run "
                              f"has {self.accelerator.num_processes}; launch it with --num_processes {written_by}.")
        self.accelerator.load_state(str(checkpoint))
        if len(self.prompt_order) != len(self.train_dataset):
            raise ConfigError(f"Cannot resume from {checkpoint}: it was trained on {len(self.prompt_order)} prompts, "
                              f"the dataset now has {len(self.train_dataset)}.")
        self.last_checkpoint = (self.global_step, checkpoint)

    def _leave_weights_to_save_pretrained(self, models, weights, output_dir) -> None:
        """accelerate's save_state hook: it would store the full state dict (a LoRA run's frozen base included); the
        checkpoint's save_pretrained files hold the weights instead. (Under FSDP and DeepSpeed accelerate writes
        and reads its own model files and passes no state dicts.)"""
        weights.clear()

    def _load_weights_from_save_pretrained(self, models, input_dir) -> None:
        """accelerate's load_state hook, the counterpart of `_leave_weights_to_save_pretrained`."""
        if models:
            load_saved_weights(self.unwrapped_model, input_dir)
            models.clear()

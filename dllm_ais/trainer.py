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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import LoraConfig, PeftModel, get_peft_model
from tqdm.auto import tqdm
from transformers import get_scheduler

from dllm_ais.checkpoint import atomic_directory, load_model, load_tokenizer, resolve_dtype, special_tokens
from dllm_ais.config import GRPOConfig, save_config
from dllm_ais.correction import correct
from dllm_ais.data import load_task_dataset, tokenize_prompts
from dllm_ais.engine import RolloutEngine
from dllm_ais.evaluation import EvalResult, evaluate_policy
from dllm_ais.launch import check_processes, check_prompt_lengths, check_run_environment
from dllm_ais.loss import grpo_loss, group_advantages
from dllm_ais.metrics import MetricsLog, console_line, plot_metrics
from dllm_ais.policy import AutoregressivePolicy, DiffusionPolicy, Policy, lora_target_modules
from dllm_ais.rewards import resolve_reward_functions, score_rollout
from dllm_ais.sampling.autoregressive import AutoregressiveSamplerConfig
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig
from dllm_ais.sampling.rollout import Rollout
from dllm_ais.tasks import get_task
from dllm_ais.trackers import tracker_init_kwargs


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
        return DiffusionPolicy(sampler, estimator=config.likelihood_estimator, p_mask_prompt=config.p_mask_prompt)
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
    """

    def __init__(self, config: GRPOConfig, model=None, tokenizer=None, reward_funcs: list[Callable] | None = None,
                 train_dataset=None, eval_dataset=None, ais_rule: Callable[[dict], float] | None = None):
        self.config = config.validate()
        check_run_environment(config)
        # No autocast: the trainer computes in its weights' dtype (bf16 on GPU by default), the same dtype as the
        # rollout engine, so the `bf16` engine reproduces the trainer's log-probs exactly. The scheduler steps once
        # per optimizer step whatever the number of processes.
        self.accelerator = Accelerator(
            log_with=config.report_to or None, project_dir=config.output_dir, mixed_precision="no",
            gradient_accumulation_steps=config.gradient_accumulation_steps, step_scheduler_with_optimizer=False)
        check_processes(self.accelerator)
        set_seed(config.seed, device_specific=True)
        self.ais_rule = ais_rule or config.ais_rule
        self.reward_funcs = resolve_reward_functions(reward_funcs or config.reward_funcs or config.task)
        self.train_dataset = train_dataset if train_dataset is not None else load_task_dataset(
            config.task, split="train", path=config.dataset_path, size=config.dataset_size, seed=config.seed)
        self.eval_dataset = eval_dataset if eval_dataset is not None or not config.eval_size else load_task_dataset(
            config.task, split="validation", path=config.dataset_path, size=config.eval_size, seed=config.seed)

        self.tokenizer = tokenizer or load_tokenizer(config.model_name_or_path)
        check_prompt_lengths(self.tokenizer, {"train": self.train_dataset, "eval": self.eval_dataset},
                             config.max_prompt_length)
        model = model or load_model(config.model_name_or_path, resolve_dtype(config.dtype), config.trust_remote_code,
                                    is_trainable=True)
        self.policy = build_policy(config, model.config, self.tokenizer)
        self.greedy_policy = build_policy(config, model.config, self.tokenizer, temperature=0.0)
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
        self.global_step = 0
        self.generation_index = 0
        self.previous_alpha: float | None = None
        self._prompt_order = torch.randperm(len(self.train_dataset), generator=torch.Generator().manual_seed(config.seed))
        self._prompt_cursor = 0

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
            if self._prompt_cursor == len(self._prompt_order):
                self._prompt_cursor = 0
            rows.append(int(self._prompt_order[self._prompt_cursor]))
            self._prompt_cursor += 1
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

    def estimator_seeds(self) -> list[int]:
        """One estimator seed per inner iteration (one-step surrogate) or a single one (exact estimators)."""
        count = self.policy.num_estimator_seeds(self.config.num_iterations)
        base = self.config.seed * 1_000_003 + self.generation_index * 1_009 + self.accelerator.process_index * 7_919_001
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

    def make_generation_batch(self) -> GenerationBatch:
        cfg = self.config
        timings = {"timing/sync_s": self.engine.sync_from(self.unwrapped_model)}
        columns = self.next_prompts()
        generator = torch.Generator(self.accelerator.device).manual_seed(
            cfg.seed + 7919 * self.generation_index + 104_729 * self.accelerator.process_index)
        start = time.perf_counter()
        rollout = self.sample(self.policy, self.engine.model, columns, generator)
        timings["timing/sample_s"] = time.perf_counter() - start

        rewards, reward_metrics = score_rollout(self.tokenizer, self.reward_funcs, columns, rollout, cfg.reward_weights)
        all_rewards = self.accelerator.gather(rewards.to(self.accelerator.device))
        all_advantages = group_advantages(all_rewards, cfg.num_generations, cfg.scale_rewards)
        local = slice(self.accelerator.process_index * len(rewards), (self.accelerator.process_index + 1) * len(rewards))
        advantages = all_advantages[local]

        start = time.perf_counter()
        seeds = self.estimator_seeds()
        self.model.eval()
        with torch.no_grad():
            logp_rollout = [self.micro_batched_logprobs(self.engine.model, rollout, s, rollout_side=True) for s in seeds]
            logp_old = [self.micro_batched_logprobs(self.model, rollout, s) for s in seeds]
        logp_ref = [self.reference_logprobs(rollout, s) for s in seeds]
        timings["timing/logprob_s"] = time.perf_counter() - start

        start = time.perf_counter()
        # Weights and diagnostics (ESS, α, ...) are computed over the whole batch, gathered from every process.
        gather = self.accelerator.gather
        global_mask = gather(rollout.completion_mask.long()).bool()
        corrections = [correct(
            cfg.correction, gather(old), gather(ro), all_advantages, global_mask, clip=cfg.is_clip,
            clip_low=cfg.is_clip_low, level=cfg.is_level, normalize=cfg.is_normalize, kl_scale=cfg.ais_kl_scale,
            rule=self.ais_rule, alpha_max=cfg.ais_alpha_max, previous_alpha=self.previous_alpha,
            alpha_ema=cfg.ais_alpha_ema)
            for old, ro in zip(logp_old, logp_rollout)]
        if cfg.correction == "ais":  # the EMA advances once per generation batch, over its estimator seeds
            self.previous_alpha = sum(c.diagnostics["alpha"] for c in corrections) / len(corrections)
        timings["timing/correction_s"] = time.perf_counter() - start

        lengths = rollout.completion_mask.sum(1).float()
        metrics = {
            "reward": all_rewards.mean().item(),
            "reward_std": all_rewards.view(-1, cfg.num_generations).std(1).mean().item(),
            "completions/mean_length": lengths.mean().item(),
            **({} if rollout.num_steps is None else {"completions/mean_steps": rollout.num_steps.float().mean().item()}),
            **reward_metrics, **timings,
        }
        self.generation_index += 1
        return GenerationBatch(rollout, advantages, logp_old, logp_ref, [c.weights[local] for c in corrections],
                               [None if c.clip_scale is None else c.clip_scale[local] for c in corrections],
                               [c.diagnostics for c in corrections], seeds, metrics)

    def optimisation_pass(self, batch: GenerationBatch, iteration: int) -> dict[str, float]:
        """One optimizer step over the generation batch: gradient accumulation over its micro-batches.

        accelerate divides each micro-batch loss by gradient_accumulation_steps; `dapo` already normalises by the
        token count of the whole generation batch (averaged over processes), so its loss is scaled back up.
        """
        cfg = self.config
        k = iteration % len(batch.seeds)
        self.model.train()
        local_tokens = batch.rollout.completion_mask.sum().float()
        total_tokens = self.accelerator.gather(local_tokens.reshape(1)).mean().clamp(min=1).item()
        micro_batches = self.micro_batches(len(batch.advantages))
        summed: dict[str, float] = {f"correction/{key}": value for key, value in batch.diagnostics[k].items()}
        grad_norm = None
        for j, rows in enumerate(micro_batches):
            with self.accelerator.accumulate(self.model):
                part = batch.rollout.select(rows)
                logp = self.policy.logprobs(self.model, part, micro_seed(batch.seeds[k], j))
                loss, loss_metrics = grpo_loss(
                    logp, batch.logp_old[k][rows], batch.advantages[rows], part.completion_mask,
                    weights=batch.weights[k][rows],
                    clip_scale=None if batch.clip_scale[k] is None else batch.clip_scale[k][rows],
                    logp_ref=None if batch.logp_ref[k] is None else batch.logp_ref[k][rows],
                    beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, loss_type=cfg.loss_type,
                    max_completion_length=cfg.max_completion_length, num_items_in_batch=total_tokens,
                    ratio_type=cfg.ratio_type)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"Non-finite loss at step {self.global_step + 1}: check the log-probs (NaN weights or "
                        "log-probs usually mean an overflow in low precision; try dtype=float32 or a lower learning_rate).")
                scale = len(micro_batches) if cfg.loss_type == "dapo" else 1
                self.accelerator.backward(loss * scale)
                if self.accelerator.sync_gradients:
                    grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            summed["loss"] = summed.get("loss", 0.0) + loss.item() * scale / len(micro_batches)
            for key, value in loss_metrics.items():
                summed[key] = summed.get(key, 0.0) + value / len(micro_batches)
        self.scheduler.step()
        self.global_step += 1
        # DeepSpeed clips inside its engine and reports no norm here.
        return {**summed, "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                "learning_rate": self.scheduler.get_last_lr()[0]}

    # ----------------------------------------------------------------------------------------------- driver
    def evaluate(self, dataset=None) -> EvalResult:
        """Per-prompt rewards and accuracy of greedy completions of the trainer's (full-precision) policy on the
        held-out (validation) prompts."""
        self.model.eval()
        return evaluate_policy(self.unwrapped_model, self.tokenizer, self.greedy_policy,
                               dataset if dataset is not None else self.eval_dataset, self.reward_funcs,
                               self.config.reward_weights, self.config.per_device_train_batch_size,
                               self.config.max_prompt_length, accuracy=get_task(self.config.task).accuracy)

    def train(self) -> TrainResult:
        cfg = self.config
        output_dir = Path(cfg.output_dir)
        is_main = self.accelerator.is_main_process
        log = MetricsLog(output_dir) if is_main else None
        if is_main:
            save_config(cfg, output_dir / "config.yaml")
        if cfg.report_to:
            self.accelerator.init_trackers("dllm-ais", config=cfg.to_dict(),
                                           init_kwargs=tracker_init_kwargs(cfg.run_name, cfg.output_dir))
        eval_before = self.evaluate() if self.eval_dataset is not None else None
        if eval_before and is_main:
            tqdm.write(f"held-out reward before training: {eval_before.summary()['eval/reward']:.4f}")
        progress = tqdm(total=cfg.max_steps, desc="GRPO", disable=not is_main, dynamic_ncols=True)
        while self.global_step < cfg.max_steps:
            start = time.perf_counter()
            batch = self.make_generation_batch()
            batch.metrics["timing/generation_batch_s"] = time.perf_counter() - start
            for iteration in range(cfg.num_iterations):
                if self.global_step >= cfg.max_steps:
                    break
                start = time.perf_counter()
                metrics = {"step": self.global_step + 1, **batch.metrics, **self.optimisation_pass(batch, iteration)}
                metrics["timing/optimisation_pass_s"] = time.perf_counter() - start
                progress.update(1)
                if is_main and self.global_step % cfg.logging_steps == 0:
                    log.write(metrics)
                    progress.set_postfix(reward=f"{metrics['reward']:.3f}",
                                         alpha=f"{metrics.get('correction/alpha', 0.0):.2f}")
                    tqdm.write(console_line(self.global_step, cfg.max_steps, metrics))
                if cfg.report_to:
                    self.accelerator.log(metrics, step=self.global_step)
                if cfg.save_steps and self.global_step % cfg.save_steps == 0:
                    self.save(output_dir / f"checkpoint-{self.global_step}")
        progress.close()
        eval_after = self.evaluate() if self.eval_dataset is not None else None
        self.save(output_dir / "final")
        if is_main:
            if eval_after:
                before, after = eval_before.summary(), eval_after.summary()
                log.write({"step": self.global_step, **{f"{k}_before": v for k, v in before.items()}, **after})
                tqdm.write(f"held-out reward: before {before['eval/reward']:.4f} -> after {after['eval/reward']:.4f} "
                           f"({eval_after.num_prompts} prompts, greedy)")
            plot = plot_metrics(log.records, output_dir / "metrics.png")
            log.close()
            tqdm.write(f"metrics: {log.path}" + (f" | plot: {plot}" if plot else "") + f" | model: {output_dir / 'final'}")
        if cfg.report_to:
            self.accelerator.end_training()
        return TrainResult(self.global_step, log.records if log else [], eval_before, eval_after, output_dir)

    def save(self, directory: Path) -> None:
        """Write the adapter (or full model), tokenizer, config and trainer state atomically into `directory`."""
        self.accelerator.wait_for_everyone()
        state_dict = self.accelerator.get_state_dict(self.model)  # collective under FSDP / ZeRO-3: every rank calls it
        if not self.accelerator.is_main_process:
            return
        with atomic_directory(directory) as staging:
            self.unwrapped_model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
            self.tokenizer.save_pretrained(staging)
            save_config(self.config, staging / "dllm_ais_config.yaml")
            torch.save({"global_step": self.global_step, "generation_index": self.generation_index,
                        "previous_alpha": self.previous_alpha, "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, staging / "trainer_state.pt")

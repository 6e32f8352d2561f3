"""The rules a `GRPOConfig` obeys beyond each field's own checks: what it names must exist (`reference_problems`),
and the rules across fields and settings groups (`cross_field_problems`), one small function per stage they
constrain. Each rule is (holds, message naming the fields and the fix); each function returns its broken rules'
messages. `config` is a `dllm_ais.config.GRPOConfig` throughout (not imported: the config imports these rules).

This module imports nothing heavy: `dllm-ais --help` must not import torch.
"""

from __future__ import annotations

from typing import Any

from dllm_ais.choices import (BATCH_SCALED_PRECISIONS, SEQUENCE_ESTIMATORS, TRAJECTORY_ESTIMATORS, block_fraction_problem,
                              editing_estimator_problem, routing_record_problem, routing_replay_problem)
from dllm_ais.trackers import TRACKERS
from dllm_ais.validation import model_path_problem, path_kind, show

Rule = tuple[bool, str]


def broken(rules: list[Rule]) -> list[str]:
    """The messages of the rules that do not hold."""
    return [message for holds, message in rules if not holds]


def cross_field_problems(config: Any) -> list[str]:
    """Every rule across fields and groups that `config` (well-typed field by field) breaks, stage by stage."""
    return [problem for stage_rules in (loss_rules, decoding_rules, editing_rules, likelihood_rules, precision_rules,
                                        mixed_fidelity_rules, complete_ratio_rules, run_rules)
            for problem in stage_rules(config)]


def loss_rules(config: Any) -> list[str]:
    """Whole GRPO groups on each device, and a loss that can leave groups out."""
    return broken([
        (config.generation_batch_size % config.num_generations == 0,
         f"per_device_train_batch_size * gradient_accumulation_steps = {config.generation_batch_size} must be divisible "
         f"by num_generations={config.num_generations} (whole groups per device)"),
        (not config.drop_zero_std_groups or config.beta == 0,
         f"drop_zero_std_groups leaves out groups whose KL term (beta={config.beta}) still has a gradient: set "
         "beta=0, or drop_zero_std_groups=false"),
    ])


def decoding_rules(config: Any) -> list[str]:
    """A diffusion decoder's blocks and steps fit the completion, and one parallel-decoding rule."""
    rollout = config.rollout
    experimental = config.experimental
    diffusion = config.policy != "autoregressive"
    return broken([
        (not diffusion or config.max_completion_length % rollout.block_length == 0,
         f"max_completion_length={config.max_completion_length} must be a multiple of rollout.block_length="
         f"{rollout.block_length}"),
        (rollout.threshold is None or experimental.rollout_factor is None,
         "rollout.threshold and experimental.rollout_factor are two parallel-decoding rules: set one of them"),
        (not diffusion or rollout.steps % max(config.max_completion_length // rollout.block_length, 1) == 0,
         f"rollout.steps={rollout.steps} must be a multiple of the number of blocks, max_completion_length / "
         f"rollout.block_length = {config.max_completion_length // rollout.block_length} (the exact decoder, which "
         "held-out evaluation and the exact-order experiments use, follows its fixed schedule)"),
        (not diffusion or rollout.block_length % 2 == 0 or rollout.block_length >= config.max_completion_length,
         f"rollout.block_length={rollout.block_length} must be even: held-out validation decodes with d1's "
         f"protocol, max_completion_length / 2 = {config.max_completion_length // 2} steps, a whole number per block"),
        (not diffusion or rollout.steps <= config.max_completion_length,
         f"rollout.steps={rollout.steps} must be <= max_completion_length={config.max_completion_length} "
         "(at most one denoising step per token)"),
    ])


def editing_rules(config: Any) -> list[str]:
    """Token editing (rollout.editing_threshold, LLaDA2.1's decoder): no drawn commit choice, and a trajectory-type
    estimator only as the rollout decoder's replay, the one replay that scores every write. (rollout.threshold is the
    rollout group's own rule; the block-causal family is checked against the model when the run builds its policy.)"""
    rollout = config.rollout
    experimental = config.experimental
    estimator = config.likelihood.estimator
    if rollout.editing_threshold is None or config.policy == "autoregressive":
        return []
    return broken([
        (experimental.rollout_position_temperature == 0,
         f"rollout.editing_threshold with experimental.rollout_position_temperature="
         f"{experimental.rollout_position_temperature}: a drawn commit choice is not defined for edits: set "
         "experimental.rollout_position_temperature=0, or rollout.editing_threshold=null"),
        (not experimental.complete_ratio,
         "rollout.editing_threshold with experimental.complete_ratio: the commit ratio has no term for edits: set "
         "experimental.complete_ratio=false, or rollout.editing_threshold=null"),
        (estimator not in TRAJECTORY_ESTIMATORS or config.replays_decoder, editing_estimator_problem(estimator)),
    ])


def likelihood_rules(config: Any) -> list[str]:
    """The likelihood estimator fits the ratio type, its masks, the order it replays and the routing it replays."""
    likelihood = config.likelihood
    experimental = config.experimental
    block_fraction = block_fraction_problem(experimental.likelihood_block_fraction, likelihood.estimator)
    routing = None if not experimental.routing_replay else routing_replay_problem(
        likelihood.estimator, experimental.likelihood_order, config.replays_decoder, config.rollout.precision_flow,
        config.rollout.precision, config.gradient_checkpointing, config.policy != "autoregressive")
    record = None if not experimental.routing_record else routing_record_problem(
        config.replays_decoder and config.policy != "autoregressive", experimental.routing_replay,
        config.rollout.compile, config.gradient_checkpointing, config.rollout.cfg_scale)
    return broken([
        (experimental.ratio_type != "ctpo" or likelihood.estimator not in SEQUENCE_ESTIMATORS,
         f"likelihood.estimator={likelihood.estimator} is sequence-level (one ratio per completion): set "
         "experimental.ratio_type=token, or a token-level estimator (one_step, trajectory, step_merge) for ctpo"),
        (not (likelihood.estimator == "spg" and likelihood.spg_block_masking and experimental.elbo_coupled),
         "experimental.elbo_coupled pairs random masks and likelihood.spg_block_masking draws block masks: set one "
         "of them to false"),
        (block_fraction is None, block_fraction),
        (experimental.likelihood_block_fraction == 1 or experimental.ratio_type == "token",
         f"experimental.likelihood_block_fraction={experimental.likelihood_block_fraction} scores some tokens "
         f"only, and ratio_type={experimental.ratio_type}'s prefix needs every token: set experimental.ratio_type="
         "token, or experimental.likelihood_block_fraction=1"),
        (experimental.likelihood_order == "rollout" or likelihood.estimator in TRAJECTORY_ESTIMATORS,
         f"experimental.likelihood_order={experimental.likelihood_order} orders the trajectory estimator's "
         f"replay: set likelihood.estimator to one of {', '.join(TRAJECTORY_ESTIMATORS)}, or "
         "experimental.likelihood_order=rollout"),
        (routing is None, routing),
        (record is None, record),
    ])


def precision_rules(config: Any) -> list[str]:
    """The unified precision flow computes one set of numbers for the sampler and the trainer."""
    rollout = config.rollout
    likelihood = config.likelihood
    diffusion = config.policy != "autoregressive"
    return broken([
        (not (rollout.precision_flow == "unified" and rollout.precision in BATCH_SCALED_PRECISIONS and diffusion
              and likelihood.estimator in TRAJECTORY_ESTIMATORS),
         f"rollout.precision={rollout.precision} scales activations over the whole batch, and "
         f"likelihood.estimator={likelihood.estimator} takes ℓ_rollout from the sampler's batch while the trainer "
         "replays micro-batches, so the unified flow would not compute one set of numbers: use a per-row or "
         "per-block notch (fp8, mxfp4, ...), likelihood.estimator=one_step, or rollout.precision_flow=split"),
    ])


def mixed_fidelity_rules(config: Any) -> list[str]:
    """Decoding some groups with another decoder (experimental.rollout_fidelity, rollout_exact_fraction) needs a
    fast decoder to move from, a ratio that sees it, and no replay of the configured decoder."""
    experimental = config.experimental
    diffusion = config.policy != "autoregressive"
    return broken([
        (not config.replays_decoder or experimental.rollout_exact_fraction == 0,
         f"experimental.rollout_exact_fraction={experimental.rollout_exact_fraction} decodes some groups exactly, "
         "but experimental.likelihood_decoder=rollout replays every completion with the configured (cached) "
         "decoder: set experimental.likelihood_decoder=exact, or experimental.rollout_exact_fraction=0"),
        (experimental.rollout_fidelity == "fixed" or (diffusion and config.fast_rollouts),
         f"experimental.rollout_fidelity={experimental.rollout_fidelity} moves between a fast diffusion decoder "
         "and the exact one: set rollout.cache, rollout.threshold or experimental.rollout_factor, or "
         "experimental.rollout_fidelity=fixed"),
        (experimental.rollout_fidelity == "fixed" or not diffusion or config.ratio_sees_decoder,
         f"experimental.rollout_fidelity={experimental.rollout_fidelity} reacts to the decoder's mismatch, which "
         "only the trajectory estimator's ratio sees: set likelihood.estimator=trajectory, "
         "experimental.likelihood_order=rollout and experimental.likelihood_decoder=exact, or "
         "experimental.rollout_fidelity=fixed"),
        (experimental.rollout_exact_fraction == 0 or (diffusion and config.fast_rollouts),
         f"experimental.rollout_exact_fraction={experimental.rollout_exact_fraction} mixes exact with fast "
         "diffusion rollouts: set rollout.cache, rollout.threshold or experimental.rollout_factor, or "
         "experimental.rollout_exact_fraction=0"),
        (not config.correction.bypass_mode or experimental.rollout_fidelity == "fixed",
         f"experimental.rollout_fidelity={experimental.rollout_fidelity} reads the mismatch before the update, "
         "which correction.bypass_mode measures during it: set experimental.rollout_fidelity=fixed, or "
         "correction.bypass_mode=false"),
    ])


def complete_ratio_rules(config: Any) -> list[str]:
    """The complete ratio (experimental.complete_ratio) and the recorded commit choice (the stochastic commit
    rule, experimental.rollout_position_temperature > 0; commit_choice_as_set; commit_choice_gradient): the
    study knobs of the commit choice's probability, behind the experimental door together."""
    rollout = config.rollout
    likelihood = config.likelihood
    experimental = config.experimental
    diffusion = config.policy != "autoregressive"
    correction = config.correction
    return broken([
        (not correction.bypass_mode or correction.method == "none" or experimental.complete_ratio,
         f"correction.bypass_mode takes the rollout's log-probs as the old ones, so correction.method="
         f"{correction.method} would see ratios of exactly 1: set correction.method=none (the loss's clipped ratio "
         "then carries the mismatch), experimental.complete_ratio=true (the method weights the commit ratio), or "
         "correction.bypass_mode=false"),
        (not experimental.complete_ratio or (diffusion and likelihood.estimator == "trajectory"
                                                 and experimental.likelihood_order == "rollout"),
         "experimental.complete_ratio multiplies the trajectory's token ratio by the commit choice's: set "
         "likelihood.estimator=trajectory and experimental.likelihood_order=rollout (a diffusion policy), or "
         "experimental.complete_ratio=false"),
        (not experimental.complete_ratio or (experimental.rollout_position_temperature > 0
                                                 and experimental.rollout_factor is None),
         "experimental.complete_ratio needs a commit choice with a probability: set "
         "experimental.rollout_position_temperature > 0 (Gumbel-top-k commits, or with rollout.threshold "
         "independent commits with probability sigmoid((confidence - threshold) / T)) and leave "
         "experimental.rollout_factor unset, or experimental.complete_ratio=false"),
        (not experimental.complete_ratio or (experimental.rollout_fidelity == "fixed"
                                                 and experimental.rollout_exact_fraction == 0),
         "experimental.complete_ratio replays every completion with the configured decoder, and "
         "experimental.rollout_fidelity / rollout_exact_fraction decode some with another: set "
         "experimental.rollout_fidelity=fixed and experimental.rollout_exact_fraction=0, or "
         "experimental.complete_ratio=false"),
        (not experimental.commit_choice_as_set or (experimental.rollout_position_temperature > 0
                                                    and rollout.threshold is None
                                                    and experimental.rollout_factor is None
                                                    and rollout.schedule == "even"),
         "experimental.commit_choice_as_set scores a fixed count's drawn positions as a set: set "
         "experimental.rollout_position_temperature > 0, rollout.threshold=null, no experimental.rollout_factor "
         "and rollout.schedule=even, or experimental.commit_choice_as_set=false"),
        (not experimental.commit_choice_gradient or (diffusion and config.replays_decoder
                                                      and experimental.rollout_position_temperature > 0
                                                      and experimental.rollout_factor is None),
         "experimental.commit_choice_gradient differentiates the commit choice's log-prob from the replayed "
         "decoder's logits: set likelihood.estimator=trajectory, a rollout.cache (prefix or dual) with "
         "experimental.likelihood_decoder=rollout, experimental.rollout_position_temperature > 0 and no "
         "experimental.rollout_factor, or experimental.commit_choice_gradient=false"),
        (not experimental.commit_choice_gradient or (config.beta == 0 and experimental.rollout_fidelity == "fixed"
                                                      and experimental.rollout_exact_fraction == 0),
         "experimental.commit_choice_gradient needs every completion decoded by the configured decoder and no "
         "KL term (whose reference log-probs hold no commit choice): set beta=0, "
         "experimental.rollout_fidelity=fixed and experimental.rollout_exact_fraction=0, or "
         "experimental.commit_choice_gradient=false"),
    ])


def run_rules(config: Any) -> list[str]:
    """The run's output, held-out evaluation, reward weights and trackers."""
    return broken([
        (not (config.overwrite_output_dir and config.resume_from_checkpoint not in (None, False)),
         "resume_from_checkpoint continues the run in output_dir; overwrite_output_dir=true starts afresh: set one"),
        (config.eval_steps == 0 or config.eval_size > 0,
         f"eval_steps={config.eval_steps} scores the validation split: set eval_size > 0, or eval_steps=0"),
        (not (config.eval_steps and config.save_steps) or config.save_steps % config.eval_steps == 0,
         f"save_steps={config.save_steps} must be a multiple of eval_steps={config.eval_steps}, so that every "
         "checkpoint has a validation score to be ranked by"),
        (config.reward_weights is None or config.reward_funcs is not None,
         "reward_weights needs reward_funcs (one weight per function)"),
        (config.reward_weights is None or config.reward_funcs is None or len(config.reward_weights) == len(config.reward_funcs),
         "reward_weights must have one entry per reward function"),
        (not set(config.report_to) - set(TRACKERS),
         f"report_to={show(config.report_to)}: supported trackers are {', '.join(TRACKERS)} (or none, all)"),
    ])


def reference_problems(config: Any, invalid: set[str]) -> list[str]:
    """What the config names must exist: a local model directory, the dataset file, the task's settings
    (`task_args`), reward and remasking names.

    Fields in `invalid` (already reported; a group's as ``group.field``) are skipped.
    """
    from dllm_ais.rewards import resolve_reward_functions
    from dllm_ais.tasks import get_task
    from dllm_ais.sampling.diffusion import resolve_remasking_rule

    problems = []
    if "model_name_or_path" not in invalid:
        problems.append(model_path_problem(config.model_name_or_path))
    if not {"dataset_path", "task"} & invalid:
        if config.dataset_path is not None and path_kind(config.dataset_path) in ("missing", "invalid"):
            problems.append(f"dataset_path={show(config.dataset_path)}: no such file or directory")
        task = get_task(config.task)
        if "task_args" not in invalid:
            problems.extend(task.task_args_problems(config.task_args))
        if task.generate is not None and config.dataset_path is not None:
            problems.append(f"dataset_path: the {task.name} task is generated and reads no files; leave dataset_path "
                            "unset")
        elif task.generate is None and task.hub_train is None and task.hub_test is None and config.dataset_path is None:
            problems.append(f"task={config.task} has no default dataset: set dataset_path to a local file of its rows")
    if "output_dir" not in invalid and path_kind(config.output_dir) in ("file", "invalid"):
        problems.append(f"output_dir={show(config.output_dir)}: not a usable directory path (a file, or an invalid name)")
    # `module:function` names are imported only when a run starts (GRPOTrainer), never while reading a config.
    for name in [] if "reward_funcs" in invalid else config.reward_funcs or []:
        try:
            if ":" not in name:
                resolve_reward_functions([name])
            elif not all(name.partition(":")[::2]):
                raise ValueError("write 'package.module:function'")
        except ValueError as error:
            problems.append(f"reward_funcs: {show(name)}: {error}")
    if "rollout.remasking" not in invalid:
        try:
            resolve_remasking_rule(config.rollout.remasking)
        except ValueError as error:
            problems.append(f"rollout.remasking={show(config.rollout.remasking)}: {error}")
    return [problem for problem in problems if problem]

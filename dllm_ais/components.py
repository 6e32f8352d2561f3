"""The collaborators of a GRPO step, built from a validated config: the policy (sampler + estimator), the trainer's
model (LoRA-wrapped, prepared by accelerate), the rollout engine, the reference model, optimizer and scheduler."""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.tensor import DTensor
from transformers import get_scheduler

from dllm_ais.config import ConfigError, GRPOConfig
from dllm_ais.engine import RolloutEngine, adapter_host, quantize_trainer_model_
from dllm_ais.loading import keep_freed_host_memory, load_model, resolve_dtype
from dllm_ais.models.routing import EngineRouting, routed_layers
from dllm_ais.validation import problem_list
from dllm_ais.policy import (CustomSampler, DiffusionPolicy, Policy, build_policy,
                             custom_policy_problems, is_diffusion, lora_target_modules,
                             lora_target_parameters)


@dataclass
class StepComponents:
    """What one GRPO step works with. `model` is the prepared (possibly wrapped or sharded) trainer model;
    `reference_model` is None when the reference is the model with its adapter disabled (or when beta = 0).
    `greedy_policy` decodes held-out prompts exactly (d1's protocol, whatever the rollouts use);
    `rollout_sampler_policy` decodes them greedily with the rollout sampler, when that one is fast or custom.
    `routing_replay()` is the context the trainer's likelihood passes run in: `EngineRouting` with
    `experimental.routing_replay`, else nothing."""

    accelerator: Accelerator
    policy: Policy
    greedy_policy: Policy
    rollout_sampler_policy: Policy | None
    model: torch.nn.Module
    engine: RolloutEngine
    reference_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    routing_replay: Callable[[], AbstractContextManager] = nullcontext

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    @property
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters as prepared (sharded under FSDP)."""
        return [p for p in self.model.parameters() if p.requires_grad]


def make_accelerator(config: GRPOConfig) -> Accelerator:
    """No autocast: the trainer computes in its weights' dtype (bf16 on GPU by default), the same dtype as the rollout
    engine, so the `bf16` engine reproduces the trainer's log-probs exactly. The scheduler steps once per optimizer
    step whatever the number of processes."""
    return Accelerator(log_with=config.report_to or None, project_dir=config.output_dir, mixed_precision="no",
                       gradient_accumulation_steps=config.gradient_accumulation_steps,
                       step_scheduler_with_optimizer=False)


def training_policies(config: GRPOConfig, model_config, tokenizer, sampler: CustomSampler | None = None,
                      policy: Policy | None = None) -> tuple[Policy, Policy, Policy | None]:
    """The run's policies: the one it samples and scores with, the exact greedy decoder of held-out validation, and
    the greedy decoder of the run's own sampler when that is not d1's protocol (scored after training as
    `eval/rollout_sampler/*`).

    The first is built from the config, or around `sampler` (a `MaskedDiffusionSampler` subclass or instance,
    `build_policy`), or is `policy` itself (any `Policy`). Validation always decodes with d1's protocol
    (`GRPOConfig.decoding`: LLaDA's own algorithm, greedy, low-confidence remasking, max_completion_length / 2 steps,
    no cache, no parallel commits, no guidance), whatever samples the rollouts. The own sampler's score exists for
    rollouts that decode otherwise (a cache, parallel commits, another order or step count, guidance) and for every
    custom sampler (`sampler=`, or a `DiffusionPolicy` as `policy=`): its greedy copy
    (`MaskedDiffusionSampler.with_config`); a `policy` of another kind has none. Raises ConfigError naming what
    `sampler`/`policy` get wrong (`custom_policy_problems`) or a refusal of `DiffusionPolicy` (an estimator that
    cannot score the sampler).
    """
    problems = custom_policy_problems(config, model_config, tokenizer, sampler, policy)
    if problems:
        raise ConfigError(problem_list("Cannot start the run:", problems))
    greedy_policy = build_policy(config.decoding(exact=True), model_config, tokenizer, temperature=0.0)
    if isinstance(policy, DiffusionPolicy):
        sampler = policy.sampler
    try:
        run_policy = policy or build_policy(config, model_config, tokenizer, sampler=sampler)
    except ValueError as error:
        raise ConfigError(problem_list("Cannot start the run:", [str(error)])) from error
    own_sampler_policy = None
    rollouts_decode_otherwise = (is_diffusion(config.policy, getattr(model_config, "model_type", None))
                                 and config.decoding(exact=False) != config.decoding(exact=True))
    if sampler is not None or (policy is None and rollouts_decode_otherwise):
        own_sampler_policy = build_policy(config.decoding(exact=False), model_config, tokenizer, temperature=0.0,
                                          sampler=sampler)
    return run_policy, greedy_policy, own_sampler_policy


def high_precision_base(config: GRPOConfig, device: torch.device) -> torch.nn.Module:
    """The run's model as loaded, in its high precision (eval mode): with the unified precision flow, the trainer's
    quantized model before training, as the split flow's trainer holds it. `with_trained_weights_` then gives it the
    run's adapter (or fully fine-tuned weights): the trained policy on the high-precision base."""
    model = load_model(config.model_name_or_path, resolve_dtype(config.dtype), config.trust_remote_code)
    return model.to(device).eval().requires_grad_(False)


def with_trained_weights_(model: torch.nn.Module, trained: torch.nn.Module) -> torch.nn.Module:
    """`model` (`high_precision_base`) given what `trained` (the unified flow's trainer model) learned: its LoRA
    adapter — `model` wrapped as `trained` is — or, fully fine-tuned, its high-precision master weights. The
    quantized base layers `trained` holds outside its state dict stay `model`'s high-precision ones."""
    if isinstance(trained, PeftModel):
        model = get_peft_model(model, copy.deepcopy(trained.peft_config[trained.active_adapter]))
    state = {name: value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2: gathered on every process
             for name, value in trained.state_dict().items()}
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"the trained model holds weights the high-precision base lacks: {result.unexpected_keys[:3]}")
    return model.eval().requires_grad_(False)


def check_unified_flow_launch(accelerator: Accelerator) -> None:
    """Refuse, in one line, a launch the unified precision flow does not run under: DeepSpeed (it owns the parameters
    the engine would sample with).

    Under FSDP each forward of the sharded trainer gathers its weights on every process at once, so every process must
    run the same forwards. The samplers see to it for sampling (every host read that decides how many forwards run is
    agreed across the processes: `dllm_ais.sampling.forwards.EagerForwards.agreed`), for parallel decoding,
    block-causal models and autoregressive decoding alike; the likelihood passes do for theirs (the decoder replay's
    steps, the exact trajectory replay's forwards: `dllm_ais.likelihood.trajectory`), in the backward too."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ConfigError("rollout.precision_flow=unified runs single-process, under DDP or under FSDP, not under "
                          "DeepSpeed: launch with recipes/accelerate/ddp.yaml, or set rollout.precision_flow=split")


def lora_config(config: GRPOConfig, model_type: str) -> LoraConfig:
    """The run's LoRA: `lora_target_modules` and `lora_target_parameters` (each None = the model type's preset).
    ConfigError when parameters are targeted with lora_dropout > 0 (peft cannot drop out inside a stacked weight)."""
    modules = config.lora_target_modules or lora_target_modules(model_type)
    parameters = (lora_target_parameters(model_type) if config.lora_target_parameters is None
                  else list(config.lora_target_parameters))
    if parameters and config.lora_dropout > 0:
        raise ConfigError(f"lora_dropout={config.lora_dropout} with LoRA on parameters {parameters} (model_type "
                          f"{model_type!r}): peft adapts them without dropout; set lora_dropout: 0.0, or "
                          "lora_target_parameters: [] to leave them frozen")
    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=modules, target_parameters=parameters or None)


def build_components(config: GRPOConfig, tokenizer, accelerator: Accelerator, model=None,
                     sampler: CustomSampler | None = None, policy: Policy | None = None) -> StepComponents:
    """Load the model (unless given), build the policies (`training_policies`: from the config, or around `sampler`,
    or `policy` as given), wrap the model in LoRA (`use_peft`), copy the reference (full fine-tuning with beta > 0)
    and the rollout engine, and prepare model, AdamW and the scheduler with `accelerator`."""
    keep_freed_host_memory(accelerator.device)
    model = model or load_model(config.model_name_or_path, resolve_dtype(config.dtype), config.trust_remote_code,
                                is_trainable=True)
    policy, greedy_policy, rollout_sampler_policy = training_policies(config, model.config, tokenizer, sampler, policy)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if config.use_peft and not isinstance(model, PeftModel):
        model = get_peft_model(model, lora_config(config, model.config.model_type))
    model.to(accelerator.device)
    reference_model = None
    if config.beta > 0 and not isinstance(model, PeftModel):
        reference_model = copy.deepcopy(model).eval().requires_grad_(False)
    flow = config.rollout.precision_flow
    if flow == "unified":
        check_unified_flow_launch(accelerator)
        if reference_model is not None:
            quantize_trainer_model_(reference_model, config.rollout.precision)
    engine = RolloutEngine(model, precision=config.rollout.precision, compile=config.rollout.compile,
                           precision_flow=flow)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay,
                                  betas=(config.adam_beta1, config.adam_beta2))
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=config.warmup_steps,
                              num_training_steps=config.max_steps)
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None and deepspeed.deepspeed_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        # accelerate reads DeepSpeed's micro-batch from a prepared dataloader, and the trainer prepares none
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = config.per_device_train_batch_size
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return StepComponents(accelerator, policy, greedy_policy, rollout_sampler_policy, model, engine, reference_model,
                          optimizer, scheduler, engine_routing_replay(config, model, engine))


def engine_routing_replay(config: GRPOConfig, model: torch.nn.Module,
                          engine: RolloutEngine) -> Callable[[], AbstractContextManager]:
    """The trainer's likelihood passes' context: with `experimental.routing_replay`, the prepared `model`'s forwards
    route by the rollout engine's expert selection (`EngineRouting`); with `experimental.routing_record` nothing (the
    decoder replay forces the rollout's record: `dllm_ais.sampling.diffusion.routing_record`); ConfigError when the
    model has no experts."""
    setting = next((name for name in ("routing_replay", "routing_record") if getattr(config.experimental, name)), None)
    if setting is None:
        return nullcontext
    host = adapter_host(model)
    if not routed_layers(host):
        raise ConfigError(f"experimental.{setting} replays a mixture of experts' routing, and "
                          f"{config.model_name_or_path} ({host.config.model_type}) has none: set "
                          f"experimental.{setting}=false")
    if setting == "routing_record":  # recorded while sampling, forced by the decoder replay itself
        return nullcontext
    return partial(EngineRouting, host, engine.model)

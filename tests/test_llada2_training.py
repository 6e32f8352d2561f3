"""LLaDA2 (llada2_moe) through the GRPO trainer: every estimator and correction on a tiny random LLaDA2 MoE, FP8
rollouts with FP8 experts, the LoRA preset (attention, dense and shared MLPs, the stacked experts; the router
frozen unless named), the exact cache's recorded log-probs against the trainer's replay (k3 = 0 with a bf16 engine),
and exact resume of a LoRA run."""

import json
import math

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from conftest import config_of
from dllm_ais.components import lora_config
from dllm_ais.config import ConfigError
from dllm_ais.dry_run import stand_in_model
from dllm_ais.engine import RolloutEngine, merged_state_items
from dllm_ais.models.llada2 import LLaDA2MoeExperts, plain_grouped_mm
from dllm_ais.quantization import fp8_grouped_mm
from dllm_ais.tasks.digits import digits_reward, make_digits_dataset
from dllm_ais.trainer import GRPOTrainer
from test_sdar_training import distinct_characters
from test_trainer import lora_parameters

BLOCK = 4
LLADA2_TINY = dict(task="digits", eval_size=0, num_generations=2, per_device_train_batch_size=4,
                   gradient_accumulation_steps=1, max_completion_length=8, num_iterations=2, max_steps=2, lora_r=4,
                   lora_alpha=8, lora_dropout=0.0, learning_rate=1e-3, max_prompt_length=64, temperature=1.0,
                   dtype="float32", weight_decay=0.0, rollout={"block_length": BLOCK, "steps": 4})
EXPERT_STACKS = ("gate_up_proj", "down_proj")


def tiny_llada2(tokenizer):
    return stand_in_model(True, tokenizer, "llada2_moe", block_size=BLOCK)


def llada2_trainer(tokenizer, tmp_path, model=None, **overrides) -> GRPOTrainer:
    config = config_of(LLADA2_TINY, output_dir=str(tmp_path), **overrides)
    return GRPOTrainer(config, model=model or tiny_llada2(tokenizer), tokenizer=tokenizer,
                       reward_funcs=[distinct_characters, digits_reward], train_dataset=make_digits_dataset(16, seed=1))


def expert_stacks(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()
            if name.rsplit(".", 1)[-1] in EXPERT_STACKS and "lora_" not in name}


def assert_trains(trainer: GRPOTrainer) -> dict:
    """Two training steps: finite losses, gradients, every kind of LoRA weight moved (no weight decay), the router
    and the base experts frozen; returns the last step's record."""
    before = lora_parameters(trainer)
    router = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters() if "mlp.gate." in n}
    history = trainer.train().history
    assert len(history) == 2 and all(math.isfinite(record["loss"]) for record in history)
    assert all(record["frac_reward_zero_std"] < 1 and record["grad_norm"] > 0 for record in history)
    moved = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, value in lora_parameters(trainer).items()
             if not torch.equal(before[name], value)}
    assert {"query_key_value", "dense", "experts"} <= moved, moved
    assert router and all(torch.equal(router[n], p) for n, p in trainer.unwrapped_model.named_parameters()
                          if n in router)
    return history[-1]


@pytest.mark.parametrize("estimator", ["one_step", "trajectory", "step_merge", "elbo", "spg"])
def test_every_estimator_trains_a_llada2_on_policy(tokenizer, tmp_path, estimator):
    """policy auto picks the diffusion policy for model_type llada2_moe; with a bf16 engine (the trainer's weights,
    LoRA on the experts merged) every estimator's rollout side equals ℓ_old, and two steps train."""
    trainer = llada2_trainer(tokenizer, tmp_path, rollout={"precision": "bf16"},
                             likelihood={"estimator": estimator, "segments": 2}, correction={"method": "tis"})
    assert trainer.policy.sampler.config.block_length == BLOCK
    record = assert_trains(trainer)
    assert record["rollout_corr/rollout_is_min"] == pytest.approx(1.0, abs=1e-4)
    assert record["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("correction", [{"method": "none"}, {"method": "tis"}, {"method": "mis"},
                                        {"method": "acr"}, {"method": "ais"},
                                        {"method": "none", "bypass_mode": True}],
                         ids=["none", "tis", "mis", "acr", "ais", "bypass"])
def test_every_correction_trains_a_llada2_with_fp8_rollouts_and_fp8_experts(tokenizer, tmp_path, correction):
    """FP8 rollouts on LLaDA2: the engine quantizes its linears and its stacked experts (the LM head and the router
    kept), and the mismatch shows in k3."""
    trainer = llada2_trainer(tokenizer, tmp_path, rollout={"precision": "fp8"}, correction=correction,
                             likelihood={"estimator": "trajectory"})
    engine = trainer.engine.model
    leaves = {name.rsplit(".", 1)[-1] for name in trainer.engine.quantized_modules}
    assert leaves == {"query_key_value", "dense", "gate_proj", "up_proj", "down_proj", "experts"}
    experts = [m for m in engine.modules() if isinstance(m, LLaDA2MoeExperts)]
    assert experts and all(m.grouped_mm is fp8_grouped_mm and m.gate_up_proj.qdata.dtype == torch.float8_e4m3fn
                           for m in experts)
    assert engine.model.layers[1].mlp.gate.weight.dtype == torch.float32
    record = assert_trains(trainer)
    if not correction.get("bypass_mode"):
        assert record["rollout_corr/k3_kl"] > 0


def test_fp8_experts_follow_the_trainers_merged_experts_after_a_sync(tokenizer, tmp_path):
    """The split engine's FP8 stacks are the trainer's stacks with each expert's LoRA ΔW merged, quantized per row:
    after the LoRA B matrices move, a sync brings the engine's experts (dequantized) to the merged weights within FP8
    rounding, and the FP8 grouped matmul is the plain one on those operands within FP8 error."""
    trainer = llada2_trainer(tokenizer, tmp_path, rollout={"precision": "fp8"})
    with torch.no_grad():
        for name, param in trainer.unwrapped_model.named_parameters():
            if "experts" in name and "lora_B" in name:
                param.normal_(0.0, 0.05)
    merged = {name: value for name, value in merged_state_items(trainer.model) if name.endswith(EXPERT_STACKS)}
    before = {name: value.dequantize().clone() for name, value in trainer.engine.model.named_parameters()
              if name.endswith(EXPERT_STACKS)}
    trainer.engine.sync_from(trainer.model)
    engine = dict(trainer.engine.model.named_parameters())
    assert merged and set(merged) == set(before)
    for name, value in merged.items():
        after = engine[name].dequantize()
        assert not torch.equal(after, before[name])
        assert (after - value).abs().max() <= value.abs().amax(-1, keepdim=True).max() / 8  # e4m3: 3 mantissa bits
    stack = engine[next(iter(merged))]
    rows, ends = torch.randn(12, stack.shape[-1]), torch.tensor([3, 3, 7, 12], dtype=torch.int32)
    exact = plain_grouped_mm(rows, stack.dequantize(), ends)
    assert (fp8_grouped_mm(rows, stack, ends) - exact).abs().max() <= 0.1 * exact.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="torch._scaled_grouped_mm needs a CUDA GPU of compute capability 9.0 or more")
def test_cuda_fp8_grouped_mm_is_the_emulated_one():
    """On Hopper and later the FP8 experts run torch._scaled_grouped_mm: the same per-row FP8 operands as the emulated
    path (uneven and empty groups), so the two agree to bf16 output rounding."""
    from dllm_ais.quantization import quantized_weight

    generator = torch.Generator().manual_seed(0)
    stack = quantized_weight("fp8", torch.randn(4, 64, 128, generator=generator).cuda().bfloat16())
    rows = torch.randn(40, 128, generator=generator).cuda().bfloat16()
    ends = torch.tensor([5, 5, 23, 40], dtype=torch.int32, device="cuda")
    native = fp8_grouped_mm(rows, stack, ends)
    emulated = fp8_grouped_mm(rows.cpu(), quantized_weight("fp8", stack.dequantize().float().cpu()), ends.cpu())
    torch.testing.assert_close(native.float().cpu(), emulated.float(), atol=2e-2, rtol=2e-2)


def test_the_exact_caches_recorded_logprobs_are_the_trainers_trajectory_replay(tokenizer, tmp_path):
    """LLaDA2's cached rollouts (its exact cache of finished blocks) record log-probs the trainer's trajectory replay
    (its [x_t | x_0] training-mode forward) reproduces: k3 = 0 on a bf16 engine, experts and routing included."""
    trainer = llada2_trainer(tokenizer, tmp_path, max_steps=1, rollout={"precision": "bf16", "cache": "prefix"},
                             likelihood={"estimator": "trajectory"}, correction={"method": "ais"},
                             experimental={"likelihood_decoder": "exact"})
    batch = trainer.make_generation_batch()
    torch.testing.assert_close(batch.logp_old[0], batch.rollout.step_logprobs, atol=1e-5, rtol=0)
    assert batch.diagnostics[0]["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)


def test_k3_is_zero_with_a_bfloat16_engine_on_a_bfloat16_trainer(tokenizer, tmp_path):
    """In bfloat16 too: the engine holds the trainer's own bf16 weights and replays the decoder (likelihood_decoder
    rollout), so every recorded log-prob is the trainer's."""
    trainer = llada2_trainer(tokenizer, tmp_path, max_steps=1, dtype="bfloat16", model=tiny_llada2(tokenizer).bfloat16(),
                             rollout={"precision": "bf16", "cache": "prefix"}, likelihood={"estimator": "trajectory"},
                             correction={"method": "ais"}, experimental={"likelihood_decoder": "rollout"})
    batch = trainer.make_generation_batch()
    assert torch.equal(batch.logp_old[0], batch.rollout.step_logprobs)
    assert batch.diagnostics[0]["rollout_corr/k3_kl"] == 0.0


def test_lora_preset_for_llada2_and_the_router_only_when_named(tokenizer, tmp_path):
    trainer = llada2_trainer(tokenizer, tmp_path)
    model = trainer.unwrapped_model
    leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert leaves == {"query_key_value", "dense", "gate_proj", "up_proj", "down_proj", "experts", "base_layer"}
    targeted = {m.parameter_name for m in model.modules() if hasattr(m, "parameter_name")}
    assert targeted == set(EXPERT_STACKS)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "mlp.gate." in n and "lora_" not in n)
    named = lora_config(config_of(LLADA2_TINY, lora_target_parameters=["experts.gate_up_proj", "mlp.gate.weight"]),
                        "llada2_moe")
    assert named.target_parameters == ["experts.gate_up_proj", "mlp.gate.weight"]
    frozen = config_of(LLADA2_TINY, lora_target_parameters=[], lora_dropout=0.05).validate()  # [] = none, valid
    assert lora_config(frozen, "llada2_moe").target_parameters is None
    with pytest.raises(ConfigError, match="lora_dropout=0.05 with LoRA on parameters.*set lora_dropout: 0.0"):
        lora_config(config_of(LLADA2_TINY, lora_dropout=0.05), "llada2_moe")


def test_unified_precision_flow_refuses_fp8_experts(tokenizer):
    model = tiny_llada2(tokenizer)
    with pytest.raises(NotImplementedError, match="stacked experts .*set rollout.precision_flow=split"):
        RolloutEngine(model, "fp8", precision_flow="unified")


def test_a_lora_run_resumes_exactly(tokenizer, tmp_path):
    """A LoRA run on LLaDA2 (adapters on the stacked experts too, FP8 rollouts) resumed from its checkpoint at step 2
    — the experts' adapters restored from it — gives the uninterrupted run's metrics."""
    settings = dict(rollout={"precision": "fp8"}, max_steps=3, num_iterations=2, save_steps=2)
    uninterrupted = llada2_trainer(tokenizer, tmp_path / "a", **settings).train().history
    checkpoint = tmp_path / "a" / "checkpoint-2"
    saved = load_file(checkpoint / "adapter_model.safetensors")
    experts = {name: value for name, value in saved.items() if ".mlp.experts." in name and "lora_B" in name}
    assert experts and all(value.abs().sum() > 0 for value in experts.values())  # trained from zero
    trainer = llada2_trainer(tokenizer, tmp_path / "b", **settings, resume_from_checkpoint=str(checkpoint))
    assert trainer.global_step == 2
    restored = get_peft_model_state_dict(trainer.unwrapped_model)
    for name, value in experts.items():
        torch.testing.assert_close(restored[name], value, atol=0, rtol=0)
    resumed = trainer.train().history
    lines = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]

    def comparable(records):
        return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records]

    assert comparable(resumed) == comparable(lines) == comparable(uninterrupted)

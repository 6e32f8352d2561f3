"""The unified precision flow (`rollout.precision_flow: unified`): the trainer computes with the rollout engine's
quantized numerics, one model shared by both, so the ratio of the two is 1 wherever the flow is exact."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from peft import LoraConfig, get_peft_model
from torch import nn
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked
from torchao.prototype.mx_formats.mx_tensor import MXTensor

from conftest import bare_tiny_llada, config_of
from dllm_ais import grpo
from dllm_ais.choices import BATCH_SCALED_PRECISIONS
from dllm_ais.bench.mismatch import RECIPES, measure_notch, validation_prompts
from dllm_ais.inference_commands import load_for_inference
from dllm_ais.components import check_unified_flow_launch
from dllm_ais.config import EMBEDDED_RECIPE, ConfigError, load_config
from dllm_ais.engine import RolloutEngine
from dllm_ais.loading import load_model, load_tokenizer
from dllm_ais.policy import build_policy, lora_target_modules
from dllm_ais.quantization import (MX_BLOCK_SIZE, PRECISIONS, StraightThroughQuantizedLinear, _mx_round_trip,
                                   _round_to_e2m1, quantize_model_)
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler
from dllm_ais.trainer import GRPOTrainer
from dllm_ais.sampling.diffusion.choice import recorded_choice
from test_trainer import make_trainer

QUANTIZED = tuple(precision for precision in PRECISIONS if precision != "bf16")
MASK, EOS = 127, 126


@pytest.mark.parametrize("precision", QUANTIZED)
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_the_trainers_layer_is_the_engines_forward_with_gradients_straight_through(precision, trainable):
    """Forward: bit for bit the engine's quantized layer (same weight quantizer, same activation quantizer). Backward:
    ∂L/∂x = ∂L/∂y · deq(W_q), and for a trained weight ∂L/∂W = (∂L/∂y)ᵀ x and ∂L/∂b = Σ ∂L/∂y."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    engine = copy.deepcopy(linear)
    quantize_model_(engine, precision, skip=lambda name, module: False)
    trainer_linear = copy.deepcopy(linear).requires_grad_(trainable)
    layer = StraightThroughQuantizedLinear(trainer_linear, precision)
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = layer(x)
    with torch.no_grad():
        assert torch.equal(y, engine(x))
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    torch.testing.assert_close(x.grad, grad_y @ layer.quantized.dequantize())
    if trainable:
        torch.testing.assert_close(layer.weight.grad, grad_y.reshape(-1, 64).T @ x.detach().reshape(-1, 128))
        torch.testing.assert_close(layer.bias.grad, grad_y.reshape(-1, 64).sum(0))
    else:
        assert layer.weight is None and "weight" not in layer.state_dict()


MX_ELEMENTS = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8": torch.float8_e4m3fn}


def bits(tensor):
    """The raw bits of a float tensor (so that -0.0 and 0.0, or two NaN payloads, tell apart)."""
    return tensor.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("precision", list(MX_ELEMENTS))
def test_the_emulated_mx_activation_round_trip_is_torchaos_bit_for_bit(precision, dtype):
    """`_mx_round_trip` = torchao's `MXTensor.to_mx(x, RCEIL).dequantize()`, to the bit, on rows from 1e-40 to 1e38,
    blocks holding every e2m1 tie, zeros of both signs, subnormals, an infinity and a NaN."""
    torch.manual_seed(0)
    x = torch.randn(48, 256) * torch.logspace(-40, 38, 48).unsqueeze(1)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 5.5, 4.5, 2.25, 2.75, 3.25, 3.75, 0.1, 0.0])
    x[0, :32] = torch.cat([ties, -ties])
    x[1, :32], x[1, 32:64], x[2] = 0.0, -0.0, torch.randn(256) * 1e-42
    x[3, 5], x[4, 40], x[5, 70] = float("inf"), float("nan"), -float("inf")
    x = x.to(dtype)
    expected = MXTensor.to_mx(x, MX_ELEMENTS[precision], MX_BLOCK_SIZE,
                              scaling_mode=ScaleCalculationMode.RCEIL).dequantize(dtype)
    got = _mx_round_trip(x, MX_ELEMENTS[precision])
    nan = expected.isnan()
    assert nan.any() and torch.equal(got.isnan(), nan)
    assert torch.equal(bits(got)[~nan], bits(expected)[~nan])


def test_e2m1_rounding_is_torchaos_encoding_on_every_bfloat16_value_and_beside_every_tie():
    """`_round_to_e2m1` = torchao's e2m1 encode then decode, to the bit, on every float32 that is a bfloat16 in
    [-6, 6] and on the float32 neighbours of every midpoint between two e2m1 numbers (ties to the even code)."""
    every_bfloat16 = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    below, above = torch.nextafter(midpoints, torch.zeros(7)), torch.nextafter(midpoints, torch.full((7,), 6.0))
    neighbours = torch.cat([midpoints, below, above])
    values = torch.cat([every_bfloat16[every_bfloat16.abs() <= 6], neighbours, -neighbours])
    expected = f4_unpacked_to_f32(f32_to_f4_unpacked(values))
    assert torch.equal(bits(_round_to_e2m1(values)), bits(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("precision", list(MX_ELEMENTS))
def test_the_emulated_mx_layer_computes_torchaos_logits_and_gradients_bit_for_bit(precision, bias, trainable,
                                                                                   dtype):
    """The unified flow's emulated MX layer (activations by `_mx_round_trip`) against the same layer through
    torchao's emulated kernel (`emulated_mx` off): the same output and the same gradients for the input, the weight
    and the bias, to the bit."""
    torch.manual_seed(0)
    layer = StraightThroughQuantizedLinear(nn.Linear(128, 64, bias=bias, dtype=dtype).requires_grad_(trainable),
                                           precision)
    assert layer.emulated_mx
    x = torch.randn(3, 5, 128, dtype=dtype)
    grad_y = torch.randn(3, 5, 64, dtype=dtype)
    results = []
    for emulated_mx in (True, False):
        layer.emulated_mx = emulated_mx
        layer.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_()
        y = layer(inputs)
        y.backward(grad_y)
        results.append([y, inputs.grad] + [param.grad for param in layer.parameters() if param.requires_grad])
    for fast, torchao in zip(*results):
        assert torch.equal(bits(fast), bits(torchao))


def test_a_trained_weight_is_quantized_again_after_each_step_as_the_split_engine_syncs_it():
    """Full fine-tuning (QAT): the unified model after an optimizer step computes what a split engine synced from the
    same high-precision weights computes — bit for bit, before and after."""
    model = bare_tiny_llada(MASK, EOS)
    trainer = copy.deepcopy(model).train()
    unified = RolloutEngine(trainer, precision="mxfp4", precision_flow="unified")
    split = RolloutEngine(model, precision="mxfp4")
    tokens = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(unified.model(tokens).logits, split.model(tokens).logits)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
    trainer(tokens).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    model.load_state_dict(trainer.state_dict())  # the master weights, high precision
    assert unified.sync_from(trainer) >= 0 and split.sync_from(model) >= 0
    with torch.no_grad():
        after = unified.model(tokens).logits
        assert torch.equal(after, split.model(tokens).logits)
        assert not torch.equal(after, RolloutEngine(bare_tiny_llada(MASK, EOS), precision="mxfp4").model(tokens).logits)


def test_with_lora_the_engine_is_the_trainers_model_holding_one_quantized_base():
    """LoRA: the engine samples with the trainer's model itself; every quantized base layer keeps its quantized
    weight only (no high-precision copy, outside parameters and state dict), the adapters train beside it, and a
    sync copies nothing: the engine computes with the adapter as the optimizer left it."""
    trainer = get_peft_model(bare_tiny_llada(MASK, EOS), LoraConfig(r=4, lora_alpha=8,
                                                                     target_modules=lora_target_modules("llada")))
    bytes_before = sum(p.numel() * p.element_size() for p in trainer.parameters())
    engine = RolloutEngine(trainer, precision="fp8", precision_flow="unified")
    assert engine.model is trainer and engine.shares_trainer_model
    quantized = [module for module in trainer.modules() if isinstance(module, StraightThroughQuantizedLinear)]
    assert len(quantized) == len(engine.quantized_modules) == 14  # 7 block linears × 2 layers; the LM head stays
    assert all(module.weight is None for module in quantized)
    bytes_after = sum(p.numel() * p.element_size() for p in trainer.parameters())
    assert bytes_after < bytes_before - sum(module.in_features * module.out_features * 4 for module in quantized) + 1
    assert all(name.count("lora_") for name, p in trainer.named_parameters() if p.requires_grad)
    tokens = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = engine.model(tokens).logits
    for name, param in trainer.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.1)
    engine.sync_from(trainer)
    with torch.no_grad():
        assert not torch.equal(engine.model(tokens).logits, before)
        assert torch.equal(engine.model(tokens).logits, trainer(tokens).logits)


# The notches on the embedded LLaDA (every one, the per-tensor ones included), and each other family at two of them.
FLOW_CASES = [("llada", precision) for precision in QUANTIZED] + [
    (model, precision) for model in ("qwen3", "dream", "sdar") for precision in ("fp8", "mxfp4")]


@pytest.fixture(scope="module")
def embedded():
    """Per model name: (config, model, policy, prompts) as `dllm-ais bench mismatch` builds them."""
    built = {}

    def get(name):
        if name not in built:
            config = load_config(RECIPES[name], ["--output_dir=/tmp/unused", "--num_generations=2",
                                                    "--per_device_train_batch_size=4"])
            model = load_model(config.model_name_or_path, torch.float32).eval()
            tokenizer = load_tokenizer(config.model_name_or_path)
            policy = build_policy(config, model.config, tokenizer, temperature=1.0)
            built[name] = config, model, policy, validation_prompts(config, tokenizer, 6, seed=0)
        return built[name]

    return get


@pytest.mark.parametrize("name, precision", FLOW_CASES, ids=[f"{m}-{p}" for m, p in FLOW_CASES])
def test_the_unified_flow_leaves_no_mismatch_on_either_canvas(embedded, name, precision):
    """k3 of the trainer (with gradients on, as ℓ_θ runs) against the engine: ≤ 1e-6 on the canvas the one-step
    estimator scores (causal LMs: teacher forcing) and on the trajectory replay's canvases — the recipe's dual-cache
    decoder replayed micro-batch by micro-batch (4 and 2 rows: batches other than the sampler's 6) — where the split flow
    shows the precision's mismatch. The notches that scale activations over the whole batch (fp8_tensor, nvfp4) are
    exact on the one-step canvas (both sides score the same micro-batch) and not on the replay's, a combination the
    config refuses."""
    config, model, policy, (input_ids, attention_mask) = embedded(name)
    unified = measure_notch(config, model, policy, precision, input_ids, attention_mask, seed=0, flow="unified")
    assert unified.scored_canvas["k3"] <= 1e-6 and unified.kl <= 1e-6
    if unified.trajectory is not None and precision in BATCH_SCALED_PRECISIONS:  # refused: the replay's batch differs
        assert unified.trajectory["k3"] > 1e-6
        with pytest.raises(ConfigError, match=f"rollout.precision={precision} scales activations over the whole batch"):
            config_of(rollout={"precision": precision, "precision_flow": "unified"},
                      likelihood={"estimator": "trajectory"}).validate()
    elif unified.trajectory is not None:
        assert unified.trajectory["k3"] <= 1e-6 and unified.trajectory["max_abs_log_ratio"] <= 1e-3
    if (name, precision) == ("llada", "mxfp4"):
        split = measure_notch(config, model, policy, precision, input_ids, attention_mask, seed=0)
        assert split.scored_canvas["k3"] > 1e-5


def test_the_commit_choice_ratio_is_one_in_the_unified_flow():
    """The complete ratio's commit part: the trainer replaying the recorded commit choices (stochastic rule, dual
    cache, threshold) reproduces them on the unified model, micro-batch by micro-batch; the split flow's trainer does
    not."""
    model = bare_tiny_llada(MASK, EOS)
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=8, block_length=4, steps=4, temperature=1.0, mask_token_id=MASK, eos_token_ids=(EOS,),
        cache="dual", threshold=0.5, position_temperature=0.05))
    prompts = torch.randint(0, 120, (6, 5), generator=torch.Generator().manual_seed(0))
    unified = RolloutEngine(copy.deepcopy(model), precision="mxfp4", precision_flow="unified").model
    rollout = sampler.sample(unified, prompts, generator=torch.Generator().manual_seed(1))
    replayed = torch.cat([sampler.choice_logprobs(unified, rollout.select(slice(start, start + 2)))
                          for start in range(0, 6, 2)])
    assert (replayed - recorded_choice(rollout).logprobs).abs().max() <= 1e-5
    split = RolloutEngine(model, precision="mxfp4").model
    drawn = sampler.sample(split, prompts, generator=torch.Generator().manual_seed(1))
    assert (sampler.choice_logprobs(model, drawn) - recorded_choice(drawn).logprobs).abs().max() > 1e-3


def test_the_old_log_prob_pass_is_skipped_where_the_flow_makes_it_the_rollouts(tokenizer, tmp_path, monkeypatch):
    """Unified, one-step estimator: ℓ_old is ℓ_rollout (one pass, the rollout side's) and the correction sees ratio
    1; trajectory estimator: the sampler recorded ℓ_rollout while decoding, the trainer's replay still runs and the
    ratio is 1 to float rounding. A few steps train, and the loss and gradients are finite."""
    scorers = []
    scored_by = grpo.micro_batched_logprobs
    monkeypatch.setattr(grpo, "micro_batched_logprobs", lambda score, *args: scorers.append(score) or scored_by(
        score, *args))
    settings = {"rollout.precision": "mxfp4", "rollout.precision_flow": "unified", "correction.method": "ais",
                "beta": 0.0}  # no reference pass
    one_step = make_trainer(tokenizer, tmp_path / "one_step", **settings)
    batch = one_step.make_generation_batch()
    assert scorers == [one_step.policy.rollout_logprobs] * len(batch.seeds)
    assert all(torch.equal(old, rollout) for old, rollout in zip(batch.logp_old, [
        one_step.policy.rollout_logprobs(one_step.engine.model, batch.rollout, seed) for seed in batch.seeds]))
    assert all(d["rollout_corr/k3_kl"] == 0.0 for d in batch.diagnostics)
    run = make_trainer(tokenizer, tmp_path / "trajectory", **settings, likelihood={"estimator": "trajectory"},
                       rollout={"cache": "dual", "threshold": 0.9}).train()
    for record in run.history:
        assert record["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)
        assert record["grad_norm"] > 0 and math.isfinite(record["loss"])


@pytest.mark.slow  # two runs of the embedded model with held-out evaluations
def test_the_unified_flow_trains_fully_fine_tuned_and_scores_the_high_precision_base(tmp_path):
    """Full fine-tuning under the unified flow (the master weights quantized on the fly) trains the embedded model; a
    run's held-out metrics hold the policy on the high-precision base too, reloaded from model_name_or_path, whose
    baseline is the split flow's."""
    overrides = ["--rollout.precision=int8", "--use_peft=false", "--max_steps=1", "--eval_size=8",
                 "--per_device_train_batch_size=8", "--num_generations=4"]
    run = GRPOTrainer(load_config(EMBEDDED_RECIPE, [*overrides, "--rollout.precision_flow=unified",
                                                    f"--output_dir={tmp_path / 'unified'}"])).train()
    split = GRPOTrainer(load_config(EMBEDDED_RECIPE, [*overrides, f"--output_dir={tmp_path / 'split'}"])).train()
    step, unified = run.history[0], run.history[-1]
    assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])
    assert unified["eval/high_precision_base/reward_before"] == split.history[-1]["eval/reward_before"]
    assert "eval/high_precision_base/reward_delta" in unified
    assert not any(key.startswith("eval/high_precision_base/") for key in split.history[-1])


def test_eval_and_generate_in_the_unified_flow_compute_the_unified_trainers_logits(tmp_path):
    """`dllm-ais eval/generate --precision mxfp4 --precision_flow unified` on a saved adapter compute what a unified
    run's model computes (the base quantized, the adapter beside it in high precision: its held-out evaluation);
    the split flow merges the adapter in and quantizes the sum, which computes otherwise."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules("llada"), init_lora_weights=False)
    adapter = get_peft_model(load_model("embedded", torch.float32), lora)
    adapter.save_pretrained(tmp_path / "adapter")
    load_tokenizer("embedded").save_pretrained(tmp_path / "adapter")
    trainer = RolloutEngine(adapter, precision="mxfp4", precision_flow="unified").model
    config = SimpleNamespace(model_name_or_path=str(tmp_path / "adapter"), dtype="float32", trust_remote_code=False)
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {flow: load_for_inference(SimpleNamespace(precision="mxfp4", precision_flow=flow), config)[0](
            tokens).logits for flow in ("unified", "split")}
        assert torch.equal(logits["unified"], trainer(tokens).logits)
    assert (logits["split"] - logits["unified"]).abs().max() > 1e-2


def test_the_settings_and_launches_the_unified_flow_refuses():
    """rollout.compile=true and DeepSpeed are refused; FSDP and DDP take every sampler and estimator (each forward of
    the sharded trainer gathers its weights on every process, and the samplers and the likelihood replays agree on
    their forwards: tests/test_forward_agreement.py)."""
    with pytest.raises(ConfigError, match="rollout.compile=true compiles the split engine's own copy"):
        config_of(rollout={"precision_flow": "unified", "compile": True}).validate()
    config_of(rollout={"precision_flow": "unified", "compile": None}).validate()
    deepspeed, fsdp, ddp = (SimpleNamespace(distributed_type=DistributedType[name])
                            for name in ("DEEPSPEED", "FSDP", "MULTI_CPU"))
    with pytest.raises(ConfigError, match="not under DeepSpeed: launch with recipes/accelerate/ddp.yaml"):
        check_unified_flow_launch(deepspeed)
    check_unified_flow_launch(fsdp)
    check_unified_flow_launch(ddp)


@pytest.mark.parametrize("use_peft", [True, False], ids=["lora", "full-fine-tuning"])
def test_a_unified_run_resumes_exactly(tokenizer, tmp_path, use_peft):
    """A unified run resumed from its checkpoint ends with the uninterrupted run's metrics: the base is quantized
    again from the same weights (LoRA), or the master weights load back and are quantized at their next forward (full
    fine-tuning, its reference model quantized once)."""
    from conftest import tiny_qwen3
    from test_resume import comparable, metrics

    settings = dict(model_fn=tiny_qwen3, use_peft=use_peft, beta=0.04, max_steps=3, num_iterations=2, save_steps=2,
                    **{"rollout.precision": "mxfp4", "rollout.precision_flow": "unified"})
    uninterrupted = comparable(make_trainer(tokenizer, tmp_path / "a", **settings).train().history)
    resumed = make_trainer(tokenizer, tmp_path / "b", **settings,
                           resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2")).train().history
    assert comparable(resumed) == comparable(metrics(tmp_path / "b")) == uninterrupted
    assert all(record["rollout_corr/k3_kl"] == 0.0 for record in uninterrupted if "rollout_corr/k3_kl" in record)


def test_the_gradient_probe_agrees_with_itself_in_bf16_and_not_at_mxfp4(capsys):
    """`python -m dllm_ais.experimental.precision_flow_gradients`: the unified bf16 model's gradient is the
    high-precision one (cosine 1, norm ratio 1); at MXFP4 the straight-through gradient points elsewhere."""
    from dllm_ais.experimental.precision_flow_gradients import main

    main(["--precisions", "bf16,mxfp4", "--prompts", "8"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "cosine(unified, high precision) 1.000 | norm unified / high precision 1.00" in rows["bf16"]
    assert float(rows["mxfp4"].split("cosine(unified, high precision) ")[1].split()[0]) < 0.9

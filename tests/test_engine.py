"""Rollout engine: precision modes, LoRA merging and in-place weight sync, on tiny LLaDA and Qwen3 models."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from torchao.quantization import Float8Tensor
from torchao.utils import TorchAOBaseTensor
from transformers import AutoModelForCausalLM, Qwen3Config

import dllm_ais.quantization as quantization
from dllm_ais.engine import RolloutEngine, merged_state_items
from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.quantization import PRECISIONS, quantize_model_, requantize_
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler

VOCAB = 128
# LoRA targets: every linear inside the transformer blocks (LLaDA's per-block ff_out, not its top-level LM head).
BLOCK_LINEARS = {
    "llada": r".*blocks\.\d+\.(q_proj|k_proj|v_proj|attn_out|ff_proj|up_proj|ff_out)",
    "qwen3": r".*layers\.\d+\.(self_attn|mlp)\.\w+_proj",
}
LM_HEADS = {"llada": "model.transformer.ff_out", "qwen3": "lm_head"}
ARCHITECTURES = tuple(BLOCK_LINEARS)
QUANTIZED = tuple(precision for precision in PRECISIONS if precision != "bf16")


def tiny_llada(d_model: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return LLaDAModelLM(LLaDAConfig(
        d_model=d_model, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=VOCAB,
        embedding_size=VOCAB, max_sequence_length=256, mask_token_id=127, eos_token_id=126, pad_token_id=126,
    ))


def tiny_qwen3() -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ))


def tiny_model(architecture: str) -> nn.Module:
    return {"llada": tiny_llada, "qwen3": tiny_qwen3}[architecture]()


def tiny_lora_model(architecture: str, **lora_kwargs) -> PeftModel:
    """A LoRA on every block linear, with lora_B randomised so that ΔW = B·A·scaling is nonzero."""
    model = get_peft_model(
        tiny_model(architecture),
        LoraConfig(r=4, lora_alpha=8, target_modules=BLOCK_LINEARS[architecture], **lora_kwargs),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def logits_of(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids).logits


def mean_token_kl(trainer_logits: torch.Tensor, engine_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p_trainer ‖ p_engine) = Σ_v p_trainer(v) (log p_trainer(v) − log p_engine(v))."""
    trainer_logp = trainer_logits.float().log_softmax(-1)
    engine_logp = engine_logits.float().log_softmax(-1)
    return (trainer_logp.exp() * (trainer_logp - engine_logp)).sum(-1).mean().item()


def quantized_storage_pointers(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {
        name: tuple(getattr(param, inner).data_ptr() for inner in param.tensor_data_names)
        for name, param in model.named_parameters() if isinstance(param, TorchAOBaseTensor)
    }


def take_optimizer_step(model: nn.Module, input_ids: torch.Tensor) -> None:
    """One Adam step on a next-token-style cross-entropy, large enough to move FP8-rounded weights."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    logits = model(input_ids).logits
    F.cross_entropy(logits.reshape(-1, VOCAB), input_ids.roll(-1, dims=1).reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bf16_engine_reproduces_trainer_bit_for_bit(architecture, input_ids):
    trainer = tiny_model(architecture)
    engine = RolloutEngine(trainer, precision="bf16")
    assert engine.quantized_modules == []
    assert engine.model is not trainer
    assert not any(param.requires_grad for param in engine.model.parameters())
    assert torch.equal(logits_of(engine.model, input_ids), logits_of(trainer, input_ids))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("precision", QUANTIZED)
def test_low_precision_engine_is_close_to_trainer_but_not_equal(architecture, precision, input_ids):
    trainer = tiny_model(architecture)
    engine = RolloutEngine(trainer, precision=precision)
    trainer_logits, engine_logits = logits_of(trainer, input_ids), logits_of(engine.model, input_ids)
    kl = mean_token_kl(trainer_logits, engine_logits)
    print(f"\n[{architecture} {precision}] mean token KL(trainer ‖ engine) = {kl:.3e}, "
          f"max |Δlogit| = {(trainer_logits - engine_logits).abs().max().item():.3e}")
    assert not torch.equal(engine_logits, trainer_logits)
    assert 0.0 < kl < 1e-3


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fp8_also_quantizes_activations(architecture, input_ids):
    trainer = tiny_model(architecture)
    w8a8 = logits_of(RolloutEngine(trainer, precision="fp8").model, input_ids)
    weight_only = logits_of(RolloutEngine(trainer, precision="fp8_weight_only").model, input_ids)
    assert not torch.equal(w8a8, weight_only)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("precision", ["fp8", "fp8_weight_only"])
def test_block_linears_are_fp8_while_lm_head_embeddings_and_norms_stay_high_precision(architecture, precision):
    trainer = tiny_model(architecture)
    block_linears = {
        name for name, module in trainer.named_modules()
        if isinstance(module, nn.Linear) and name != LM_HEADS[architecture]
    }
    assert len(block_linears) == 14
    engine = RolloutEngine(trainer, precision=precision)
    assert set(engine.quantized_modules) == block_linears
    for name, param in engine.model.named_parameters():
        module_name = name.rsplit(".", 1)[0]
        assert isinstance(param, Float8Tensor) == (module_name in block_linears and name.endswith("weight")), name
        if not isinstance(param, Float8Tensor):
            assert param.dtype == torch.float32, name
    assert not isinstance(engine.model.get_submodule(LM_HEADS[architecture]).weight, Float8Tensor)
    assert not isinstance(engine.model.get_input_embeddings().weight, Float8Tensor)


def test_quantize_model_skips_linears_with_dims_not_multiple_of_16_and_those_the_rule_skips():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24), nn.Linear(24, 32), nn.Linear(32, 32))
    quantized = quantize_model_(model, "fp8_weight_only", skip=lambda name, module: name == "3")
    assert quantized == ["0"]
    assert [isinstance(layer.weight, Float8Tensor) for layer in model] == [True, False, False, False]


@pytest.mark.parametrize("precision", QUANTIZED)
def test_requantize_writes_a_fresh_quantization_into_the_existing_storage(precision):
    torch.manual_seed(0)
    model, reference = nn.Sequential(nn.Linear(128, 16)), nn.Sequential(nn.Linear(128, 16))
    quantize_model_(model, precision, skip=lambda name, module: False)
    weight = model[0].weight
    inner = weight.tensor_data_names  # qdata, scale (and int4's zero_point)
    storage = [getattr(weight, name).data_ptr() for name in inner]
    new_weight = torch.randn(16, 128)
    reference[0].weight.data.copy_(new_weight)
    quantize_model_(reference, precision, skip=lambda name, module: False)

    requantize_(weight, new_weight)

    assert model[0].weight is weight and [getattr(weight, name).data_ptr() for name in inner] == storage
    for name in inner:
        fresh, written = getattr(reference[0].weight, name), getattr(weight, name)
        assert torch.equal(written.view(torch.uint8), fresh.view(torch.uint8)) if written.dtype.itemsize == 1 \
            else torch.equal(written, fresh), name
    with pytest.raises(ValueError, match="shape"):
        requantize_(weight, torch.randn(16, 16))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_lora_engine_equals_engine_of_explicitly_merged_model_and_leaves_trainer_untouched(
    architecture, precision, input_ids
):
    trainer = tiny_lora_model(architecture)
    state_before = {name: tensor.clone() for name, tensor in trainer.state_dict().items()}
    trainer_logits_before = logits_of(trainer, input_ids)

    engine = RolloutEngine(trainer, precision=precision)
    merged_engine = RolloutEngine(copy.deepcopy(trainer).merge_and_unload(), precision=precision)
    base_engine = RolloutEngine(tiny_model(architecture), precision=precision)

    engine_logits = logits_of(engine.model, input_ids)
    assert torch.equal(engine_logits, logits_of(merged_engine.model, input_ids))
    assert not torch.equal(engine_logits, logits_of(base_engine.model, input_ids)), "ΔW must reach the engine"
    assert not any(isinstance(module, LoraLayer) for module in engine.model.modules())
    assert engine.quantized_modules == merged_engine.quantized_modules

    assert isinstance(trainer, PeftModel)
    lora_layers = [module for module in trainer.modules() if isinstance(module, LoraLayer)]
    assert len(lora_layers) == 14 and not any(layer.merged for layer in lora_layers)
    state_after = trainer.state_dict()
    assert state_after.keys() == state_before.keys()
    assert all(torch.equal(state_after[name], tensor) for name, tensor in state_before.items())
    assert torch.equal(logits_of(trainer, input_ids), trainer_logits_before)


def test_merged_state_items_uses_plain_names_and_adds_the_lora_delta():
    trainer = tiny_lora_model("qwen3")
    merged = dict(merged_state_items(trainer))
    plain = dict(tiny_qwen3().named_parameters())
    assert merged.keys() == plain.keys()
    q_proj = trainer.base_model.model.model.layers[0].self_attn.q_proj
    expected = q_proj.base_layer.weight + q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight * 2.0
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], expected)
    assert torch.equal(merged["model.embed_tokens.weight"], plain["model.embed_tokens.weight"])


def test_peft_model_its_lora_model_and_its_injected_base_model_give_the_same_engine(input_ids):
    trainer = tiny_lora_model("llada")
    expected = logits_of(RolloutEngine(trainer, precision="fp8").model, input_ids)
    for host in (trainer.base_model, trainer.get_base_model()):
        engine = RolloutEngine(host, precision="fp8")
        assert not any(isinstance(module, LoraLayer) for module in engine.model.modules())
        assert torch.equal(logits_of(engine.model, input_ids), expected)
    assert isinstance(trainer.get_base_model().model.transformer.blocks[0].q_proj, LoraLayer)


def test_disabled_adapters_contribute_no_delta(input_ids):
    trainer = tiny_lora_model("llada")
    with trainer.disable_adapter():
        engine = RolloutEngine(trainer, precision="fp8")
    base_engine = RolloutEngine(tiny_llada(), precision="fp8")
    assert torch.equal(logits_of(engine.model, input_ids), logits_of(base_engine.model, input_ids))


def test_modules_to_save_copy_replaces_the_original(input_ids):
    trainer = tiny_lora_model("qwen3", modules_to_save=["lm_head"])
    with torch.no_grad():
        trainer.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    engine = RolloutEngine(trainer, precision="fp8")
    merged_engine = RolloutEngine(copy.deepcopy(trainer).merge_and_unload(), precision="fp8")
    assert torch.equal(
        engine.model.lm_head.weight, trainer.base_model.model.lm_head.modules_to_save["default"].weight
    )
    assert torch.equal(logits_of(engine.model, input_ids), logits_of(merged_engine.model, input_ids))


@pytest.mark.parametrize("architecture, training, precision", [
    *((architecture, training, "fp8") for architecture in ARCHITECTURES for training in ("lora", "full")),
    *(("llada", "lora", precision) for precision in QUANTIZED if precision != "fp8"),
])
def test_sync_after_optimizer_step_matches_a_fresh_engine_in_place(architecture, training, precision, input_ids):
    trainer = tiny_lora_model(architecture) if training == "lora" else tiny_model(architecture)
    engine = RolloutEngine(trainer, precision=precision)
    logits_before = logits_of(engine.model, input_ids)
    quantized_pointers = quantized_storage_pointers(engine.model)
    plain_pointers = {
        name: param.data_ptr() for name, param in engine.model.named_parameters()
        if not isinstance(param, TorchAOBaseTensor)
    }
    assert len(quantized_pointers) == (2 if precision == "int4_g128" else 14)  # int4_g128: the 128-input ff_outs

    take_optimizer_step(trainer, input_ids)
    seconds = engine.sync_from(trainer)

    print(f"\n[{architecture} {training}] sync_from: {seconds * 1e3:.2f} ms")
    assert seconds > 0.0
    synced_logits = logits_of(engine.model, input_ids)
    assert not torch.equal(synced_logits, logits_before)
    assert torch.equal(synced_logits, logits_of(RolloutEngine(trainer, precision=precision).model, input_ids))
    assert quantized_storage_pointers(engine.model) == quantized_pointers
    assert {
        name: param.data_ptr() for name, param in engine.model.named_parameters()
        if not isinstance(param, TorchAOBaseTensor)
    } == plain_pointers


def test_fp8_engine_samples_with_the_block_cache_and_stays_in_sync(input_ids):
    """The FP8 engine runs the cached, threshold-decoding sampler; after sync_from it samples exactly what a freshly
    built engine samples, through the same cache."""
    trainer = tiny_lora_model("llada")
    engine = RolloutEngine(trainer, precision="fp8")
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=16, block_length=8, steps=8, temperature=1.0, cache="dual", threshold=0.5))
    prompts = input_ids[:, :8].clamp(max=VOCAB - 3)

    def sample(model):
        return sampler.sample(model, prompts, generator=torch.Generator().manual_seed(0))

    before = sample(engine.model)
    assert (before.commit_step >= 0).all()
    take_optimizer_step(trainer, input_ids)
    engine.sync_from(trainer)
    synced, fresh = sample(engine.model), sample(RolloutEngine(trainer, precision="fp8").model)
    for name in ("sequences", "step_logprobs", "commit_step", "num_steps"):
        assert torch.equal(getattr(synced, name), getattr(fresh, name)), name
    assert not torch.equal(synced.step_logprobs, before.step_logprobs)


@pytest.mark.skipif(not dist.is_available() or dist.is_initialized(), reason="needs a fresh torch.distributed")
def test_sync_through_a_ddp_wrapper(input_ids):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = nn.parallel.DistributedDataParallel(tiny_lora_model("llada"))
        engine = RolloutEngine(trainer, precision="fp8")
        take_optimizer_step(trainer, input_ids)
        engine.sync_from(trainer)
        fresh = RolloutEngine(trainer.module, precision="fp8")
        assert torch.equal(logits_of(engine.model, input_ids), logits_of(fresh.model, input_ids))
    finally:
        dist.destroy_process_group()


def test_sync_from_a_different_architecture_raises_before_copying(input_ids):
    engine = RolloutEngine(tiny_llada(), precision="fp8")
    logits_before = logits_of(engine.model, input_ids)
    with pytest.raises(ValueError, match="does not match.*absent from the trainer"):
        engine.sync_from(tiny_qwen3())
    with pytest.raises(ValueError, match=r"shape mismatch.*attn_out.weight: trainer \(32, 32\) vs engine \(64, 64\)"):
        engine.sync_from(tiny_llada(d_model=32))
    assert torch.equal(logits_of(engine.model, input_ids), logits_before)


@pytest.mark.parametrize("precision", ["fp8", "mxfp4"])
def test_emulated_kernel_path_is_logged_once_per_process_and_mode(precision, caplog):
    quantization._log_kernel_path.cache_clear()
    caplog.set_level(logging.INFO, logger="dllm_ais")
    engine = RolloutEngine(tiny_llada(), precision=precision)
    RolloutEngine(tiny_qwen3(), precision=precision)
    notices = [record for record in caplog.records if "runs emulated: torchao" in record.getMessage()]
    assert len(notices) == 1 and notices[0].name == "dllm_ais" and notices[0].levelno == logging.WARNING
    assert engine.kernel_path in notices[0].getMessage()


def test_bad_precision_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="precision") as error:
        RolloutEngine(tiny_llada(), precision="fp16")
    assert all(repr(name) in str(error.value) for name in PRECISIONS)


@pytest.mark.parametrize("precision", ["fp8", "fp8_tensor", "mxfp8", "mxfp4"])
def test_w8a8_engine_stays_finite_on_all_zero_activation_rows(precision):
    """A padding embedding kept at zero by `padding_idx` gives zero rows; their scale must not be 0 (NaN)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0)).eval()
    assert model.get_input_embeddings().weight[0].abs().sum() == 0
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    attention_mask = (input_ids != 0).long()
    with torch.no_grad():
        logits = RolloutEngine(model, precision=precision).model(input_ids, attention_mask=attention_mask).logits
    assert torch.isfinite(logits).all()

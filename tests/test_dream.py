"""Native Dream: parity with a reference forward built from transformers' own Qwen2, checkpoint layout, Auto-class
loading without remote code, attention semantics, and the family's logit shift."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Qwen2Config, Qwen2Model

import dllm_ais  # noqa: F401  (registers "Dream")
from dllm_ais.models import DreamConfig, DreamModel
from dllm_ais.models.families import logits_are_shifted, shift_logits_right

PAD = 254
OFFICIAL_AUTO_MAP = {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}


def tiny_config(**overrides) -> DreamConfig:
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, initializer_range=0.1,
                  mask_token_id=255, pad_token_id=PAD, bos_token_id=PAD, eos_token_id=PAD)
    fields.update(overrides)
    return DreamConfig(**fields)


def tiny_model(**overrides) -> DreamModel:
    torch.manual_seed(0)
    model = DreamModel(tiny_config(**overrides)).eval()
    with torch.no_grad():  # norms, biases and the padding row away from their initial 1 / 0, so a misplaced one shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
        model.model.embed_tokens.weight[PAD].normal_(std=0.1)
    return model


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 250, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = PAD, 0
    ids[1, :1], mask[1, :1] = PAD, 0
    return ids, mask


def reference_logits(model: DreamModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The official architecture from transformers' own Qwen2 (eager attention), given our weights: a 4-D additive mask
    that hides padded keys only (bidirectional), position ids cumsum(mask) - 1 as the official generation passes."""
    cfg = model.config
    qwen = Qwen2Model(Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, pad_token_id=cfg.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attn_implementation="eager",
    )).eval()
    body = {k.removeprefix("model."): v for k, v in model.state_dict().items() if k.startswith("model.")}
    assert qwen.load_state_dict(body, strict=True)
    length = ids.shape[1]
    additive = torch.zeros(ids.shape[0], 1, length, length)
    additive.masked_fill_(mask[:, None, None, :] == 0, torch.finfo(torch.float32).min)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        hidden = qwen(input_ids=ids, attention_mask={"full_attention": additive}, position_ids=positions)
    return hidden.last_hidden_state @ model.lm_head.weight.T


def test_the_qwen2_reference_is_bidirectional_with_a_4d_mask():
    """Guard for the reference itself: with the 4-D mask a future token changes earlier hidden states."""
    model = tiny_model()
    ids = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 250
    mask = torch.ones_like(ids)
    assert not torch.allclose(reference_logits(model, ids, mask)[0, 0], reference_logits(model, changed, mask)[0, 0])


@pytest.mark.parametrize("num_key_value_heads", [2, 4])
def test_logits_match_the_qwen2_reference_on_a_left_padded_batch(num_key_value_heads):
    model = tiny_model(num_key_value_heads=num_key_value_heads)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    expected = reference_logits(model, ids, mask)
    real = mask.bool()
    assert logits.shape == (3, 10, 256)
    assert (logits - expected)[real].abs().max() < 1e-5


def test_checkpoint_key_names_are_the_hub_checkpoints(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    layer = {f"model.layers.{i}.{name}" for i in range(2) for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
        "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
    assert keys == layer | {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "Dream" and saved["architectures"] == ["DreamModel"]
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "rope_theta", "rms_norm_eps", "mask_token_id", "pad_token_id",
                  "max_position_embeddings", "tie_word_embeddings"):
        assert saved[field] == getattr(model.config, field)
    fresh = DreamModel(tiny_config())
    assert fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)


def test_official_checkpoint_directory_round_trips_through_auto_classes_without_remote_code(tmp_path):
    """A directory laid out as the Hub's (auto_map to remote code, the official config fields) loads natively and
    bit-exactly; auto_map survives a save."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(auto_map=OFFICIAL_AUTO_MAP, torch_dtype="float32", transformers_version="4.46.2")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids, mask = left_padded_batch()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        for auto in (AutoModelForCausalLM, AutoModel):
            loaded = auto.from_pretrained(tmp_path).eval()
            assert isinstance(loaded, DreamModel)
            assert torch.equal(loaded(ids, attention_mask=mask).logits, expected)
            for name, tensor in model.state_dict().items():  # nothing re-initialised, the padding row included
                assert torch.equal(loaded.state_dict()[name], tensor), name
    assert AutoConfig.from_pretrained(tmp_path).model_type == "Dream"
    resaved = tmp_path / "resaved"
    loaded.save_pretrained(resaved)
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == OFFICIAL_AUTO_MAP


def test_fresh_weights_follow_the_official_initialisation():
    model = DreamModel(tiny_config(initializer_range=0.02))
    embedding = model.model.embed_tokens.weight
    assert torch.equal(embedding[PAD], torch.zeros(64)) and abs(embedding[:PAD].std().item() - 0.02) < 0.002
    assert torch.equal(model.model.layers[0].self_attn.q_proj.bias, torch.zeros(64))
    assert torch.equal(model.model.norm.weight, torch.ones(64))


def test_default_config_is_dream_7b():
    cfg = DreamConfig()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (3584, 28, 28, 4, 18944, 152064)
    assert (cfg.mask_token_id, cfg.pad_token_id, cfg.rope_theta, cfg.rms_norm_eps) == (151666, 151643, 1e6, 1e-6)


def test_shift_logits_right_reads_each_position_from_the_one_before():
    logits = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    shifted = shift_logits_right(logits)
    assert torch.equal(shifted[:, 0], logits[:, 0])
    assert torch.equal(shifted[:, 1:], logits[:, :-1])
    assert shifted[1, 2].tolist() == [15.0, 16.0, 17.0]
    assert logits_are_shifted("Dream") and not logits_are_shifted("llada")


def test_attention_is_bidirectional():
    model = tiny_model()
    ids = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 250
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits[0, :-1], model(changed).logits[0, :-1])


def test_left_padding_with_attention_mask_leaves_real_logits_unchanged():
    model = tiny_model()
    ids, mask = left_padded_batch()
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for row in range(3):
            alone = model(ids[row:row + 1, mask[row].bool()]).logits[0]
            torch.testing.assert_close(batched[row, mask[row].bool()], alone, atol=1e-5, rtol=0)
        assert torch.isfinite(batched).all()
        unmasked = model(ids[:1]).logits[0, 4:]
    assert not torch.allclose(unmasked, batched[0, 4:], atol=1e-3)


def test_logits_to_keep_selects_positions():
    model = tiny_model()
    ids = torch.randint(0, 250, (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        assert torch.equal(model(ids, logits_to_keep=4).logits, full[:, -4:])
        assert torch.equal(model(ids, logits_to_keep=torch.tensor([1, 5])).logits, full[:, [1, 5]])


def test_tied_embeddings_share_the_head():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 250, (2, 8))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids).logits.logsumexp(-1).sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("field, value", [("use_sliding_window", True), ("rope_scaling", {"rope_type": "yarn"}),
                                          ("num_key_value_heads", 3)])
def test_unsupported_config_fails_with_a_message_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DreamModel(tiny_config(**{field: value}))


def test_sequence_longer_than_max_position_embeddings_is_rejected():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_model(max_position_embeddings=8)(torch.zeros(1, 9, dtype=torch.long))


def test_cache_requests_are_refused():
    with pytest.raises(TypeError, match="key/value cache"):
        tiny_model()(torch.zeros(1, 4, dtype=torch.long), use_cache=True)

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
from dllm_ais.sampling.fp8_cache import FP8KeyValueCache

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


def test_unsupported_arguments_are_refused_naming_the_supported_ones():
    with pytest.raises(TypeError, match="past_key_values, cache_position, use_cache"):
        tiny_model()(torch.zeros(1, 4, dtype=torch.long), output_attentions=True)


def canvas(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[3, 20] canvas; with `padded`, rows 0 and 1 are left-padded by 5 and 1 positions."""
    ids = torch.randint(0, 250, (3, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :5], mask[0, :5] = PAD, 0
        ids[1, :1], mask[1, :1] = PAD, 0
    return ids, mask


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("num_key_value_heads", [2, 4])
def test_cached_forward_of_some_positions_equals_the_full_forward(num_key_value_heads, padded):
    """With the cache of the same canvas, running only positions [a, b) gives their full-forward logits: RoPE at the
    canvas's per-row positions (cumsum of the [B, T] mask), padded keys hidden, grouped-query heads kept unrepeated."""
    model = tiny_model(num_key_value_heads=num_key_value_heads)
    ids, mask = canvas(padded)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=True)
        assert torch.equal(full.logits, model(ids, attention_mask=mask).logits)  # a refresh is the plain forward
        assert len(full.past_key_values) == 2
        assert all(k.shape == v.shape == (3, num_key_value_heads, 20, 16) for k, v in full.past_key_values)
        real = mask.bool()
        for start, stop in [(8, 14), (12, 20), (0, 20), (3, 7)]:
            part = model(ids[:, start:stop], attention_mask=mask, past_key_values=full.past_key_values,
                         cache_position=torch.arange(start, stop))
            assert part.past_key_values is None
            keep = real[:, start:stop]
            torch.testing.assert_close(part.logits[keep], full.logits[:, start:stop][keep], atol=1e-5, rtol=0)
        kept = model(ids[:, 8:14], attention_mask=mask, past_key_values=full.past_key_values,
                     cache_position=torch.arange(8, 14), logits_to_keep=torch.tensor([0, 2]))
        torch.testing.assert_close(kept.logits, full.logits[:, [8, 10]], atol=1e-5, rtol=0)
        last = model(ids[:, 8:14], attention_mask=mask, past_key_values=full.past_key_values,
                     cache_position=torch.arange(8, 14), logits_to_keep=2)
        torch.testing.assert_close(last.logits, full.logits[:, [12, 13]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("num_key_value_heads", [2, 4])
def test_cached_forward_of_a_changed_block_equals_the_full_forward_of_the_changed_canvas(num_key_value_heads, padded):
    """Changing tokens inside a block and running that block only against the old canvas's cache is exact when no
    other position's cached keys/values depend on the block: with one layer, keys/values are those of the tokens and
    their positions only. (With more layers the other positions' entries are stale; that is the caller's choice.)"""
    model = tiny_model(num_key_value_heads=num_key_value_heads, num_hidden_layers=1)
    ids, mask = canvas(padded)
    changed = ids.clone()
    changed[:, 10:13] = (ids[:, 10:13] + 7) % 250
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        expected = model(changed, attention_mask=mask).logits[:, 8:16]
        block = model(changed[:, 8:16], attention_mask=mask, past_key_values=cache,
                      cache_position=torch.arange(8, 16)).logits
    torch.testing.assert_close(block, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(block, model(ids, attention_mask=mask).logits[:, 8:16], atol=1e-3)


@pytest.mark.parametrize("padded", [False, True])
def test_cached_forward_writes_its_positions_into_the_cache_in_place(padded):
    model = tiny_model()
    ids, mask = canvas(padded)
    changed = ids.clone()
    changed[:, 6:10] = (ids[:, 6:10] + 1) % 250
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        before = [(keys.clone(), values.clone()) for keys, values in cache]
        output = model(changed[:, 6:10], attention_mask=mask, past_key_values=cache,
                       cache_position=torch.arange(6, 10), use_cache=True)
        fresh = model(changed, attention_mask=mask, use_cache=True).past_key_values
    assert output.past_key_values is not None and output.past_key_values[0][0] is cache[0][0]
    outside = torch.cat([torch.arange(6), torch.arange(10, 20)])
    for (keys, values), (old_keys, old_values) in zip(cache, before):
        assert torch.equal(keys[:, :, outside], old_keys[:, :, outside])
        assert torch.equal(values[:, :, outside], old_values[:, :, outside])
        assert not torch.allclose(keys[:, :, 6:10], old_keys[:, :, 6:10])
    # The first layer's keys depend on the token and its position only: the written ones carry the right RoPE angle.
    torch.testing.assert_close(cache[0][0][:, :, 6:10], fresh[0][0][:, :, 6:10], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[0][1][:, :, 6:10], fresh[0][1][:, :, 6:10], atol=1e-6, rtol=0)


def test_cached_forward_under_grad_leaves_the_cache_unchanged_and_returns_a_copy():
    model = tiny_model()
    ids, mask = canvas(True)
    changed = ids.clone()
    changed[:, 6:10] = (ids[:, 6:10] + 1) % 250
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
    before = [(keys.clone(), values.clone()) for keys, values in cache]
    output = model(changed[:, 6:10], attention_mask=mask, past_key_values=cache, cache_position=torch.arange(6, 10),
                   use_cache=True)
    for (keys, values), (old_keys, old_values), (new_keys, new_values) in zip(cache, before, output.past_key_values):
        assert torch.equal(keys, old_keys) and torch.equal(values, old_values)
        assert new_keys is not keys and not torch.allclose(new_keys[:, :, 6:10], old_keys[:, :, 6:10])
        assert torch.equal(new_values[:, :, :6], old_values[:, :, :6])


def test_gradient_flows_through_a_cached_forward():
    """Under grad, the block's logits depend on the weights through the fresh keys/values and through a cache that
    is itself in the graph (a refresh run under grad)."""
    model = tiny_model().train()
    ids, mask = canvas(True)
    full = model(ids, attention_mask=mask, use_cache=True)
    part = model(ids[:, 8:14], attention_mask=mask, past_key_values=full.past_key_values,
                 cache_position=torch.arange(8, 14))
    torch.testing.assert_close(part.logits, full.logits[:, 8:14], atol=1e-5, rtol=0)
    part.logits.logsumexp(-1).sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    assert model.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0

    model.zero_grad()
    with torch.no_grad():  # a detached cache: the gradient reaches the weights through the block's own path
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
    model(ids[:, 8:14], attention_mask=mask, past_key_values=cache,
          cache_position=torch.arange(8, 14)).logits.logsumexp(-1).sum().backward()
    assert model.model.layers[1].self_attn.v_proj.weight.grad.abs().sum() > 0


def test_cached_forward_works_with_gradient_checkpointing():
    ids, mask = canvas(True)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        with torch.no_grad():
            cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        model(ids[:, 8:14], attention_mask=mask, past_key_values=cache,
              cache_position=torch.arange(8, 14)).logits.logsumexp(-1).sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=0)


def test_cached_forward_rejects_a_cache_it_cannot_use():
    model = tiny_model()
    ids = torch.randint(0, 250, (1, 12))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="cache_position must give the cache positions of the 4 inputs"):
            model(ids[:, :4], past_key_values=cache)
        with pytest.raises(ValueError, match="cache_position must give the cache positions of the 4 inputs"):
            model(ids[:, :4], past_key_values=cache, cache_position=torch.arange(4)[None])
        with pytest.raises(ValueError, match="attention_mask must cover all 12 cached positions"):
            model(ids[:, :4], attention_mask=torch.ones(1, 4), past_key_values=cache, cache_position=torch.arange(4))
        with pytest.raises(ValueError, match="past_key_values holds 1 layers, the model 2"):
            model(ids[:, :4], past_key_values=cache[:1], cache_position=torch.arange(4))
        with pytest.raises(ValueError, match="past_key_values holds 1 rows, the inputs 2"):
            model(ids[:, :4].repeat(2, 1), past_key_values=cache, cache_position=torch.arange(4))
        with pytest.raises(ValueError, match="Pass the cache that a use_cache=True forward"):
            model(ids[:, :4], past_key_values=cache[:1])


def test_cache_position_without_a_cache_sets_the_positions():
    model = tiny_model()
    ids = torch.randint(0, 250, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
        torch.testing.assert_close(model(ids, cache_position=torch.arange(3, 15)).logits, full, atol=1e-5, rtol=0)
        gapped = torch.cat([torch.arange(6), torch.arange(11, 17)])  # RoPE is relative: only a gap changes scores
        logits = model(ids, cache_position=gapped).logits
        assert not torch.allclose(logits, full, atol=1e-4)
        torch.testing.assert_close(logits, model(ids, position_ids=gapped[None].expand(2, -1)).logits)
        with pytest.raises(ValueError, match="position_ids"):
            model(ids, attention_mask=torch.ones_like(ids), cache_position=torch.arange(12))


def test_explicit_position_ids_win_over_the_cached_positions():
    model = tiny_model()
    ids, mask = canvas(True)
    positions = torch.arange(20)[None].expand(3, -1)  # 0..T-1 even in padded rows, instead of cumsum(mask) - 1
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache = [(k.clone(), v.clone()) for k, v in full.past_key_values]
        explicit = model(ids[:, 8:14], attention_mask=mask, position_ids=positions[:, 8:14],
                         past_key_values=full.past_key_values, cache_position=torch.arange(8, 14)).logits
        default = model(ids[:, 8:14], attention_mask=mask, past_key_values=cache,
                        cache_position=torch.arange(8, 14)).logits
    torch.testing.assert_close(explicit, full.logits[:, 8:14], atol=1e-5, rtol=0)
    assert not torch.allclose(default[0], full.logits[0, 8:14], atol=1e-4)  # row 0's queries moved by its 5 pads


def test_fp8_cache_runs_and_is_close_to_the_full_precision_cache():
    model = tiny_model()
    ids, mask = canvas(True)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=True)
        fp8 = FP8KeyValueCache(full.past_key_values)
        stored = [(q.clone(), s.clone()) for pair in fp8.layers for q, s in pair]
        part = model(ids[:, 8:14], attention_mask=mask, past_key_values=fp8, cache_position=torch.arange(8, 14),
                     use_cache=True)
    assert len(part.past_key_values) == 2 and part.past_key_values[0][0].dtype == torch.float32
    assert all(torch.equal(q.float(), q0.float()) and torch.equal(s, s0)  # the container is never written
               for (q, s), (q0, s0) in zip((x for pair in fp8.layers for x in pair), stored))
    real = mask.bool()[:, 8:14]
    error = (part.logits - full.logits[:, 8:14])[real].abs().max()
    assert 0 < error < 0.1 * full.logits.abs().max()
    torch.testing.assert_close(part.logits.softmax(-1), full.logits[:, 8:14].softmax(-1), atol=0.05, rtol=0)


def test_block_cache_sampler_forward_matches_the_uncached_one_on_a_refresh():
    """`BlockCache.block_forward` (the sampler's cache) drives Dream as it drives LLaDA."""
    model = tiny_model()
    ids, mask = canvas(True)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits[:, 8:12]
        output = model(ids, attention_mask=mask, use_cache=True, logits_to_keep=torch.arange(8, 12))
        torch.testing.assert_close(output.logits, expected, atol=1e-6, rtol=0)
        dual = model(ids[:, 8:12], attention_mask=mask, past_key_values=output.past_key_values,
                     cache_position=torch.arange(8, 12), logits_to_keep=torch.arange(4))
        prefix = model(ids[:, 8:], attention_mask=mask, past_key_values=output.past_key_values,
                       cache_position=torch.arange(8, 20), logits_to_keep=torch.arange(4))
    real = mask.bool()[:, 8:12]
    torch.testing.assert_close(dual.logits[real], expected[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(prefix.logits[real], expected[real], atol=1e-5, rtol=0)

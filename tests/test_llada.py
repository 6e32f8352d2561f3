"""Native LLaDA: checkpoint layout, Auto-class loading, attention semantics and a from-scratch reference forward."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import dllm_ais  # noqa: F401  (registers "llada")
from dllm_ais.models import LLaDAConfig, LLaDAModelLM

OFFICIAL_AUTO_MAP = {
    "AutoConfig": "configuration_llada.LLaDAConfig",
    "AutoModel": "modeling_llada.LLaDAModelLM",
    "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
}


def tiny_config(**overrides) -> LLaDAConfig:
    fields = dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=96, vocab_size=100,
                  embedding_size=100, max_sequence_length=128, mask_token_id=99, eos_token_id=98, pad_token_id=98)
    fields.update(overrides)
    return LLaDAConfig(**fields)


def tiny_model(**overrides) -> LLaDAModelLM:
    torch.manual_seed(0)
    return LLaDAModelLM(tiny_config(**overrides)).eval()


def reference_logits(state: dict, cfg: LLaDAConfig, ids: torch.Tensor) -> torch.Tensor:
    """A deliberately naive float64 LLaDA forward written from the architecture description (one sequence)."""
    sd = {k.removeprefix("model.transformer."): v.double() for k, v in state.items()}
    n, d, h, kvh = ids.shape[0], cfg.d_model, cfg.n_heads, cfg.n_kv_heads
    hd = d // h

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rope(x):  # x [n, heads, hd]
        out = torch.empty_like(x)
        for p in range(n):
            for i in range(hd // 2):
                angle = p / cfg.rope_theta ** (2 * i / hd)
                a, b = x[p, :, i], x[p, :, i + hd // 2]
                out[p, :, i] = a * math.cos(angle) - b * math.sin(angle)
                out[p, :, i + hd // 2] = b * math.cos(angle) + a * math.sin(angle)
        return out

    x = sd["wte.weight"][ids]
    for i in range(cfg.n_layers):
        b = lambda name: sd[f"blocks.{i}.{name}.weight"]  # noqa: E731
        z = rms(x, b("attn_norm"))
        q = rope((z @ b("q_proj").T).view(n, h, hd))
        k = rope((z @ b("k_proj").T).view(n, kvh, hd)).repeat_interleave(h // kvh, dim=1)
        v = (z @ b("v_proj").T).view(n, kvh, hd).repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)  # no causal mask: bidirectional
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, d)
        x = x + attn @ b("attn_out").T
        z = rms(x, b("ff_norm"))
        gate, up = z @ b("ff_proj").T, z @ b("up_proj").T
        x = x + (gate * torch.sigmoid(gate) * up) @ b("ff_out").T
    return rms(x, sd["ln_f.weight"]) @ sd["ff_out.weight"].T


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_matches_naive_reference_forward(n_kv_heads):
    model = tiny_model(n_kv_heads=n_kv_heads)
    ids = torch.randint(0, 98, (1, 7))
    expected = reference_logits(model.state_dict(), model.config, ids[0])
    assert torch.allclose(model(ids).logits[0].double(), expected, atol=1e-4)


def test_checkpoint_key_names_and_config_round_trip(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    block = {f"model.transformer.blocks.{i}.{n}.weight" for i in range(2) for n in
             ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")}
    assert keys == block | {"model.transformer.wte.weight", "model.transformer.ln_f.weight",
                            "model.transformer.ff_out.weight"}
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llada" and saved["architectures"] == ["LLaDAModelLM"]
    for field in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "rope_theta",
                  "mask_token_id", "block_type", "weight_tying", "include_bias", "max_sequence_length"):
        assert saved[field] == getattr(model.config, field)


def test_official_checkpoint_directory_loads_without_remote_code(tmp_path):
    """An official-layout directory (auto_map to remote code, extra OLMo fields) loads natively; auto_map survives a save."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(auto_map=OFFICIAL_AUTO_MAP, flash_attention=False, block_group_size=1, precision="amp_bf16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 98, (2, 9))
    expected = model(ids).logits
    for auto in (AutoModelForCausalLM, AutoModel):
        loaded = auto.from_pretrained(tmp_path)
        assert isinstance(loaded, LLaDAModelLM)
        assert torch.equal(loaded(ids).logits, expected)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert torch.allclose(bf16(ids).logits.float(), expected, atol=0.1)
    resaved = tmp_path / "resaved"
    bf16.save_pretrained(resaved)
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == OFFICIAL_AUTO_MAP
    assert AutoConfig.from_pretrained(resaved).model_type == "llada"


def test_attention_is_bidirectional():
    model = tiny_model()
    ids = torch.randint(0, 98, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 98
    assert not torch.allclose(model(ids).logits[0, 0], model(changed).logits[0, 0])


def test_left_padding_with_attention_mask_leaves_real_logits_unchanged():
    model = tiny_model(n_kv_heads=2)
    ids = torch.randint(0, 98, (1, 6))
    padded = torch.cat([torch.full((1, 3), 98), ids], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    alone = model(ids).logits
    batched = model(torch.cat([padded, torch.cat([ids[:, :3], ids], 1)]),
                    attention_mask=torch.cat([mask, torch.ones_like(mask)])).logits
    assert torch.allclose(batched[0, 3:], alone[0], atol=1e-5)
    unmasked = model(padded).logits
    assert not torch.allclose(unmasked[0, 3:], alone[0], atol=1e-3)


def test_logits_to_keep_returns_the_last_positions():
    model = tiny_model()
    ids = torch.randint(0, 98, (2, 10))
    assert torch.equal(model(ids, logits_to_keep=4).logits, model(ids).logits[:, -4:])


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 98, (2, 8))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids).logits.logsumexp(-1).sum().backward()
        grads.append(model.model.transformer.blocks[0].q_proj.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_weight_tying_shares_the_embedding():
    model = tiny_model(weight_tying=True)
    assert "model.transformer.ff_out.weight" not in model.state_dict()
    hidden_head = model.model.transformer.wte.weight
    assert model(torch.randint(0, 98, (1, 4))).logits.shape[-1] == hidden_head.shape[0]


@pytest.mark.parametrize("field, value", [("alibi", True), ("block_type", "sequential"),
                                          ("layer_norm_type", "default"), ("clip_qkv", 8.0),
                                          ("attention_layer_norm", True)])
def test_unsupported_config_fails_with_a_message_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LLaDAModelLM(tiny_config(**{field: value}))


def test_sequence_longer_than_max_sequence_length_is_rejected():
    with pytest.raises(ValueError, match="max_sequence_length"):
        tiny_model(max_sequence_length=8)(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_cached_forward_of_some_positions_equals_the_full_forward(n_kv_heads):
    """With the cache of the same canvas, running only positions [a, b) gives their full-forward logits: RoPE at the
    absolute positions, padded keys hidden, grouped-query heads."""
    model = tiny_model(n_kv_heads=n_kv_heads)
    ids = torch.randint(0, 98, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 98, 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=True)
        assert torch.equal(full.logits, model(ids, attention_mask=mask).logits)  # a refresh is the plain forward
        assert len(full.past_key_values) == 2 and full.past_key_values[0][0].shape == (2, n_kv_heads, 20, 16)
        for start, stop in [(8, 14), (12, 20), (0, 20)]:
            part = model(ids[:, start:stop], attention_mask=mask, past_key_values=full.past_key_values,
                         cache_position=torch.arange(start, stop))
            torch.testing.assert_close(part.logits, full.logits[:, start:stop], atol=1e-5, rtol=0)
        kept = model(ids[:, 8:14], attention_mask=mask, past_key_values=full.past_key_values,
                     cache_position=torch.arange(8, 14), logits_to_keep=torch.tensor([0, 2]))
        torch.testing.assert_close(kept.logits, full.logits[:, [8, 10]], atol=1e-5, rtol=0)


def test_cached_forward_writes_its_positions_into_the_cache_in_place():
    model = tiny_model()
    ids = torch.randint(0, 98, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, 6:10] = (ids[:, 6:10] + 1) % 98
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        before = [(keys.clone(), values.clone()) for keys, values in cache]
        output = model(changed[:, 6:10], past_key_values=cache, cache_position=torch.arange(6, 10), use_cache=True)
        fresh = model(changed, use_cache=True).past_key_values
    assert output.past_key_values is not None and output.past_key_values[0][0] is cache[0][0]
    for (keys, values), (old_keys, old_values) in zip(cache, before):
        outside = torch.cat([torch.arange(6), torch.arange(10, 16)])
        assert torch.equal(keys[:, :, outside], old_keys[:, :, outside])
        assert torch.equal(values[:, :, outside], old_values[:, :, outside])
        assert not torch.allclose(keys[:, :, 6:10], old_keys[:, :, 6:10])
    # The first layer's keys depend on the token and its position only: the written ones carry the right RoPE angle.
    torch.testing.assert_close(cache[0][0][:, :, 6:10], fresh[0][0][:, :, 6:10], atol=1e-6, rtol=0)


def test_cached_forward_rejects_a_cache_it_cannot_use():
    model = tiny_model()
    ids = torch.randint(0, 98, (1, 12))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="cache_position must give the cache positions of the 4 inputs"):
            model(ids[:, :4], past_key_values=cache)
        with pytest.raises(ValueError, match="attention_mask must cover all 12 cached positions"):
            model(ids[:, :4], attention_mask=torch.ones(1, 4), past_key_values=cache, cache_position=torch.arange(4))
        with pytest.raises(ValueError, match="past_key_values holds 1 layers, the model 2"):
            model(ids[:, :4], past_key_values=cache[:1], cache_position=torch.arange(4))

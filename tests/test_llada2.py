"""Native LLaDA2 (llada2_moe): parity with the official code (tests/data/llada2_official, written by the official
modeling_llada2_moe.py: tools/make_llada2_parity_fixture.py), left padding included; the router against a direct
enumeration; the grouped experts against each token's own experts; the official checkpoint layout on save; the
block-causal mask and its exact cache."""

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import dllm_ais  # noqa: F401  (registers "llada2_moe")
from dllm_ais.loading import load_model
from dllm_ais.models import LLaDA2MoeConfig, LLaDA2MoeModel, LLaDA2MoeModelLM
from dllm_ais.models.families import is_block_causal
from dllm_ais.models.llada2 import grouped_expert_swiglu, route

OFFICIAL = Path(__file__).parent / "data" / "llada2_official"
OFFICIAL_AUTO_MAP = {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}
PARITY = 1e-4
MASK, PAD, BLOCK = 271, 270, 4


def official_model() -> LLaDA2MoeModelLM:
    return load_model(str(OFFICIAL), torch.float32).eval()


def official_outputs() -> dict[str, torch.Tensor]:
    return load_file(OFFICIAL / "official_outputs.safetensors")


def max_error(model: LLaDA2MoeModelLM, outputs: dict[str, torch.Tensor]) -> float:
    """max |Δ logits| against the official logits, over the unpadded and the left-padded batch."""
    with torch.no_grad():
        plain = model(outputs["input_ids"]).logits
        padded = model(outputs["padded_input_ids"], attention_mask=outputs["padded_attention_mask"]).logits
    return max((plain - outputs["logits"]).abs().max().item(), (padded - outputs["padded_logits"]).abs().max().item())


def test_official_checkpoint_loads_without_remote_code_and_gives_the_official_logits():
    """The official code's checkpoint (per-expert keys, an auto_map to files the directory does not hold) loads as
    our class with stacked experts, and gives the official logits, unpadded and left-padded, in float32."""
    config = json.loads((OFFICIAL / "config.json").read_text())
    assert config["model_type"] == "llada2_moe" and config["auto_map"] == OFFICIAL_AUTO_MAP
    assert not list(OFFICIAL.glob("*.py"))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in load_file(OFFICIAL / "model.safetensors")
    model = official_model()
    assert isinstance(model, LLaDA2MoeModelLM)
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 64, 64)
    outputs = official_outputs()
    assert (outputs["padded_attention_mask"] == 0).any()
    assert max_error(model, outputs) <= PARITY
    assert isinstance(AutoModel.from_pretrained(OFFICIAL, dtype=torch.float32), LLaDA2MoeModel)


@pytest.mark.parametrize("perturb", ["expert", "expert_bias", "router"])
def test_a_perturbed_expert_or_router_leaves_the_official_logits(perturb):
    """Negative controls: the parity test sees one expert's weights, the selection-only bias and the router."""
    model = official_model()
    mlp = model.model.layers[2].mlp
    with torch.no_grad():
        if perturb == "expert":
            mlp.experts.down_proj[3].mul_(1.01)
        elif perturb == "expert_bias":
            mlp.gate.expert_bias.zero_()
        else:
            mlp.gate.weight.mul_(1.01)
    assert max_error(model, official_outputs()) > 10 * PARITY


def enumerated_route(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                     scale: float) -> tuple[set[int], torch.Tensor]:
    """One token's (chosen experts, their weights by expert id) by enumeration: the group sets of size topk_group
    with the best total group score (each group: its two best biased scores), then the expert sets of size top_k
    inside them with the best total biased score; weights = unbiased scores normalised, times `scale`."""
    biased = (scores + bias).tolist()
    size = len(biased) // n_group
    group_score = [sum(sorted(biased[g * size:(g + 1) * size])[-2:]) for g in range(n_group)]
    groups = max(itertools.combinations(range(n_group), topk_group), key=lambda c: sum(group_score[g] for g in c))
    allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
    chosen = sorted(max(itertools.combinations(allowed, top_k), key=lambda c: sum(biased[e] for e in c)))
    weights = scores[chosen] / scores[chosen].sum() * scale
    return set(chosen), weights


def test_the_router_chooses_as_a_direct_enumeration_of_group_limited_top_k():
    generator = torch.Generator().manual_seed(0)
    hidden, router = torch.randn(32, 16, generator=generator), torch.randn(12, 16, generator=generator) * 0.3
    bias = torch.randn(12, generator=generator) * 0.3
    experts, weights = route(hidden, router, bias, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    scores = (hidden @ router.T).sigmoid()
    for token in range(len(hidden)):
        chosen, expected = enumerated_route(scores[token], bias, 3, 4, 2, 2.5)
        assert set(experts[token].tolist()) == chosen
        order = experts[token].argsort()
        torch.testing.assert_close(weights[token, order], expected, atol=1e-6, rtol=0)
    assert not torch.equal(experts, route(hidden, router, torch.zeros(12), 3, 4, 2, 2.5)[0])  # the bias selects


def test_grouped_experts_equal_each_tokens_own_experts():
    """The sorted grouped matmul equals, token by token, the weighted sum of its chosen experts' SwiGLUs; and it
    differentiates (to the tokens, the experts and the routing weights)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(10, 16, generator=generator, requires_grad=True)
    gate_up = torch.randn(6, 16, 16, generator=generator, requires_grad=True)
    down = torch.randn(6, 16, 8, generator=generator, requires_grad=True)
    experts = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(10)])
    experts[:, 0] = 0  # one crowded expert, and expert 5 likely empty: groups of any size
    weights = torch.rand(10, 2, generator=generator, requires_grad=True)
    out = grouped_expert_swiglu(x, gate_up, down, experts, weights, F.silu)
    for token in range(10):
        expected = sum(weights[token, k] * down[e] @ (F.silu(gate_up[e, :8] @ x[token]) * (gate_up[e, 8:] @ x[token]))
                       for k, e in enumerate(experts[token].tolist()))
        torch.testing.assert_close(out[token], expected, atol=1e-4, rtol=1e-5)
    (out * torch.randn(out.shape, generator=generator)).sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() and t.grad.abs().sum() > 0
               for t in (x, gate_up, down, weights))


def test_save_pretrained_writes_the_official_layout_and_loads_back(tmp_path):
    """What we save has the official per-expert keys and config (auto_map, architectures) and loads back without
    remote code to the same logits."""
    model = official_model()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == OFFICIAL_AUTO_MAP and saved["architectures"] == ["LLaDA2MoeModelLM"]
    assert saved["block_size"] == BLOCK and saved["n_group"] == 4 and saved["partial_rotary_factor"] == 0.5
    official, ours = load_file(OFFICIAL / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert set(ours) == set(official)
    for key, tensor in official.items():
        torch.testing.assert_close(ours[key], tensor.float(), atol=0, rtol=0)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert isinstance(reloaded, LLaDA2MoeModelLM) and AutoConfig.from_pretrained(tmp_path).model_type == "llada2_moe"
    assert max_error(reloaded, official_outputs()) <= PARITY


def test_attention_is_causal_across_blocks_and_bidirectional_inside_one():
    model = official_model()
    ids = official_outputs()["input_ids"]
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 5) % MASK  # block 2 (positions 8..11)
    with torch.no_grad():
        before, after = model(ids).logits, model(changed).logits
    assert torch.equal(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8], after[:, 8], atol=1e-4)
    assert not torch.allclose(before[:, 12:], after[:, 12:], atol=1e-4)
    assert is_block_causal("llada2_moe")


def test_a_block_run_against_the_cache_of_finished_blocks_gives_the_full_forward_logits():
    """Left-padded: block k's logits from a forward of block k alone, against a cache written by a canvas whose later
    blocks hold other tokens, equal the full forward's."""
    model = official_model()
    outputs = official_outputs()
    ids, mask = outputs["padded_input_ids"], outputs["padded_attention_mask"]
    offsets = (mask == 0).sum(1).tolist()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        for block in range(1, 4):
            other = ids.clone()
            for row, offset in enumerate(offsets):
                other[row, offset + block * BLOCK:] = (ids[row, offset + block * BLOCK:] + 3) % MASK
            cache = model(other, attention_mask=mask, use_cache=True).past_key_values
            for row, offset in enumerate(offsets):
                positions = torch.arange(offset + block * BLOCK, offset + (block + 1) * BLOCK)
                positions = positions[positions < ids.shape[1]]
                if not len(positions):
                    continue
                row_cache = [(keys[row:row + 1], values[row:row + 1]) for keys, values in cache]
                logits = model(ids[row:row + 1, positions], attention_mask=mask[row:row + 1],
                               past_key_values=row_cache, cache_position=positions).logits
                torch.testing.assert_close(logits[0], full[row, positions], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("field", "value"), [("rope_scaling", {"rope_type": "yarn"}), ("n_group", 3),
                                              ("topk_group", 5), ("num_experts_per_tok", 5), ("block_size", 0),
                                              ("partial_rotary_factor", 0.1), ("moe_intermediate_size", 20)])
def test_unsupported_config_fails_with_a_message_naming_the_field(field, value):
    fields = dict(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                  moe_intermediate_size=16, pad_token_id=0)
    fields[field] = value
    with pytest.raises(ValueError, match=field):
        LLaDA2MoeModelLM(LLaDA2MoeConfig(**fields))


def test_default_config_is_llada2_mini():
    config = LLaDA2MoeConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (2048, 20,
                                                                                                              256, 8)
    assert (config.n_group, config.topk_group, config.first_k_dense_replace, config.rope_dim) == (8, 4, 1, 64)
    assert (config.mask_token_id, config.block_size) == (156895, 32)

"""Native SDAR: parity with the official code (tests/data/sdar_official, written by the official modeling_sdar.py:
tools/make_sdar_parity_fixture.py), Auto-class loading without remote code, the block-causal mask and the exact
cache of finished blocks."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import dllm_ais  # noqa: F401  (registers "sdar")
from dllm_ais.config import ConfigError, GRPOConfig
from dllm_ais.dry_run import recipe_is_diffusion
from dllm_ais.loading import load_model
from dllm_ais.models import SDARConfig, SDARForCausalLM, SDARModel
from dllm_ais.policy import is_diffusion

OFFICIAL = Path(__file__).parent / "data" / "sdar_official"
OFFICIAL_AUTO_MAP = {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}
MASK, PAD, BLOCK = 271, 270, 4


def official_model() -> SDARForCausalLM:
    return load_model(str(OFFICIAL), torch.float32).eval()


def official_outputs() -> dict[str, torch.Tensor]:
    return load_file(OFFICIAL / "official_outputs.safetensors")


def tiny_model(**overrides) -> SDARForCausalLM:
    fields = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0, block_size=BLOCK,
                  initializer_range=0.1, mask_token_id=MASK, pad_token_id=PAD)
    fields.update(overrides)
    torch.manual_seed(0)
    return SDARForCausalLM(SDARConfig(**fields)).eval()


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1-D token rows right-aligned behind pad tokens to a common length, and the attention mask."""
    width = max(len(row) for row in rows)
    ids, mask = torch.full((len(rows), width), PAD), torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row):], mask[index, width - len(row):] = row, 1
    return ids, mask


def test_official_checkpoint_loads_without_remote_code_and_gives_the_official_logits():
    """The official code's checkpoint (its config.json carries an auto_map to modeling_sdar.py, which the directory
    does not hold) loads through dllm_ais' refusing path as our class, with the official block-causal logits."""
    config = json.loads((OFFICIAL / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["auto_map"] == OFFICIAL_AUTO_MAP
    assert not list(OFFICIAL.glob("*.py"))
    model = official_model()
    assert isinstance(model, SDARForCausalLM)
    outputs = official_outputs()
    with torch.no_grad():
        logits = model(outputs["input_ids"]).logits
    torch.testing.assert_close(logits, outputs["logits"], atol=1e-5, rtol=0)
    base = AutoModel.from_pretrained(OFFICIAL, dtype=torch.float32)
    assert isinstance(base, SDARModel) and base.embed_tokens.weight.dtype == torch.float32


def test_official_checkpoint_round_trips_with_its_auto_map(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(OFFICIAL)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == OFFICIAL_AUTO_MAP and saved["architectures"] == ["SDARForCausalLM"]
    assert saved["block_size"] == BLOCK and saved["mask_token_id"] == MASK and saved["head_dim"] == 8
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(OFFICIAL / "model.safetensors"))
    assert AutoConfig.from_pretrained(tmp_path).model_type == "sdar"


def test_the_hub_config_fields_load(tmp_path):
    """SDAR-4B-Chat's config.json also names the official training kernels (attn_implementation flex_attention,
    fuse_cross_entropy, ...): the checkpoint still loads and runs through SDPA."""
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).write_bytes((OFFICIAL / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(attn_implementation="flex_attention", debug=False, ep_size=1, micro_forward=False,
                  skip_checkpoint=False, use_deepep=False, sliding_window=None, max_window_layers=36)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(str(tmp_path), torch.float32)
    outputs = official_outputs()
    with torch.no_grad():
        torch.testing.assert_close(model(outputs["input_ids"]).logits, outputs["logits"], atol=1e-5, rtol=0)


def official_greedy_block_decode(model, prompt: torch.Tensor, gen_length: int, block_length: int,
                                  steps: int) -> torch.Tensor:
    """The official block-diffusion generation (generate.py) at its greedy settings, on our model and its cache:
    blocks of `block_length` counted from the prompt's first token; each block denoised by forwards of that block
    alone against the cache, committing the most confident masked positions (⌈block_length / steps⌉-style counts,
    the official `get_num_transfer_tokens`); a filled block's clean keys/values stored by one more forward."""
    prompt_length = prompt.shape[1]
    num_blocks = -(-(prompt_length + gen_length) // block_length)
    canvas = torch.full((1, num_blocks * block_length), MASK)
    canvas[:, :prompt_length] = prompt
    counts = [block_length // steps + (step < block_length % steps) for step in range(steps)]
    with torch.no_grad():
        cache = model(canvas, use_cache=True).past_key_values  # the prompt's full blocks are final from here on
        for block in range(prompt_length // block_length, num_blocks):
            positions = torch.arange(block * block_length, (block + 1) * block_length)
            for count in counts:
                masked = canvas[0, positions] == MASK
                if not masked.any():
                    break
                logits = model(canvas[:, positions], past_key_values=cache, cache_position=positions).logits[0]
                confidence, proposal = logits.softmax(-1).max(-1)
                chosen = torch.where(masked, confidence, -torch.inf).topk(count).indices
                canvas[0, positions[chosen]] = proposal[chosen]
            model(canvas[:, positions], past_key_values=cache, cache_position=positions)
    return canvas


def test_greedy_block_decoding_against_the_cache_reproduces_the_official_generation():
    outputs = official_outputs()
    with safe_open(OFFICIAL / "official_outputs.safetensors", "pt") as handle:
        settings = json.loads(handle.metadata()["generation"])
    assert settings["remasking_strategy"] == "low_confidence_static" and settings["block_length"] == BLOCK
    generated = official_greedy_block_decode(official_model(), outputs["prompt_ids"], settings["gen_length"],
                                             settings["block_length"], settings["denoising_steps"])
    assert torch.equal(generated, outputs["generated_ids"])


def test_attention_is_causal_across_blocks_and_bidirectional_inside_one():
    model = tiny_model()
    ids = torch.randint(0, MASK, (2, 14), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 5) % MASK  # block 2 (positions 8..11)
    with torch.no_grad():
        before, after = model(ids).logits, model(changed).logits
    assert torch.equal(before[:, :8], after[:, :8])  # earlier blocks never see a later block
    assert not torch.allclose(before[:, 8], after[:, 8], atol=1e-4)  # inside the block, earlier positions see it
    assert not torch.allclose(before[:, 12:], after[:, 12:], atol=1e-4)  # later blocks see it


def test_left_padding_leaves_the_real_tokens_logits_and_their_blocks_unchanged():
    """Blocks are counted from each row's first real token, so padding shifts no block boundary."""
    model = tiny_model()
    ids = torch.randint(0, MASK, (2, 10), generator=torch.Generator().manual_seed(2))
    rows = [ids[0, :7], ids[1]]
    padded, mask = left_padded(rows)
    with torch.no_grad():
        logits = model(padded, attention_mask=mask).logits
        for index, row in enumerate(rows):
            torch.testing.assert_close(logits[index, -len(row):], model(row[None]).logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("padded", [False, True])
def test_a_block_run_against_the_cache_of_finished_blocks_gives_the_full_forward_logits(padded):
    """Block k's logits from a forward of block k alone, against a cache written by a canvas whose blocks after k
    hold other tokens, equal the full forward's: finished blocks' keys/values are exact and later ones unseen."""
    model = official_model()
    ids = official_outputs()["input_ids"]
    ids, mask = left_padded([ids[0, :11], ids[1]]) if padded else (ids, torch.ones_like(ids))
    offsets = (mask == 0).sum(1).tolist()  # blocks start at each row's first real token
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        for block in range(1, 4):
            other = ids.clone()
            for row, offset in enumerate(offsets):  # every token from this block on replaced
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


def test_forward_traces_as_one_graph_without_host_synchronisation():
    """The mask is built from tensors only: dynamo traces the padded forward whole (a host read such as
    bool(mask.all()) would break the graph, which fullgraph=True turns into an error)."""
    model = tiny_model()
    ids = torch.randint(0, MASK, (2, 9), generator=torch.Generator().manual_seed(3))
    padded, mask = left_padded([ids[0, :7], ids[1]])
    with torch.no_grad():
        expected = model(padded, attention_mask=mask).logits
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(padded, attention_mask=mask).logits, expected, atol=1e-6, rtol=0)


def test_logits_to_keep_selects_positions():
    model = tiny_model()
    ids = torch.randint(0, MASK, (1, 9))
    with torch.no_grad():
        full = model(ids).logits
        torch.testing.assert_close(model(ids, logits_to_keep=torch.tensor([1, 6])).logits, full[:, [1, 6]])
        torch.testing.assert_close(model(ids, logits_to_keep=3).logits, full[:, -3:])


@pytest.mark.parametrize(("field", "value"), [("use_sliding_window", True), ("rope_scaling", {"rope_type": "yarn"}),
                                              ("block_size", 0), ("num_key_value_heads", 3)])
def test_unsupported_config_fails_with_a_message_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny_model(**{field: value})


def test_default_config_is_sdar_4b_chat():
    config = SDARConfig()
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2560, 32,
                                                                                                              8, 128)
    assert (config.block_size, config.mask_token_id, config.num_hidden_layers) == (4, 151669, 36)


@pytest.mark.parametrize("policy", ["auto", "diffusion"])
def test_a_run_takes_an_sdar_checkpoint_as_a_diffusion_policy(policy):
    """policy auto (or diffusion) trains an SDAR checkpoint with the diffusion policy (its runs:
    tests/test_sdar_training.py); autoregressive is refused."""
    config = GRPOConfig(model_name_or_path=str(OFFICIAL), task="digits", policy=policy)
    assert recipe_is_diffusion(config)
    with pytest.raises(ConfigError, match="'sdar' is block diffusion"):
        is_diffusion("autoregressive", AutoConfig.from_pretrained(OFFICIAL).model_type)

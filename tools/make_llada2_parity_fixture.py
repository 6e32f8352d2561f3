"""Write tests/data/llada2_official: a tiny random LLaDA2.0 mixture-of-experts checkpoint saved by the OFFICIAL
LLaDA2 code, with the official logits of block-causal forwards, one of them left-padded (tests/test_llada2.py
compares dllm_ais' native LLaDA2 against them). Not run by the tests.

    python tools/make_llada2_parity_fixture.py OFFICIAL_DIR [--output-dir tests/data/llada2_official]

OFFICIAL_DIR holds the official ``configuration_llada2_moe.py`` and ``modeling_llada2_moe.py`` (the Hub files of
inclusionAI/LLaDA2.0-mini; the fixture was written from the copies the dllm project vendors at
dllm/pipelines/llada2/models/, as of its commit d8cc1190 "Merge dev to main (#54)"). The official code
imports names transformers 5 no longer has: run this with transformers 4.56, e.g. ``pip install --no-deps --target DIR
transformers==4.56.2 tokenizers==0.22.1 huggingface_hub==0.35.3`` and ``PYTHONPATH=DIR``. It runs on the CPU as it is.

The official forward takes the attention mask as its ``generate`` passes it: a 4-D additive mask (0 = attended,
-inf = hidden) handed to SDPA unchanged, with explicit ``position_ids``. Its ``generate`` builds the block-causal
mask of one unpadded row (blocks from canvas index 0). For the left-padded batch the mask here is the same rule over
each row's position ids (its real tokens numbered from 0, padding 0): query i sees key j iff j is a real token and
j's block (position id // block_size) is not after i's. A padded query row so sees the first block's real keys,
never nothing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

OFFICIAL_AUTO_MAP = {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}
TINY_CONFIG = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, hidden_act="silu", use_qkv_bias=True, use_qk_norm=True,
                   use_bias=True, rms_norm_eps=1e-6, tie_word_embeddings=False, embedding_dropout=0.0,
                   attention_dropout=0.0, output_dropout=0.0, initializer_range=0.1, max_position_embeddings=64,
                   rope_theta=10000.0, use_cache=False, num_experts=8, num_shared_experts=2, num_experts_per_tok=3,
                   n_group=4, topk_group=2, routed_scaling_factor=2.5, moe_intermediate_size=32,
                   first_k_dense_replace=1, partial_rotary_factor=0.5, pad_token_id=270, eos_token_id=269,
                   block_size=4, mask_token_id=271, torch_dtype="bfloat16")
"""Layer 0 dense, layers 1-2 mixtures of 8 experts in 4 groups of 2 (3 chosen among the best 2 groups), 2 shared
experts' width; head_dim 8 != hidden_size / num_attention_heads, RoPE on the first 4 features of each head.
block_size and mask_token_id are dllm_ais' fields (the official config keeps them, its model reads neither): the
block of the mask below, and the generation's mask id."""
BLOCK_SIZE = TINY_CONFIG["block_size"]
MASK_ID = TINY_CONFIG["mask_token_id"]


def import_official(official_dir: Path, name: str = "llada2_moe") -> tuple[types.ModuleType, types.ModuleType]:
    """(configuration_<name>, modeling_<name>) imported from `official_dir` as one package (its relative import of
    the configuration resolves there): LLaDA2.0's files, or LLaDA2.1's with name="llada21_moe"."""
    package = f"{name}_official"
    module = types.ModuleType(package)
    module.__path__ = [str(official_dir)]
    sys.modules[package] = module
    return (importlib.import_module(f"{package}.configuration_{name}"),
            importlib.import_module(f"{package}.modeling_{name}"))


def official_mask(attention_mask: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(additive mask [B, 1, T, T] float32, position_ids [B, T]) of the block-causal rule (module docstring) for
    the rows' 2-D `attention_mask` [B, T]."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    blocks = position_ids // block_size
    allowed = (blocks[:, None, :] <= blocks[:, :, None]) & attention_mask.bool()[:, None, :]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    return additive[:, None], position_ids


def random_rows(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two unpadded canvases [2, 14] of random tokens with mask tokens in several blocks."""
    input_ids = torch.randint(0, TINY_CONFIG["eos_token_id"], (2, 14), generator=generator)
    input_ids[0, [5, 9, 10, 13]] = MASK_ID
    input_ids[1, 12:] = MASK_ID
    return input_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("official_dir", type=Path)
    parser.add_argument("--output-dir", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests/data/llada2_official")
    args = parser.parse_args()
    configuration, modeling = import_official(args.official_dir.resolve())

    torch.manual_seed(0)
    config = configuration.LLaDA2MoeConfig(**TINY_CONFIG)
    config.auto_map = OFFICIAL_AUTO_MAP
    config.architectures = ["LLaDA2MoeModelLM"]
    model = modeling.LLaDA2MoeModelLM(config).eval()
    with torch.no_grad():  # norms away from 1 and expert biases away from 0, so that a misplaced one shows
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                parameter.add_(0.2 * torch.randn_like(parameter))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    model.to(torch.bfloat16)  # stored in bfloat16 (half the bytes)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output_dir, safe_serialization=True)
    # The logits come from the saved checkpoint loaded back in float32 by the official code (SDPA attention).
    model = modeling.LLaDA2MoeModelLM.from_pretrained(args.output_dir, torch_dtype=torch.float32,
                                                      attn_implementation="sdpa").eval()

    input_ids = random_rows(torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    padded_ids = torch.full_like(input_ids, TINY_CONFIG["pad_token_id"])
    padded_ids[1], padded_ids[0, 5:] = input_ids[1], input_ids[0, 5:]
    padded_mask = torch.ones_like(input_ids)
    padded_mask[0, :5] = 0
    outputs = {"input_ids": input_ids, "padded_input_ids": padded_ids, "padded_attention_mask": padded_mask}
    with torch.no_grad():
        for name, ids, mask in (("logits", input_ids, attention_mask), ("padded_logits", padded_ids, padded_mask)):
            additive, position_ids = official_mask(mask, BLOCK_SIZE)
            outputs[name] = model(ids, attention_mask=additive, position_ids=position_ids).logits.contiguous()
        alone = model(padded_ids[:1, 5:], attention_mask=official_mask(padded_mask[:1, 5:], BLOCK_SIZE)[0]).logits
    # The padded row's real tokens get the logits of the row alone (the mask rule above hides the padding).
    torch.testing.assert_close(outputs["padded_logits"][0, 5:], alone[0], atol=1e-5, rtol=0)
    save_file(outputs, args.output_dir / "official_outputs.safetensors",
              metadata={"block_size": str(BLOCK_SIZE), "mask_token_id": str(MASK_ID),
                        "attention_mask": json.dumps("additive 4-D block-causal mask over each row's position ids "
                                                     "(cumsum(attention_mask) - 1, padding 0), padded keys hidden")})
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()

"""Write tests/data/sdar_official: a tiny random SDAR checkpoint saved by the OFFICIAL SDAR code, with the official
logits of a full-sequence forward and the official greedy block-diffusion generation (tests/test_sdar.py compares
dllm_ais' native SDAR against them). Not run by the tests.

    python tools/make_sdar_parity_fixture.py OFFICIAL_DIR [--output-dir tests/data/sdar_official]

OFFICIAL_DIR holds the official ``configuration_sdar.py`` and ``modeling_sdar.py`` (JetAstra/SDAR,
training/model/SDAR-4B-Chat/, identical to the Hub's JetLM/SDAR-*-Chat files) and the repository's ``generate.py``.
The official code targets transformers 4.52 (it imports names transformers 5 no longer has): run this with
transformers 4.52.x and einops importable, e.g. ``pip install --target DIR transformers==4.52.4 tokenizers==0.21.4
huggingface_hub==0.34.4`` and ``PYTHONPATH=DIR``.

The official code needs CUDA-only kernels that this CPU run replaces, none of them on the numerics of a float32
forward:

- ``flash_attn.ops.triton.layer_norm.rms_norm_fn`` (its RMSNorm): w * x / sqrt(mean(x²) + eps) in float32, the
  formula the official file keeps as its commented-out fallback;
- ``flash_attn.flash_attn_func`` (its attention when the mask allows every key, i.e. decoding one block against
  its cache): non-causal softmax(q kᵀ · scale) v over the grouped key/value heads, through SDPA;
- ``fused_linear_diffusion_cross_entropy`` (a Triton training loss, imported at module load): absent; only training
  would call it.

The generation is the official ``block_diffusion_generate`` with its sampling function replaced by argmax (the
official one draws with ``torch.multinomial``): each position's proposal is its most likely token and its
confidence that token's probability, so ``low_confidence_static`` commits the most confident positions first.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OFFICIAL_AUTO_MAP = {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}
TINY_CONFIG = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0,
                   rms_norm_eps=1e-6, initializer_range=0.1, block_size=4, mask_token_id=271, bos_token_id=268,
                   eos_token_id=269, pad_token_id=270, tie_word_embeddings=False, use_cache=False,
                   fuse_cross_entropy=True, torch_dtype="bfloat16")
"""head_dim 8 != hidden_size / num_attention_heads, as in SDAR-4B (2560 / 32 heads, head_dim 128)."""
GENERATION = dict(prompt_length=6, gen_length=10, block_length=4, denoising_steps=4,
                  remasking_strategy="low_confidence_static")


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias=None, eps: float = 1e-6, **_) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to x's dtype, times the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def sdpa_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                         softmax_scale: float | None = None, **_) -> torch.Tensor:
    """flash_attn_func's contract ([B, L, H, D] inputs and output, grouped key/value heads) through SDPA."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=softmax_scale, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def install_cpu_stand_ins(package: str) -> None:
    """Register the CPU stand-ins (module docstring) under the names the official code imports."""
    names = ["flash_attn", "flash_attn.ops", "flash_attn.ops.triton", "flash_attn.ops.triton.layer_norm",
             "flash_attn.bert_padding", f"{package}.fused_linear_diffusion_cross_entropy"]
    modules = {name: types.ModuleType(name) for name in names}
    for name, module in modules.items():  # a spec, so that transformers' availability probes can look them up
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    modules["flash_attn"].flash_attn_func = sdpa_flash_attn_func
    modules["flash_attn.ops.triton.layer_norm"].rms_norm_fn = reference_rms_norm
    modules[f"{package}.fused_linear_diffusion_cross_entropy"].FusedLinearDiffusionCrossEntropyLoss = None
    sys.modules.update(modules)


def import_official(official_dir: Path) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """(configuration_sdar, modeling_sdar, generate) imported from `official_dir`."""
    package = "sdar_official"
    module = types.ModuleType(package)
    module.__path__ = [str(official_dir)]
    sys.modules[package] = module
    install_cpu_stand_ins(package)
    configuration = importlib.import_module(f"{package}.configuration_sdar")
    modeling = importlib.import_module(f"{package}.modeling_sdar")
    spec = importlib.util.spec_from_file_location("sdar_generate", official_dir / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return configuration, modeling, generate


def greedy_proposals(logits: torch.Tensor, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax token, its probability) per position: the greedy stand-in for the official sampling function."""
    probabilities = logits.float().softmax(-1)
    confidence, tokens = probabilities.max(-1)
    return tokens, confidence


def block_causal_mask(length: int, block_size: int) -> torch.Tensor:
    """[1, length, length] bool: query i sees key j iff j's block (j // block_size) is not after i's, the mask the
    official generate passes (its block-lower-triangular matrix)."""
    blocks = torch.arange(length) // block_size
    return (blocks[None, :] <= blocks[:, None])[None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("official_dir", type=Path)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parents[1] / "tests/data/sdar_official")
    args = parser.parse_args()
    configuration, modeling, generate = import_official(args.official_dir.resolve())

    torch.manual_seed(0)
    config = configuration.SDARConfig(**TINY_CONFIG)
    config.auto_map = OFFICIAL_AUTO_MAP
    config.architectures = ["SDARForCausalLM"]
    model = modeling.SDARForCausalLM(config).eval()
    with torch.no_grad():  # norms away from their all-ones initialisation, so that a misplaced norm shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.2 * torch.randn_like(parameter))
    model.to(torch.bfloat16)  # stored in bfloat16 (half the bytes)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output_dir, safe_serialization=True)
    # The outputs come from the saved checkpoint loaded back in float32 by the official code: a fresh model, whose
    # RoPE frequencies (a buffer the bfloat16 cast above rounded) are float32 again.
    model = modeling.SDARForCausalLM.from_pretrained(args.output_dir, torch_dtype=torch.float32).eval()

    mask_id = config.mask_token_id
    input_ids = torch.randint(0, mask_id, (2, 14))
    input_ids[0, [5, 9, 10, 13]] = mask_id  # masked positions in several blocks, as a scoring forward has
    input_ids[1, 12:] = mask_id
    with torch.no_grad():
        logits = model(input_ids, attention_mask=block_causal_mask(14, config.block_size)).logits

    generate.sample_with_temperature_topk_topp = greedy_proposals
    prompt = torch.randint(0, mask_id, (1, GENERATION["prompt_length"]))
    generated = generate.block_diffusion_generate(
        model, prompt={"input_ids": prompt}, mask_id=mask_id, gen_length=GENERATION["gen_length"],
        block_length=GENERATION["block_length"], denoising_steps=GENERATION["denoising_steps"],
        remasking_strategy=GENERATION["remasking_strategy"])

    save_file({"input_ids": input_ids, "logits": logits.contiguous(), "prompt_ids": prompt,
               "generated_ids": generated.contiguous()},
              args.output_dir / "official_outputs.safetensors",
              metadata={"generation": json.dumps(GENERATION), "attention_mask": "block-causal, block_size "
                        f"{config.block_size}, as the official generate builds it"})
    print(f"wrote {args.output_dir}: generated {generated[0, GENERATION['prompt_length']:].tolist()}")


if __name__ == "__main__":
    main()

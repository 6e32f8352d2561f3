"""Write tests/data/llada2_official/official_generate.safetensors: the OFFICIAL LLaDA2 ``generate`` (one row), greedy,
on the tiny checkpoint of tests/data/llada2_official, over a grid of its settings (tests/test_llada2_sampling.py
compares the sampler's batched decoding against every row). Not run by the tests.

    python tools/make_llada2_generate_fixture.py OFFICIAL_DIR [--checkpoint tests/data/llada2_official]

OFFICIAL_DIR and transformers 4.56 as for tools/make_llada2_parity_fixture.py (``PYTHONPATH=DIR``).

Greedy: the official draw (``_sample_with_temperature_topk_topp``) samples ``torch.multinomial`` of the softmax even at
temperature 0 (it divides by the temperature only when it is > 0, and never takes an argmax), so its generate has no
greedy mode. Here that one method is replaced by the argmax and its softmax probability (the confidence the
threshold reads); the rest of ``generate`` runs as published. The grid: prompts of 3, 4 and 6 tokens (inside a
block, a whole block, a block and a half; block_size 4), gen_length 8 and 6 (not a multiple of the block), steps per
block 1, 2 and 4, threshold 0.95, 0.5 and 0, minimal_topk 1 and 3 (3 caps 4 steps at gen_length // 3 = 2),
eos_early_stop off and on. The EOS id passed to ``generate`` is the token this random model generates most often
(so that completions stop at it); the prompts hold neither it nor the mask id. The model runs in float32 (the
checkpoint's bfloat16 weights loaded as float32), its block mask, which generate builds in bfloat16 (0 and −inf),
cast to float32 for SDPA.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_llada2_parity_fixture import MASK_ID, TINY_CONFIG, import_official  # noqa: E402

PROMPT_LENGTHS = (3, 4, 6)
GRID = {"gen_length": (8, 6), "steps": (1, 2, 4), "threshold": (0.95, 0.5, 0.0), "minimal_topk": (1, 3),
        "eos_early_stop": (False, True)}
BLOCK_LENGTH = TINY_CONFIG["block_size"]


def greedy_draw(self, logits, temperature=1.0, top_k=0, top_p=1.0):
    """The argmax of `logits` [..., V] and its softmax probability (the official draw's return, greedy)."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    confidence, token = probabilities.max(dim=-1)
    return token, confidence


def float32_mask(forward):
    """`forward` with its attention mask cast to float32: generate builds it in bfloat16 (0 and −inf, exact in
    both), which SDPA refuses next to the float32 queries of the float32 model."""
    def cast(*args, attention_mask=None, **kwargs):
        return forward(*args, attention_mask=attention_mask.float(), **kwargs)
    return cast


def official_completion(model, prompt: torch.Tensor, settings: dict, eos_id: int) -> torch.Tensor:
    """The completion tokens [n] the official generate returns for `prompt` [P] (its early stop returns the prompt
    too: cut off here)."""
    output = model.generate(prompt[None], temperature=0.0, block_length=BLOCK_LENGTH, eos_id=eos_id,
                            mask_id=MASK_ID, **settings)[0]
    if settings["eos_early_stop"] and output.shape[0] > prompt.shape[0] and bool((output[:prompt.shape[0]]
                                                                                  == prompt).all()):
        output = output[prompt.shape[0]:]
    return output


def fixture_tensors(prompts: list[torch.Tensor], settings: list[list[float]], prompt_index: list[int],
                    completions: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``generate`` fixture's tensors: the prompts and completions padded with −1, each row's settings (float64) and
    its prompt's index."""
    width = max(len(completion) for completion in completions)
    padded_prompts = torch.full((len(prompts), max(len(prompt) for prompt in prompts)), -1, dtype=torch.long)
    for index, prompt in enumerate(prompts):
        padded_prompts[index, :len(prompt)] = prompt
    return {"prompts": padded_prompts, "settings": torch.tensor(settings, dtype=torch.float64),
            "prompt_index": torch.tensor(prompt_index),
            "completions": torch.stack([torch.nn.functional.pad(c, (0, width - len(c)), value=-1) for c in completions])}


def generate_fixture_arguments(doc: str) -> argparse.Namespace:
    """The command line of a ``generate`` fixture tool (its `doc`'s first line as the description): the official
    code's directory and the tiny checkpoint (default tests/data/llada2_official)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("official_dir", type=Path)
    parser.add_argument("--checkpoint", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests/data/llada2_official")
    return parser.parse_args()


def main() -> None:
    args = generate_fixture_arguments(__doc__)
    _, modeling = import_official(args.official_dir.resolve())
    model = modeling.LLaDA2MoeModelLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32,
                                                      attn_implementation="sdpa").eval()
    model._sample_with_temperature_topk_topp = types.MethodType(greedy_draw, model)
    model.forward = float32_mask(model.forward)

    generator = torch.Generator().manual_seed(3)
    vocabulary = TINY_CONFIG["eos_token_id"]  # 0 … 268: no EOS, pad or mask id
    prompts = [torch.randint(0, vocabulary, (length,), generator=generator) for length in PROMPT_LENGTHS]
    probe_settings = dict(gen_length=8, steps=4, threshold=0.95, minimal_topk=1, eos_early_stop=False)
    counts = collections.Counter(token for prompt in prompts
                                 for token in official_completion(model, prompt, probe_settings, -1).tolist()
                                 if not any(bool((other == token).any()) for other in prompts))
    eos_id = counts.most_common(1)[0][0]

    rows, prompt_index, completions = [], [], []
    for values in itertools.product(*GRID.values()):
        settings = dict(zip(GRID, values))
        for index, prompt in enumerate(prompts):
            completion = official_completion(model, prompt, settings, eos_id)
            rows.append([float(value) for value in values])
            prompt_index.append(index)
            completions.append(completion)
    outputs = fixture_tensors(prompts, rows, prompt_index, completions)
    save_file(outputs, args.checkpoint / "official_generate.safetensors",
              metadata={"settings": ",".join(GRID), "eos_id": str(eos_id), "block_length": str(BLOCK_LENGTH),
                        "padding": "-1 after each prompt and completion"})
    stopped = sum(bool((c == eos_id).any()) for c in completions)
    print(f"wrote {len(completions)} official completions ({stopped} ending at EOS id {eos_id})")


if __name__ == "__main__":
    main()

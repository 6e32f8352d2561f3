"""Does a masked-diffusion warm start work out its answers, or copy them from what comes later? Teacher-forced
accuracy of every token of the clean worked demonstrations, under two maskings:

* ``token``: only that token is masked, the rest of the canvas is visible — the conditional i.i.d. masking trains
  most. In a worked demonstration a result reappears later (a column's digit in the line's total, the total in the
  next operation), so this accuracy can be high for a model that only copies;
* ``suffix``: that token and every later one are masked, the earlier ones visible — the conditional that decoding
  left to right needs, where nothing later can be copied: the model must compute the token.

    python tools/probe_warm_start.py --model dllm_ais/assets/tiny_llada_chain_sum --task chain_sum
    python tools/probe_warm_start.py --model embedded --task digits
    python tools/probe_warm_start.py --model embedded-llada-chain-sum --decode 128   # and how its decoder errs

Prints the accuracy over all demonstration tokens and over digit tokens, with the token counts, for each masking.
A warm start that decodes its worked answers right has both near 1; a large gap (token >> suffix) means its SFT
learned to copy, not to compute.

``--decode N`` also decodes N validation prompts greedily with d1's protocol (block 32, two tokens per step,
low-confidence remasking, no cache) and counts the completions that are exactly the clean demonstration, exactly
the noisy one (the planted mistake: a dropped first carry, a descending sort), or neither. GRPO learns fast from a
warm start whose wrong answers are mostly the planted mistake — one decision its own samples sometimes get right —
and slowly from one that errs somewhere different in every answer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from build_tiny_model import WARM_START_TASKS  # noqa: E402

from dllm_ais.config import GRPOConfig, with_d1_protocol  # noqa: E402
from dllm_ais.data import load_task_dataset  # noqa: E402
from dllm_ais.loading import load_model, load_tokenizer, special_tokens  # noqa: E402
from dllm_ais.policy import build_policy, sample_prompts  # noqa: E402
from dllm_ais.rewards import completion_texts  # noqa: E402
from dllm_ais.sft import build_sft_batch  # noqa: E402

MASKINGS = ("token", "suffix")


def probe_canvases(input_ids: torch.Tensor, start: int, stop: int, mask_token_id: int, masking: str) -> torch.Tensor:
    """One canvas [T] as ``stop - start`` rows: row k masks position ``start + k`` (``token``) or every position
    from ``start + k`` on (``suffix``)."""
    positions = torch.arange(input_ids.shape[0])
    targets = torch.arange(start, stop)[:, None]
    masked = positions == targets if masking == "token" else positions >= targets
    return torch.where(masked, mask_token_id, input_ids)


@torch.no_grad()
def probe_accuracy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int, stop: int,
                   mask_token_id: int, masking: str) -> torch.Tensor:
    """Whether the greedy prediction of each position in [start, stop) of one canvas is its token, under `masking`."""
    canvases = probe_canvases(input_ids, start, stop, mask_token_id, masking)
    logits = model(canvases, attention_mask=attention_mask.expand_as(canvases)).logits
    rows = torch.arange(stop - start)
    return logits[rows, rows + start].argmax(-1) == input_ids[start:stop]


def demonstration_kinds(completions: list[str], clean: list[str], noisy: list[str]) -> dict[str, int]:
    """How many `completions` are exactly their prompt's clean demonstration, exactly its noisy one, or neither
    (surrounding whitespace ignored; a prompt whose noisy demonstration is its clean one counts as clean)."""
    kinds = {"clean": 0, "noisy": 0, "other": 0}
    for completion, right, wrong in zip(completions, clean, noisy, strict=True):
        text = completion.strip()
        kinds["clean" if text == right.strip() else "noisy" if text == wrong.strip() else "other"] += 1
    return kinds


@torch.no_grad()
def decode_greedily(model, tokenizer, spec, prompts: list, batch_size: int = 64) -> list[str]:
    """The completions of d1's evaluation protocol (greedy, `with_d1_protocol`) at the warm start's length."""
    config = with_d1_protocol(GRPOConfig(policy="diffusion", task=spec.task, task_args=spec.task_args),
                              spec.gen_length, 32)
    policy = build_policy(config, model.config, tokenizer, temperature=0.0)
    max_prompt_length, device = spec.max_positions - spec.gen_length, next(model.parameters()).device
    rollouts = (sample_prompts(policy, model, tokenizer, prompts[start:start + batch_size], max_prompt_length, device,
                               None) for start in range(0, len(prompts), batch_size))
    return [text for rollout in rollouts for text in completion_texts(tokenizer, rollout)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a masked-diffusion warm start (directory, or `embedded`)")
    parser.add_argument("--task", choices=tuple(WARM_START_TASKS), default="chain_sum")
    parser.add_argument("--prompts", type=int, default=32, help="validation prompts whose demonstrations are probed")
    parser.add_argument("--decode", type=int, default=0, metavar="N",
                        help="also decode N validation prompts with d1's protocol and count clean / noisy / other")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = WARM_START_TASKS[args.task]
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, torch.float32).eval()
    mask_token_id = special_tokens(tokenizer, model.config, diffusion=True).mask_token_id
    rows = load_task_dataset(spec.task, "validation", size=args.prompts, seed=args.seed, task_args=spec.task_args)
    demonstrations = spec.demonstrations(rows, 0.0, args.seed)  # clean: no dropped carries, no reversed sorts
    input_ids, attention_mask, answer_mask = build_sft_batch(
        tokenizer, demonstrations["prompt"], demonstrations["completion"], spec.gen_length)
    prompt_length = input_ids.shape[1] - spec.gen_length
    digit_ids = torch.tensor([token.isdigit() for token in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))])
    correct = {masking: [] for masking in MASKINGS}
    is_digit = []
    for canvas, attention, completion in zip(input_ids, attention_mask, demonstrations["completion"]):
        stop = prompt_length + len(tokenizer(completion, add_special_tokens=False).input_ids)
        is_digit.append(digit_ids[canvas[prompt_length:stop]])
        for masking in MASKINGS:
            correct[masking].append(probe_accuracy(model, canvas, attention[None], prompt_length, stop,
                                                   mask_token_id, masking))
    is_digit = torch.cat(is_digit)
    print(f"{args.model} on {args.task}: teacher-forced greedy accuracy on the clean demonstrations of "
          f"{len(rows)} validation prompts ({len(is_digit)} tokens, {int(is_digit.sum())} digits)")
    print("| masking | all tokens | digits |\n| --- | ---: | ---: |")
    for masking in MASKINGS:
        hits = torch.cat(correct[masking]).float()
        print(f"| {masking} | {hits.mean():.3f} | {hits[is_digit].mean():.3f} |")
    if args.decode:
        rows = load_task_dataset(spec.task, "validation", size=args.decode, seed=args.seed, task_args=spec.task_args)
        completions = decode_greedily(model, tokenizer, spec, list(rows["prompt"]))
        kinds = demonstration_kinds(completions, list(spec.demonstrations(rows, 0.0, args.seed)["completion"]),
                                    list(spec.demonstrations(rows, 1.0, args.seed)["completion"]))
        print(f"greedy completions under d1's protocol (gen {spec.gen_length}, {len(rows)} validation prompts): "
              + ", ".join(f"{count} {kind}" for kind, count in kinds.items())
              + " (exactly the clean demonstration, exactly the noisy one, neither)")


if __name__ == "__main__":
    main()

"""Write tests/data/llada2_official/official_generate_21.safetensors: the OFFICIAL LLaDA2.1 ``generate`` (one row),
greedy, on the tiny checkpoint of tests/data/llada2_official, over a grid of its settings
(tests/test_llada21_sampling.py compares the sampler's batched editing decoder against every row). Not run by the
tests.

    python tools/make_llada21_generate_fixture.py OFFICIAL_DIR [--checkpoint tests/data/llada2_official]

OFFICIAL_DIR holds the official ``configuration_llada21_moe.py`` and ``modeling_llada21_moe.py`` as the dllm project
vendors them at dllm/pipelines/llada21/models/ (as of its commit 41cdda71 "Fix and clean up LLaDA2/LLaDA2.1
pipelines"); transformers 4.56 as for tools/make_llada2_parity_fixture.py (``PYTHONPATH=DIR``). The files import only
torch and transformers (no dllm module): no import shim. The 2.1 classes load the 2.0 checkpoint as it is (same
architecture and parameter names; transformers warns that its model_type llada2_moe is not llada21_moe).

What the 2.1 code changes from 2.0 (tools/make_llada2_generate_fixture.py): its draw has a greedy mode (temperature 0:
the argmax and its softmax probability), so it runs as published; per block a ``while True`` loop replaces the
steps-per-block schedule (``steps`` and ``minimal_topk`` are read into a ``steps`` nothing uses): each iteration
commits the masked positions above ``threshold`` if at least ``num_to_transfer`` are, else the ``num_to_transfer``
most probable, and in the same iteration overwrites the block's committed, non-prompt positions whose argmax differs
from their token with probability above ``editing_threshold``; after the block has no mask, ``max_post_steps``
iterations at most, until one edits nothing; the EOS stop (only with ``eos_early_stop``) after a block once the
completion so far has no mask and holds EOS; the return is the completion alone, through its first EOS.

The attention mask: ``generate`` builds the block-causal mask as 0/1 in bfloat16 (2.0 took its log: 0/−inf). The
vendored forward converts only a bool mask (True = attended) to an additive one; a float mask goes through
``_prepare_4d_causal_attention_mask_for_sdpa``, which returns a 4-D mask unchanged, and SDPA ADDS it to the scores:
+1 on the block-causal keys, 0 on the keys of the window's later blocks, which stay attended (the window's earlier
positions see its last block at e^-1 of the weight). That is not the block-causal model (on the parity canvases its
logits are up to 2.8 from 2.0's), and on the CPU SDPA refuses the bfloat16 mask next to the float32 model's queries
anyway. So the one shim here: the forward gets the generate's mask as bool (``!= 0``), and the vendored forward's own
bool branch makes it the block-causal additive mask (nothing else of the mask, forward or generate is changed). The
tool checks that the 2.1 forward so gives the official 2.0 logits of official_outputs.safetensors, and prints how
many rows the published float mask would change (all of them).

The grid: prompts of 3, 4 and 6 tokens (the 2.0 fixture's: same seed), gen_length 8 and 6, threshold 0.95, 0.5 and 0
(this model's probabilities stay below 0.07: the first two commit one position per iteration, 0 the whole block at
once), editing_threshold off (EDITING_OFF = 2.0, above any probability: the sampler's None) and quartiles 1 and 3 of
the edit candidates' probabilities over the editing-off runs (an edit candidate: a committed, non-prompt position of
the block whose argmax differs from its token), rounded to 4 decimals; max_post_steps 0, 1 and 16, num_to_transfer 1,
eos_early_stop off and on: 108 settings, 324 rows. The EOS id is chosen by the 2.0 tool's rule (the token the model
generates most often and no prompt holds; here from the 2.1 generate at threshold 0.95 without editing).

Self-checks: the editing-off rows equal the 2.0 fixture's (official_generate.safetensors: same prompts and EOS id) at
one position per step (steps = block_length, minimal_topk 1). Edits are counted by watching (wrapping, not editing)
the forward's canvases and the returned completion: a completion position whose committed token later changes. The
script fails unless the grid holds edits, rows where max_post_steps 1 and 16 give different completions, and stops at
EOS, or if an edit candidate's probability lies within 1e-6 of its row's editing threshold (float32 rounding of these
~0.03 probabilities is ~1e-9). It prints those counts.
"""

from __future__ import annotations

import collections
import itertools
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_llada2_generate_fixture import fixture_tensors, generate_fixture_arguments  # noqa: E402
from make_llada2_parity_fixture import MASK_ID, TINY_CONFIG, import_official, official_mask  # noqa: E402

PROMPT_LENGTHS = (3, 4, 6)
EDITING_OFF = 2.0
EDITING_QUANTILES = (0.25, 0.75)
GRID = {"gen_length": (8, 6), "threshold": (0.95, 0.5, 0.0), "editing_threshold": (EDITING_OFF,),
        "max_post_steps": (0, 1, 16), "num_to_transfer": (1,), "eos_early_stop": (False, True)}
"""editing_threshold's other two values are measured at run time (module docstring)."""
BLOCK_LENGTH = TINY_CONFIG["block_size"]


class Watch:
    """Wraps (never edits) the official model's forward and draw: records each forward's canvas [T] and each draw's
    (argmax [block], probability [block]) of the current generate call, and hands the forward its mask as bool (or
    as float32, the published arithmetic, with `published_mask`)."""

    def __init__(self, model, published_mask: bool = False):
        self.canvases, self.draws = [], []
        forward, draw = model.forward, model._sample_with_temperature_topk_topp

        def watched_forward(input_ids, attention_mask=None, **kwargs):
            self.canvases.append(input_ids[0].clone())
            mask = attention_mask.float() if published_mask else attention_mask != 0
            return forward(input_ids, attention_mask=mask, **kwargs)

        def watched_draw(logits, **kwargs):
            token, probability = draw(logits, **kwargs)
            assert torch.equal(token, logits.argmax(-1))  # greedy: no draw swap needed
            torch.testing.assert_close(probability, torch.softmax(logits.float(), -1).amax(-1), rtol=0, atol=0)
            self.draws.append((token[0].clone(), probability[0].clone()))
            return token, probability

        model.forward = watched_forward
        model._sample_with_temperature_topk_topp = watched_draw

    def reset(self) -> None:
        self.canvases, self.draws = [], []

    def edits(self, prompt_length: int, completion: torch.Tensor) -> int:
        """How often a committed completion token was replaced, over the recorded canvases then the returned
        completion."""
        last, count = {}, 0
        rows = [canvas.tolist() for canvas in self.canvases] + [[MASK_ID] * prompt_length + completion.tolist()]
        for row in rows:
            for position, token in enumerate(row[prompt_length:], prompt_length):
                if token == MASK_ID:
                    continue
                count += position in last and last[position] != token
                last[position] = token
        return count

    def edit_candidate_probabilities(self, prompt_length: int) -> torch.Tensor:
        """The argmax probabilities of the committed, non-prompt block positions whose argmax differs from their
        token, over the recorded forwards (the positions editing_threshold decides)."""
        found = []
        for canvas, (token, probability) in zip(self.canvases, self.draws):
            block = canvas[-BLOCK_LENGTH:]
            positions = torch.arange(len(canvas) - BLOCK_LENGTH, len(canvas))
            candidate = (block != MASK_ID) & (positions >= prompt_length) & (token != block)
            found.append(probability[candidate])
        return torch.cat(found) if found else torch.zeros(0)


def official_completion(model, prompt: torch.Tensor, settings: dict, eos_id: int) -> torch.Tensor:
    """The completion tokens [n] the official generate returns for `prompt` [P] (it returns no prompt tokens)."""
    return model.generate(prompt[None], temperature=0.0, block_length=BLOCK_LENGTH, eos_id=eos_id,
                          mask_id=MASK_ID, **settings)[0]


def check_block_causal_logits(model, checkpoint: Path) -> None:
    """The 2.1 forward with the block-causal mask as bool gives the official 2.0 logits of the parity fixture; prints
    how far the published 0/1 float mask's are."""
    outputs = load_file(checkpoint / "official_outputs.safetensors")
    ids = outputs["input_ids"]
    additive, position_ids = official_mask(torch.ones_like(ids), BLOCK_LENGTH)
    with torch.no_grad():
        logits = model(ids, attention_mask=additive == 0, position_ids=position_ids).logits
        published = model(ids, attention_mask=(additive == 0).float(), position_ids=position_ids).logits
    torch.testing.assert_close(logits, outputs["logits"], atol=1e-5, rtol=0)
    print(f"2.1 forward, bool block-causal mask: the 2.0 official logits (max difference "
          f"{(logits - outputs['logits']).abs().max().item():.1e}); published 0/1 float mask: max difference "
          f"{(published - outputs['logits']).abs().max().item():.2f}")


def check_editing_off_rows_against_llada2(rows: list[dict], prompts: list[torch.Tensor], eos_id: int,
                                          checkpoint: Path) -> int:
    """Without editing, every row is the 2.0 fixture's (official_generate.safetensors: same prompts and EOS id) at
    one position per step (steps = block_length, minimal_topk 1) and the same gen_length and threshold (post steps
    and eos_early_stop change no token); returns how many rows were compared."""
    path = checkpoint / "official_generate.safetensors"
    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    old = load_file(path)
    assert int(metadata["eos_id"]) == eos_id
    assert all(torch.equal(row[row >= 0], prompt) for row, prompt in zip(old["prompts"], prompts))
    names = metadata["settings"].split(",")
    old_rows = {(int(index), *(row[name] for name in ("gen_length", "threshold", "steps", "minimal_topk",
                                                      "eos_early_stop"))): completion[completion >= 0]
                for index, row, completion in zip(old["prompt_index"], (dict(zip(names, values)) for values in
                                                                        old["settings"].tolist()), old["completions"])}
    compared = 0
    for row in rows:
        settings = row["settings"]
        if settings["editing_threshold"] == EDITING_OFF:
            key = (row["prompt"], settings["gen_length"], settings["threshold"], BLOCK_LENGTH, 1, 0.0)
            assert torch.equal(row["completion"], old_rows[key]), (row["settings"], row["prompt"])
            compared += 1
    return compared


def run_grid(model, watch: Watch, prompts: list[torch.Tensor], grid: dict, eos_id: int) -> list[dict]:
    """Per grid setting and prompt: settings, prompt index, completion, edit count, edit candidates' probabilities."""
    rows = []
    for values in itertools.product(*grid.values()):
        settings = dict(zip(grid, values))
        for index, prompt in enumerate(prompts):
            watch.reset()
            completion = official_completion(model, prompt, settings, eos_id)
            rows.append({"settings": settings, "prompt": index, "completion": completion,
                         "edits": watch.edits(len(prompt), completion),
                         "candidates": watch.edit_candidate_probabilities(len(prompt))})
    return rows


def twin(rows: list[dict], row: dict, **change) -> dict:
    """The row of the same prompt whose settings are `row`'s with `change`."""
    wanted = {**row["settings"], **change}
    return next(other for other in rows if other["prompt"] == row["prompt"] and other["settings"] == wanted)


def main() -> None:
    args = generate_fixture_arguments(__doc__)
    _, modeling = import_official(args.official_dir.resolve(), "llada21_moe")

    def load():
        return modeling.LLaDA2MoeModelLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32,
                                                         attn_implementation="sdpa").eval()

    model = load()
    check_block_causal_logits(model, args.checkpoint)  # before the watch wraps its forward
    watch = Watch(model)

    generator = torch.Generator().manual_seed(3)
    vocabulary = TINY_CONFIG["eos_token_id"]  # 0 … 268: no EOS, pad or mask id
    prompts = [torch.randint(0, vocabulary, (length,), generator=generator) for length in PROMPT_LENGTHS]
    probe_settings = dict(gen_length=8, threshold=0.95, editing_threshold=EDITING_OFF, max_post_steps=0,
                          num_to_transfer=1, eos_early_stop=False)
    counts = collections.Counter(token for prompt in prompts
                                 for token in official_completion(model, prompt, probe_settings, -1).tolist()
                                 if not any(bool((other == token).any()) for other in prompts))
    eos_id = counts.most_common(1)[0][0]

    off = run_grid(model, watch, prompts, GRID, eos_id)
    candidates = torch.cat([row["candidates"] for row in off])
    compared = check_editing_off_rows_against_llada2(off, prompts, eos_id, args.checkpoint)
    print(f"the {compared} rows without editing are the 2.0 fixture's at one position per step")
    editing = tuple(round(value, 4) for value in torch.quantile(candidates.double(),
                                                                torch.tensor(EDITING_QUANTILES,
                                                                             dtype=torch.float64)).tolist())
    grid = {**GRID, "editing_threshold": (EDITING_OFF, *editing)}
    rows = run_grid(model, watch, prompts, grid, eos_id)
    for row in rows:  # the editing-off rows are those of the first pass
        if row["settings"]["editing_threshold"] == EDITING_OFF:
            assert torch.equal(row["completion"], twin(off, row)["completion"]) and row["edits"] == 0
    margin = min((row["candidates"] - row["settings"]["editing_threshold"]).abs().min().item()
                 for row in rows if len(row["candidates"]) and row["settings"]["editing_threshold"] != EDITING_OFF)

    completions = [row["completion"] for row in rows]
    edited = sum(row["edits"] > 0 for row in rows)
    changed_by_editing = sum(not torch.equal(row["completion"], twin(rows, row, editing_threshold=EDITING_OFF)[
        "completion"]) for row in rows)
    post_matters = sum(row["settings"]["max_post_steps"] == 1 and not torch.equal(
        row["completion"], twin(rows, row, max_post_steps=16)["completion"]) for row in rows)
    post_zero_matters = sum(row["settings"]["max_post_steps"] == 0 and not torch.equal(
        row["completion"], twin(rows, row, max_post_steps=1)["completion"]) for row in rows)
    stopped = sum(bool((c == eos_id).any()) for c in completions)
    early_stop_changes = sum(row["settings"]["eos_early_stop"] and not torch.equal(
        row["completion"], twin(rows, row, eos_early_stop=False)["completion"]) for row in rows)
    published_model = load()
    published = run_grid(published_model, Watch(published_model, published_mask=True), prompts, grid, eos_id)
    published_differs = sum(not torch.equal(row["completion"], other["completion"])
                            for row, other in zip(rows, published))
    assert edited and changed_by_editing and post_matters and 0 < stopped < len(rows) and margin > 1e-6

    outputs = fixture_tensors(prompts, [[float(value) for value in row["settings"].values()] for row in rows],
                              [row["prompt"] for row in rows], completions)
    save_file(outputs, args.checkpoint / "official_generate_21.safetensors",
              metadata={"settings": ",".join(grid), "eos_id": str(eos_id), "block_length": str(BLOCK_LENGTH),
                        "editing_off": str(EDITING_OFF), "padding": "-1 after each prompt and completion",
                        "attention_mask": "block-causal (the generate's 0/1 mask handed to the forward as bool)"})
    print(f"editing thresholds {editing} (edit candidates' quartiles; nearest candidate probability {margin:.1e} "
          f"away); EOS id {eos_id}")
    print(f"wrote {len(rows)} official completions: {edited} with an edit ({changed_by_editing} differing from "
          f"editing off), {post_matters} where max_post_steps 1 and 16 differ ({post_zero_matters} where 0 and 1 "
          f"do), {stopped} ending at EOS, {early_stop_changes} changed by eos_early_stop; the published 0/1 float "
          f"mask would change {published_differs}")


if __name__ == "__main__":
    main()

"""LLaDA2.1's token-editing decoder, checked by enumerating every trajectory of a tiny model (as the complete ratio
was, tests/test_complete_ratio.py): the sampler draws the trajectories the decoder defines, with their probabilities;
what it records of a trajectory (the log-probs of its writes: each position's commit and each edit) is what the
trainer's decoder replay recomputes under another model; and what that ratio leaves out (the decoder's decisions).
Also the edit record through `Rollout.select` / `concatenate`."""

import itertools
import math

import pytest
import torch

from dllm_ais.likelihood.trajectory import decoder_trajectory_pieces, sum_pieces
from dllm_ais.rollout import Rollout
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler
from dllm_ais.sampling.diffusion.editing import EDITS, EditRecord, recorded_edits
from test_complete_ratio import MASK, TOKENS, TinyCanvasModel  # tests/ is on sys.path

PROMPT = [0, 1]
THRESHOLD, EDITING_THRESHOLD, MAX_POST_STEPS = 0.6, 0.3, 2


def editing_sampler(**overrides) -> MaskedDiffusionSampler:
    """A block-causal decoder of one block of 2 completion positions after a prompt of one block, sampled at τ = 1:
    the threshold rule (at least one commit a step) with token editing."""
    settings = dict(gen_length=2, block_length=2, steps=2, temperature=1.0, mask_token_id=MASK, eos_token_ids=(2,),
                    logits_shifted=False, block_causal=True, threshold=THRESHOLD, remasking="maskgit_plus",
                    editing_threshold=EDITING_THRESHOLD, max_post_steps=MAX_POST_STEPS)
    return MaskedDiffusionSampler(DiffusionSamplerConfig(**{**settings, **overrides}))


def completion_probabilities(model, completion: list[int]) -> torch.Tensor:
    """float64 [2, V]: softmax of the model's logits at the completion positions of the sampler's canvas
    [prompt | completion | two padding positions (the EOS id)]."""
    ids = torch.tensor([PROMPT + completion + [2, 2]])
    with torch.no_grad():
        return model(ids, logits_to_keep=torch.tensor([2, 3]))[0].double().softmax(-1)


def enumerate_trajectories(model) -> dict[tuple, tuple[float, float]]:
    """Every trajectory of the decoder from the prompt, written independently of the sampler: per step, the set of
    (position, token) it writes. Each maps to (log P(trajectory), Σ log q(written token)): the first sums over every
    draw leading to the same writes (candidates left uncommitted, drawn tokens not edited)."""
    trajectories = {}

    def visit(completion: list[int], post_steps: int, key: tuple, logprob: float, writes: float) -> None:
        masked = [i for i, token in enumerate(completion) if token == MASK]
        if not masked:
            post_steps += 1
            if post_steps > MAX_POST_STEPS:
                trajectories[key] = (logprob, writes)
                return
        q = completion_probabilities(model, completion)
        outcomes = {}
        for draws in itertools.product(TOKENS, repeat=len(completion)):
            probability = math.prod(float(q[i, token]) for i, token in enumerate(draws))
            confidence = {i: float(q[i, draws[i]]) for i in masked}
            committed = [i for i in masked if confidence[i] > THRESHOLD] or (
                [max(masked, key=lambda i: (confidence[i], -i))] if masked else [])
            edited = [i for i, token in enumerate(completion) if token != MASK and draws[i] != token
                      and float(q[i, draws[i]]) > EDITING_THRESHOLD]
            written = frozenset((i, draws[i]) for i in committed + edited)
            outcomes[written] = outcomes.get(written, 0.0) + probability
        for written, probability in outcomes.items():
            if not masked and not written:  # a step that began with no mask and edited nothing ends the block
                trajectories[key] = (logprob + math.log(probability), writes)
                continue
            after = list(completion)
            for i, token in written:
                after[i] = token
            visit(after, post_steps, key + (written,), logprob + math.log(probability),
                  writes + sum(math.log(float(q[i, token])) for i, token in written))

    visit([MASK, MASK], 0, (), 0.0, 0.0)
    return trajectories


def write_logprob(model, key: tuple) -> float:
    """Σ log q(written token) of the trajectory `key` under `model`, each write scored on the canvas of its step:
    defined whether or not `model`'s decoder could take that trajectory."""
    completion, total = [MASK, MASK], 0.0
    for written in key:
        q = completion_probabilities(model, completion)
        total += sum(math.log(float(q[i, token])) for i, token in written)
        for i, token in written:
            completion[i] = token
    return total


def trajectory_key(rollout: Rollout, row: int) -> tuple:
    """The enumeration's key of a sampled row: its writes (commits and edits) grouped by step, in step order."""
    edits = recorded_edits(rollout)
    by_step: dict[int, set] = {}
    first = [int(token) for token in rollout.completion_ids[row]]
    for index in reversed(range(edits.position.shape[1])):  # unwind the edits to the first commits
        if int(edits.position[row, index]) >= 0:
            first[int(edits.position[row, index])] = int(edits.previous_token[row, index])
    for position, step in enumerate(rollout.commit_step[row].tolist()):
        by_step.setdefault(step, set()).add((position, first[position]))
    for index in range(edits.position.shape[1]):
        if int(edits.position[row, index]) >= 0:
            by_step.setdefault(int(edits.step[row, index]), set()).add(
                (int(edits.position[row, index]), int(edits.token[row, index])))
    return tuple(frozenset(by_step[step]) for step in sorted(by_step))


@pytest.fixture(scope="module")
def sampled():
    """4000 rows of the decoder on model 0 (one call), and the enumeration under models 0 and 1."""
    model = TinyCanvasModel(seed=0)
    sampler = editing_sampler()
    prompts = torch.tensor([PROMPT]).expand(4000, -1)
    rollout = sampler.sample(model, prompts, generator=torch.Generator().manual_seed(0))
    return model, sampler, rollout, enumerate_trajectories(model), TinyCanvasModel(seed=1)


def test_the_sampler_draws_the_enumerated_trajectories_with_their_probabilities(sampled):
    """The enumerated probabilities sum to 1; the sampled rows hold edits, every sampled trajectory is an enumerated
    one, and each trajectory of probability ≥ 1 % is sampled at its frequency (within 4.5 binomial SE)."""
    _, _, rollout, trajectories, _ = sampled
    assert math.isclose(sum(math.exp(logprob) for logprob, _ in trajectories.values()), 1.0, abs_tol=1e-9)
    edits = recorded_edits(rollout)
    assert (edits.position >= 0).any(dim=1).float().mean() > 0.1
    counts: dict[tuple, int] = {}
    for row in range(rollout.sequences.shape[0]):
        key = trajectory_key(rollout, row)
        assert key in trajectories, key
        counts[key] = counts.get(key, 0) + 1
    rows = rollout.sequences.shape[0]
    for key, (logprob, _) in trajectories.items():
        probability = math.exp(logprob)
        if probability >= 0.01:
            assert abs(counts.get(key, 0) / rows - probability) <= 4.5 * math.sqrt(probability * (1 - probability) / rows)


def test_recorded_writes_are_the_trajectory_and_the_replay_scores_them_under_another_model(sampled):
    """A row's recorded log-probs sum to its writes' Σ log q; the decoder replay (what the trainer computes) under
    model 1 gives that trajectory's writes under model 1: the ratio the correction sees is exp(Σ writes₁ − Σ writes₀),
    defined also where model 1's decoder could not have taken the trajectory."""
    model, sampler, rollout, trajectories, other = sampled
    rows = torch.arange(0, 4000, 40)
    subset = rollout.select(rows)
    replayed = sum_pieces(decoder_trajectory_pieces(other, subset, sampler.decoder_logits, 1.0),
                          False).detach()
    own = sum_pieces(decoder_trajectory_pieces(model, subset, sampler.decoder_logits, 1.0), False).detach()
    for index in range(len(rows)):
        key = trajectory_key(subset, index)
        assert float(subset.step_logprobs[index].sum()) == pytest.approx(trajectories[key][1], abs=1e-5)
        assert float(own[index].sum()) == pytest.approx(trajectories[key][1], abs=1e-5)
        assert float(replayed[index].sum()) == pytest.approx(write_logprob(other, key), abs=1e-5)


def test_the_write_ratio_leaves_out_the_decisions(sampled):
    """Under model 0, the complete ratio P₁(τ) / P₀(τ) has expectation P₁(the trajectories model 0 can take) ≤ 1; the
    written tokens' ratio exp(Σ writes₁ − Σ writes₀) is the complete one divided by the decisions' ratio (which
    positions committed, which kept their token) and has another expectation: what the correction does not see, as
    it does not see the threshold rule's decisions without editing."""
    _, _, _, trajectories, other_model = sampled
    other = enumerate_trajectories(other_model)
    complete = sum(math.exp(other[key][0]) for key in trajectories if key in other)
    assert complete < 1 - 1e-3  # model 1's decoder cannot take some of model 0's trajectories
    writes_only = sum(math.exp(logprob + write_logprob(other_model, key) - writes)
                      for key, (logprob, writes) in trajectories.items())
    assert abs(writes_only - complete) > 1e-3


def test_the_edit_record_survives_select_and_concatenate(sampled):
    """Rows taken apart and joined back keep their edits (records of different widths padded to the widest)."""
    _, _, rollout, _, _ = sampled
    edits = recorded_edits(rollout)
    counts = (edits.position >= 0).sum(dim=1)
    few, many = int(counts.argmin()), int(counts.argmax())
    parts = [rollout.select(torch.tensor([few])), rollout.select(torch.tensor([many]))]
    parts[0].records[EDITS] = EditRecord(*(getattr(recorded_edits(parts[0]), name)[:, :int(counts[few])]
                                           for name in ("position", "step", "previous_token", "token", "logprob")))
    joined = Rollout.concatenate(parts)
    assert recorded_edits(joined).position.shape == (2, int(counts[many]))
    for row, source in enumerate((few, many)):
        assert trajectory_key(joined, row) == trajectory_key(rollout, source)


def test_editing_needs_a_block_causal_model_and_the_threshold_rule():
    """Editing without the threshold rule, or on a model that attends across blocks, is refused in one line."""
    with pytest.raises(ValueError, match="set threshold too"):
        editing_sampler(threshold=None)
    with pytest.raises(ValueError, match="block-causal"):
        editing_sampler(block_causal=False)
    with pytest.raises(ValueError, match="writes a position more than once"):
        editing_sampler().replay(TinyCanvasModel(), editing_sampler().sample(TinyCanvasModel(), torch.tensor([PROMPT])))

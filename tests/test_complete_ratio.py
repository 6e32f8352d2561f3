"""The complete ratio (issue 49): a decoder whose every choice has a probability, checked by enumerating every
trajectory of a tiny model; the trainer's side of the same choice; the correction that reads it; its settings."""

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import config_of
from dllm_ais.config import ConfigError, GRPOConfig, canonical_values
from dllm_ais.correction import RolloutCorrection
from dllm_ais.likelihood import trajectory_logprobs
from dllm_ais.likelihood.trajectory import sum_pieces
from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.rollout import Rollout
from dllm_ais.sampling.diffusion import (DiffusionSamplerConfig, MaskedDiffusionSampler, committed_set_logprobs,
                                        ranked_choice_logprobs, top_log_odds_scores)
from dllm_ais.settings import CorrectionSettings
from dllm_ais.sampling.diffusion.choice import COMMIT_CHOICE, CommitChoiceRecord, recorded_choice

TOKENS, EOS, MASK = (0, 1, 2), 2, 3
TEMPERATURE = 1.0


class TinyCanvasModel(torch.nn.Module):
    """Logits over 4 ids (the mask id never drawn) that depend on the whole canvas: small enough that every
    trajectory of a 2-3 position completion can be enumerated."""

    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(4, 8, generator=generator)
        self.position = torch.randn(8, 8, generator=generator)
        self.head = torch.randn(8, 4, generator=generator)
        self.config = SimpleNamespace(mask_token_id=MASK, eos_token_id=EOS, pad_token_id=None, max_sequence_length=8,
                                      model_type="tiny")

    def forward(self, input_ids, attention_mask=None, logits_to_keep=None, **unused):
        embedded = self.embed[input_ids]
        hidden = torch.tanh(embedded.mean(1, keepdim=True) + self.position[: input_ids.shape[1]] + embedded)
        logits = hidden @ self.head
        logits[..., MASK] = -math.inf
        return logits[:, logits_to_keep]


def sampler_of(gen_length: int, threshold: float | None = None, position_temperature: float = 0.5,
               temperature: float = TEMPERATURE, steps: int | None = None) -> MaskedDiffusionSampler:
    """One block of `gen_length` positions in `steps` steps (default: one commit per step), low_confidence."""
    return MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=gen_length, block_length=gen_length, steps=steps or gen_length, temperature=temperature,
        mask_token_id=MASK, eos_token_ids=(EOS,), logits_shifted=False,
        position_temperature=position_temperature, threshold=threshold))


def completion_logits(model, completion: list[int]) -> torch.Tensor:
    """float64 [L, V]: the model's logits at the completion positions of [prompt 0 | completion]."""
    ids = torch.tensor([[0] + completion])
    return model(ids, logits_to_keep=torch.arange(1, 1 + len(completion)))[0].double()


def choices_with_logprobs(masked: list[int], scores: dict[int, float], count: int | None, threshold: float | None,
                          position_temperature: float, forced_scores: dict[int, float] | None = None):
    """Every commit choice of one step and its log-probability, written out plainly: with a fixed `count`, each
    ordered tuple of distinct positions (Plackett–Luce on softmax(score / T)); with a `threshold`, each non-empty set
    (independent commits with probability σ((score − threshold) / T), one forced from softmax(forced score / T) when
    none)."""
    if threshold is None:
        for order in itertools.permutations(masked, count):
            left, logprob = list(masked), 0.0
            for position in order:
                total = sum(math.exp(scores[i] / position_temperature) for i in left)
                logprob += scores[position] / position_temperature - math.log(total)
                left.remove(position)
            yield order, logprob
        return
    commit = {i: 1 / (1 + math.exp(-(scores[i] - threshold) / position_temperature)) for i in masked}
    forced_total = sum(math.exp(forced_scores[i] / position_temperature) for i in masked)
    none_commit = math.prod(1 - commit[i] for i in masked)
    for size in range(1, len(masked) + 1):
        for chosen in itertools.combinations(masked, size):
            probability = math.prod(commit[i] if i in chosen else 1 - commit[i] for i in masked)
            if size == 1:
                probability += none_commit * math.exp(forced_scores[chosen[0]] / position_temperature) / forced_total
            yield chosen, math.log(probability)


def enumerate_trajectories(model, sampler: MaskedDiffusionSampler) -> dict[tuple, float]:
    """Every trajectory of `sampler` on `model` from the prompt [0] with its log-probability, by enumeration
    (low_confidence scores; a fixed count splits the block's positions evenly over its steps, the first steps taking
    the remainder). A trajectory is, per step, the candidates drawn at the masked positions and the commit choice; for
    threshold decoding, whose ratio sums over the candidates left uncommitted, the committed tokens and the commit
    set (the probabilities of the trajectories that differ only in discarded candidates added up)."""
    config = sampler.config
    counts = [config.gen_length // config.steps + (s < config.gen_length % config.steps) for s in range(config.steps)]
    trajectories = {}

    def visit(completion: list[int], step: int, key: tuple, logprob: float) -> None:
        masked = [i for i, token in enumerate(completion) if token == MASK]
        if not masked:
            trajectories[key] = logprob
            return
        logits = completion_logits(model, completion)
        token_logprobs, probabilities = (logits / config.temperature).log_softmax(-1), logits.softmax(-1)
        forced_scores = {i: float(probabilities[i].max()) for i in masked}
        outcomes = {}
        for candidates in itertools.product(TOKENS, repeat=len(masked)):
            drawn = dict(zip(masked, candidates))
            scores = {i: float(probabilities[i, token]) for i, token in drawn.items()}
            candidates_logprob = sum(float(token_logprobs[i, token]) for i, token in drawn.items())
            count = counts[step] if config.threshold is None else None
            for choice, choice_logprob in choices_with_logprobs(masked, scores, count, config.threshold,
                                                                 config.position_temperature, forced_scores):
                seen = (candidates, choice) if count else (tuple(drawn[i] for i in choice), choice)
                outcomes.setdefault(seen, []).append(candidates_logprob + choice_logprob)
        for (seen, choice), logprobs in outcomes.items():
            committed = dict(zip(choice, seen)) if config.threshold is not None else {
                i: token for i, token in zip(masked, seen) if i in choice}
            after = [committed.get(i, token) for i, token in enumerate(completion)]
            visit(after, step + 1, key + ((seen, choice),), logprob + float(torch.tensor(logprobs, dtype=torch.float64).logsumexp(0)))

    visit([MASK] * config.gen_length, 0, (), 0.0)
    return trajectories


def trajectory_key(rollout: Rollout, row: int, ordered: bool) -> tuple:
    """The enumeration's key of a recorded trajectory: per step, the candidates at the masked positions (the
    committed tokens, the recorded discarded candidates) and the commit choice in draw order (`ordered`, a fixed
    count); for threshold decoding, the committed tokens and the commit set."""
    completion, step = rollout.completion_ids[row].tolist(), rollout.commit_step[row]
    step = (step - step.min()).tolist()
    key = ()
    for s in range(max(step) + 1):
        masked = [i for i in range(len(step)) if step[i] >= s]
        committed = [i for i in masked if step[i] == s]
        if not ordered:
            key += ((tuple(completion[i] for i in committed), tuple(committed)),)
            continue
        candidates = tuple(completion[i] if step[i] == s else int(recorded_choice(rollout).discarded_candidates[row, i, s])
                           for i in masked)
        committed.sort(key=lambda i: int(recorded_choice(rollout).rank[row, i]))
        key += ((candidates, tuple(committed)),)
    return key


def rollout_of_trajectories(keys: list[tuple], gen_length: int, ordered: bool) -> Rollout:
    """A rollout holding every trajectory in `keys` (one row each), as the sampler would have recorded it."""
    rows = len(keys)
    completion = torch.full((rows, gen_length), MASK)
    commit_step = torch.zeros(rows, gen_length, dtype=torch.long)
    commit_rank = torch.zeros(rows, gen_length, dtype=torch.long)
    discarded = torch.full((rows, gen_length, gen_length), -1)
    for row, key in enumerate(keys):
        for step, (candidates, choice) in enumerate(key):
            masked = [i for i in range(gen_length) if completion[row, i] == MASK] if ordered else choice
            for position, candidate in zip(masked, candidates):
                if position in choice:
                    completion[row, position] = candidate
                    commit_step[row, position] = step
                    commit_rank[row, position] = choice.index(position) if ordered else 0
                else:
                    discarded[row, position, step] = candidate
    sequences = torch.cat([torch.zeros(rows, 1, dtype=torch.long), completion], dim=1)
    return Rollout(sequences=sequences, attention_mask=torch.ones_like(sequences),
                   completion_mask=torch.ones_like(completion, dtype=torch.bool),
                   step_logprobs=torch.zeros(rows, gen_length), commit_step=commit_step, prompt_length=1,
                   records={COMMIT_CHOICE: CommitChoiceRecord(torch.zeros(rows, gen_length), commit_rank,
                                                              discarded if ordered else None)})


RULES = [pytest.param(None, 0.5, 2, id="fixed-count-gumbel-top-k"),
         pytest.param(0.4, 0.1, None, id="threshold-bernoulli")]


@pytest.mark.parametrize("threshold, position_temperature, steps", RULES)
def test_recorded_logprob_is_the_exact_probability_of_the_trajectory(threshold, position_temperature, steps):
    """Every trajectory's probability, enumerated, sums to 1; each sampled trajectory's recorded log-prob
    (step_logprobs + choice_logprobs) is its enumerated log-probability; the trainer's replay (trajectory estimator +
    `choice_logprobs`) gives every trajectory that probability, so it too sums to 1 — the ratio of two such
    replays is complete, and 1 on the model that sampled."""
    model, sampler = TinyCanvasModel(), sampler_of(3, threshold, position_temperature, steps=steps)
    ordered = threshold is None
    trajectories = enumerate_trajectories(model, sampler)
    assert math.fsum(math.exp(v) for v in trajectories.values()) == pytest.approx(1.0, abs=1e-9)

    rollout = sampler.sample(model, torch.zeros(64, 1, dtype=torch.long), generator=torch.Generator().manual_seed(0))
    recorded = (rollout.step_logprobs + recorded_choice(rollout).logprobs).sum(1)
    expected = torch.tensor([trajectories[trajectory_key(rollout, row, ordered)] for row in range(64)], dtype=torch.float64)
    torch.testing.assert_close(recorded.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(sampler.choice_logprobs(model, rollout), recorded_choice(rollout).logprobs)

    keys = list(trajectories)
    every = rollout_of_trajectories(keys, 3, ordered)
    trainer = (trajectory_logprobs(model, every, MASK, TEMPERATURE) + sampler.choice_logprobs(model, every)).sum(1)
    torch.testing.assert_close(trainer.double(), torch.tensor([trajectories[k] for k in keys], dtype=torch.float64), atol=1e-5, rtol=0)
    assert float(torch.logsumexp(trainer.double(), 0)) == pytest.approx(0.0, abs=1e-5)


def test_the_committed_set_is_the_drawn_order_summed_out():
    """experimental.commit_choice_as_set: a fixed count's recorded choice log-prob is its set's — the enumerated
    trajectories that differ only in a step's draw order added up — on the sampler's side and in the trainer's replay,
    whose probabilities again sum to 1."""
    model, ordered = TinyCanvasModel(), sampler_of(3, None, 0.5, steps=2)
    as_set = MaskedDiffusionSampler(dataclasses.replace(ordered.config, commit_choice_as_set=True))

    def unordered(key: tuple) -> tuple:
        return tuple((candidates, tuple(sorted(choice))) for candidates, choice in key)

    grouped = {}
    for key, logprob in enumerate_trajectories(model, ordered).items():
        grouped.setdefault(unordered(key), []).append(logprob)
    sets = {key: float(torch.tensor(v, dtype=torch.float64).logsumexp(0)) for key, v in grouped.items()}
    assert len(sets) < sum(map(len, grouped.values()))  # two commits in the first step: two orders of each set
    assert math.fsum(math.exp(v) for v in sets.values()) == pytest.approx(1.0, abs=1e-9)

    rollout = as_set.sample(model, torch.zeros(64, 1, dtype=torch.long), generator=torch.Generator().manual_seed(0))
    recorded = (rollout.step_logprobs + recorded_choice(rollout).logprobs).sum(1)
    expected = [sets[unordered(trajectory_key(rollout, row, True))] for row in range(64)]
    torch.testing.assert_close(recorded.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(as_set.choice_logprobs(model, rollout), recorded_choice(rollout).logprobs)
    keys = list(sets)
    every = rollout_of_trajectories(keys, 3, True)
    trainer = (trajectory_logprobs(model, every, MASK, TEMPERATURE) + as_set.choice_logprobs(model, every)).sum(1)
    torch.testing.assert_close(trainer.double(), torch.tensor([sets[k] for k in keys], dtype=torch.float64),
                               atol=1e-5, rtol=0)


def test_the_set_probability_of_each_count_matches_its_orders_and_its_gradient_is_finite():
    """`committed_set_logprobs` = log Σ over the set's orders of `ranked_choice_logprobs`, for 1-3 commits among 6
    positions (some already committed), shared equally; the probabilities of all sets of a size sum to 1; the
    gradient stays finite when every masked position commits."""
    scores = torch.randn(2, 6, generator=torch.Generator().manual_seed(0)) * 2
    still_masked = torch.tensor([[True] * 6, [True, False, True, True, True, True]])
    for size in (1, 2, 3):
        total = torch.zeros(2, dtype=torch.float64)
        for chosen in itertools.combinations(range(6), size):
            commit = torch.zeros(2, 6, dtype=torch.bool)
            commit[:, list(chosen)] = True
            if not (commit & ~still_masked).any(dim=1).all():
                valid = ~(commit & ~still_masked).any(dim=1)
                by_orders = torch.stack([ranked_choice_logprobs(scores, still_masked, commit, rank, 0.7).sum(1)
                                         for rank in order_ranks(chosen)]).double().logsumexp(0)
                as_set = committed_set_logprobs(scores, still_masked, commit, 0.7, 3)
                torch.testing.assert_close(as_set.sum(1).double()[valid], by_orders[valid], atol=1e-5, rtol=0)
                assert torch.allclose(as_set[commit], as_set.sum(1, keepdim=True).expand_as(as_set)[commit] / size)
                total += torch.where(valid, as_set.sum(1).double().exp(), 0.0)
        torch.testing.assert_close(total, torch.ones(2, dtype=torch.float64), atol=1e-5, rtol=0)
    leaves = torch.randn(1, 3, requires_grad=True)
    committed_set_logprobs(leaves, torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool), 1.0,
                           5).sum().backward()
    assert torch.isfinite(leaves.grad).all()


def order_ranks(chosen: tuple[int, ...]) -> list[torch.Tensor]:
    """[2, 6] `commit_rank`s, one per order of the `chosen` positions."""
    ranks = []
    for order in itertools.permutations(chosen):
        rank = torch.zeros(2, 6, dtype=torch.long)
        for position_rank, position in enumerate(order):
            rank[:, position] = position_rank
        ranks.append(rank)
    return ranks


@pytest.mark.parametrize("threshold, position_temperature, steps", RULES)
def test_sampled_trajectories_follow_the_recorded_probabilities(threshold, position_temperature, steps):
    """The sampler draws each trajectory as often as its recorded probability says (every frequency within 5
    binomial SE of it, 20 000 draws; with a fixed count, two commits in the first step, so their draw order counts)."""
    gen_length = 3 if threshold is None else 2
    model, sampler = TinyCanvasModel(1), sampler_of(gen_length, threshold, position_temperature, steps=steps)
    trajectories = enumerate_trajectories(model, sampler)
    draws = 20_000
    rollout = sampler.sample(model, torch.zeros(draws, 1, dtype=torch.long), generator=torch.Generator().manual_seed(3))
    counts = {}
    for row in range(draws):
        key = trajectory_key(rollout, row, threshold is None)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(trajectories)
    for key, logprob in trajectories.items():
        probability = math.exp(logprob)
        error = math.sqrt(probability * (1 - probability) / draws)
        assert abs(counts.get(key, 0) / draws - probability) <= 5 * error + 1e-4, key


@pytest.mark.parametrize("threshold", [None, 0.4])
def test_vanishing_position_temperature_is_the_deterministic_decoder(threshold):
    """T → 0 recovers today's decoder: with greedy candidates, T = 1e-6 commits what T = 0 commits, step by step."""
    model = TinyCanvasModel(2)
    prompts = torch.tensor([[0], [1], [2]])
    exact = sampler_of(3, threshold, 0.0, temperature=0.0).sample(model, prompts)
    drawn = sampler_of(3, threshold, 1e-6, temperature=0.0).sample(model, prompts,
                                                                   generator=torch.Generator().manual_seed(0))
    assert torch.equal(drawn.sequences, exact.sequences)
    assert torch.equal(drawn.commit_step, exact.commit_step)
    assert recorded_choice(exact) is None and recorded_choice(drawn) is not None


def test_top_log_odds_scores_the_top_probability_as_log_odds():
    """top_log_odds = log(p₁ / (1 − p₁)) of the most probable token, finite where p₁ rounds to 1 in float32; the
    same order as top_probability, so at T = 0 the two decode identically."""
    logits = torch.tensor([[[2.0, 0.5, -1.0], [0.0, 0.0, 0.0], [120.0, 0.0, 1.0]]])
    scores = top_log_odds_scores(logits, torch.zeros(1, 3, dtype=torch.long))
    top = logits.softmax(-1).amax(-1)
    torch.testing.assert_close(scores[0, :2], (top / (1 - top)).log()[0, :2])
    assert float(scores[0, 2]) == pytest.approx(120.0 - math.log1p(math.exp(1.0)), abs=1e-4)

    model, prompts = tiny_llada(), torch.randint(0, 60, (4, 5), generator=torch.Generator().manual_seed(0))
    decoded = [MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=8, block_length=4, steps=4, temperature=0.0, mask_token_id=63, eos_token_ids=(62,),
        remasking=rule)).sample(model, prompts) for rule in ("top_probability", "top_log_odds")]
    assert torch.equal(decoded[0].sequences, decoded[1].sequences)
    assert torch.equal(decoded[0].commit_step, decoded[1].commit_step)
    with pytest.raises(ValueError, match="top_log_odds.*use top_probability with parallel decoding"):
        DiffusionSamplerConfig(gen_length=8, block_length=4, steps=4, remasking="top_log_odds", threshold=0.9)


def tiny_llada() -> LLaDAModelLM:
    torch.manual_seed(0)
    model = LLaDAModelLM(LLaDAConfig(
        d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=64, vocab_size=64, embedding_size=64,
        max_sequence_length=64, mask_token_id=63, eos_token_id=62, pad_token_id=62)).eval()
    with torch.no_grad():
        model.model.transformer.ff_out.weight.mul_(10)
    return model


def unmarked_confidence(block_logits, candidates, generator=None):
    """low_confidence's scores from a user rule that carries no marker: the sampler must take it to read the
    candidates in every way."""
    return block_logits.softmax(-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("decoder, records_discarded", [
    (dict(cache="dual", threshold=0.5, position_temperature=0.05), False),
    (dict(cache="dual", threshold=0.5, position_temperature=0.05, remasking=unmarked_confidence), True),
    (dict(cache="prefix", position_temperature=0.3), True),
    (dict(cache="prefix", position_temperature=0.02, remasking="top_probability"), False),
    (dict(cache="prefix", position_temperature=0.02, remasking="top_log_odds"), False),
    (dict(cache="dual", position_temperature=0.02, remasking="top_log_odds", commit_choice_as_set=True), False),
    (dict(cache="none", remasking="maskgit_plus", position_temperature=0.3), True)])
def test_the_trainer_replays_the_recorded_choice_with_the_fast_decoder(decoder, records_discarded):
    """On the model that sampled, the trainer's replay of the commit choice — with the block cache refreshed as
    sampled, the threshold rule, several blocks — is the recorded one, so the complete ratio is 1; on another model
    it differs. The discarded candidates are recorded only where the ratio holds them: threshold decoding sums over
    them for a rule scoring the candidate's probability, and a rule that reads none (top_probability) needs none."""
    model = tiny_llada()
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=8, block_length=4, steps=4, temperature=1.0, mask_token_id=63, eos_token_ids=(62,), **decoder))
    prompts = torch.randint(0, 60, (6, 5), generator=torch.Generator().manual_seed(0))
    rollout = sampler.sample(model, prompts, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sampler.choice_logprobs(model, rollout), recorded_choice(rollout).logprobs, atol=1e-4, rtol=0)
    other = tiny_llada()
    with torch.no_grad():
        other.model.transformer.ff_out.weight.mul_(1.5)
    assert not torch.allclose(sampler.choice_logprobs(other, rollout), recorded_choice(rollout).logprobs, atol=1e-3)
    assert (recorded_choice(rollout).discarded_candidates is not None) == records_discarded
    if records_discarded:
        halves = Rollout.concatenate([rollout.select(slice(0, 3)), rollout.select(slice(3, 6))])
        assert torch.equal(recorded_choice(halves).discarded_candidates, recorded_choice(rollout).discarded_candidates)


def test_the_correction_weights_the_complete_ratio_and_logs_the_commit_part():
    """Sequence IS reads the complete ratio: w_b = min(exp(Σ_t (ℓ^old − ℓ^ro + c^old − c^ro)), C); the commit part's
    k3 and ESS are logged beside the token ones; bypass mode with the complete ratio weights the commit ratio."""
    generator = torch.Generator().manual_seed(0)
    token_old, token_rollout, choice_old, choice_rollout = (0.1 * torch.randn(4, 5, generator=generator)
                                                             for _ in range(4))
    mask = torch.ones(4, 5, dtype=torch.bool)
    settings = CorrectionSettings("tis", level="sequence", clip=100.0)
    [correction] = RolloutCorrection(settings)([(token_old, token_rollout)], torch.zeros(4), [mask],
                                               (choice_old, choice_rollout))
    complete = (token_old - token_rollout + choice_old - choice_rollout).sum(1).exp()
    torch.testing.assert_close(correction.weights, complete.unsqueeze(1).expand(4, 5))
    commit = choice_old - choice_rollout
    assert correction.diagnostics["rollout_corr/commit_k3_kl"] == pytest.approx(
        float((commit.exp() - commit - 1).mean()), rel=1e-5)
    sequence = commit.sum(1).exp()
    assert correction.diagnostics["rollout_corr/commit_eff_sample_size"] == pytest.approx(
        float(sequence.mean() ** 2 / sequence.square().mean()), rel=1e-5)

    bypass = dataclasses.replace(settings, bypass_mode=True)
    [correction] = RolloutCorrection(bypass)([(token_rollout, token_rollout)], torch.zeros(4), [mask],
                                             (choice_old, choice_rollout))
    torch.testing.assert_close(correction.weights, commit.sum(1).exp().unsqueeze(1).expand(4, 5))


def test_the_complete_sequence_ratio_holds_the_positions_after_the_first_eos():
    """The loss scores a completion through its first EOS, but the trajectory drew and chose every position: the
    complete sequence ratio is the whole row's, its unscored tail carried by the last scored position."""
    generator = torch.Generator().manual_seed(1)
    token_old, token_rollout, choice_old, choice_rollout = (0.1 * torch.randn(3, 6, generator=generator)
                                                             for _ in range(4))
    scored = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    settings = CorrectionSettings("tis", level="sequence", clip=100.0)
    [correction] = RolloutCorrection(settings)([(token_old, token_rollout)], torch.zeros(3), [scored],
                                               (choice_old, choice_rollout))
    whole = (token_old - token_rollout + choice_old - choice_rollout).sum(1).exp()
    torch.testing.assert_close(correction.weights, whole.unsqueeze(1) * scored)


def config_problems(**groups) -> list[str]:
    config = GRPOConfig(model_name_or_path="embedded", task="digits", max_completion_length=16, rollout={
        "block_length": 16, "steps": 8, "threshold": 0.9}, **groups)
    return [problem for problem in config.problems() if "complete_ratio" in problem]


def test_the_complete_ratio_setting_and_its_rules():
    """experimental.complete_ratio needs the trajectory estimator and a commit rule with a probability; it lets
    bypass mode weight the commit ratio; the name of an earlier release (correction.complete_ratio, nested or dotted)
    reads as it, said in one warning."""
    correction = {"method": "tis"}
    assert config_problems(correction=correction, likelihood={"estimator": "trajectory"},
                           experimental={"complete_ratio": True, "rollout_position_temperature": 0.05}) == []
    assert any("experimental.rollout_position_temperature > 0" in p
               for p in config_problems(correction=correction, likelihood={"estimator": "trajectory"},
                                        experimental={"complete_ratio": True}))
    assert any("likelihood.estimator=trajectory" in p for p in config_problems(
        correction=correction, experimental={"complete_ratio": True, "rollout_position_temperature": 0.05}))
    bypass = {**correction, "bypass_mode": True}
    assert config_problems(correction=bypass, likelihood={"estimator": "trajectory"},
                           experimental={"complete_ratio": True, "rollout_position_temperature": 0.05}) == []
    assert any("correction.bypass_mode" in p for p in config_problems(correction=bypass))
    for earlier in ({"correction": {"method": "tis", "complete_ratio": True}},
                    {"correction.method": "tis", "correction.complete_ratio": True}):
        values = canonical_values(earlier)
        assert values["experimental"] == {"complete_ratio": True} and values["correction"] == {"method": "tis"}


def test_the_commit_choice_gradient_differentiates_the_whole_step(tokenizer, tmp_path):
    """experimental.commit_choice_gradient: the loss's log-probs are the whole step's (token + commit choice) from the
    same replayed logits — on the bf16 engine equal to what the sampler recorded, and ℓ_old holds the same — so the
    policy gradient gains the commit order's score function (a nonzero gradient of its own), and two steps train."""
    from test_trainer import make_trainer

    trainer = make_trainer(tokenizer, tmp_path, beta=0.0, rollout={"precision": "bf16", "cache": "dual",
                                                                   "remasking": "top_log_odds"},
                           likelihood={"estimator": "trajectory"}, correction={"method": "none", "bypass_mode": True},
                           experimental={"rollout_position_temperature": 1.0, "commit_choice_gradient": True})
    batch = trainer.make_generation_batch()
    rollout, seed, scored = batch.rollout, batch.seeds[0], batch.rollout.completion_mask.bool()
    recorded = rollout.step_logprobs + recorded_choice(rollout).logprobs
    torch.testing.assert_close(batch.logp_old[0][scored], recorded[scored])
    model = trainer.model
    whole = sum_pieces(trainer.policy.logprob_pieces(model, rollout, seed), False)
    torch.testing.assert_close(whole[scored], recorded[scored], atol=1e-4, rtol=0)
    tokens = trainer.policy.logprobs(model, rollout, seed)
    (whole - tokens)[scored].sum().backward()
    gradients = [p.grad for n, p in model.named_parameters() if "lora_" in n and p.grad is not None]
    assert gradients and any(float(g.abs().sum()) > 0 for g in gradients)
    model.zero_grad(set_to_none=True)

    history = trainer.train().history
    assert len(history) == 2
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in history)
    assert history[0]["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)


def test_a_run_scoring_the_commit_choice_as_a_set_trains_with_the_complete_ratio(tokenizer, tmp_path):
    """experimental.commit_choice_as_set through the trainer: the bf16 engine's complete ratio is 1 (its recorded set
    log-probs are the trainer's), two steps train, and the held-out evaluation decodes exactly without it."""
    from test_trainer import make_trainer

    trainer = make_trainer(tokenizer, tmp_path, rollout={"precision": "bf16", "cache": "dual",
                                                         "remasking": "top_log_odds"},
                           likelihood={"estimator": "trajectory"}, correction={"method": "ais"},
                           experimental={"rollout_position_temperature": 1.0, "commit_choice_as_set": True,
                                         "complete_ratio": True})
    assert trainer.policy.sampler.config.commit_choice_as_set
    history = trainer.train().history
    assert len(history) == 2 and all(math.isfinite(r["loss"]) for r in history)
    assert history[0]["rollout_corr/commit_k3_kl"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("settings, named", [
    ({"experimental": {"commit_choice_as_set": True, "rollout_position_temperature": 1.0},
      "rollout": {"cache": "dual", "threshold": 0.9}}, "commit_choice_as_set scores a fixed count"),
    ({"experimental": {"commit_choice_as_set": True}}, "commit_choice_as_set scores a fixed count"),
    ({"experimental": {"commit_choice_gradient": True}}, "rollout_position_temperature > 0"),
    ({"experimental": {"commit_choice_gradient": True, "rollout_position_temperature": 1.0}, "beta": 0.04},
     "set beta=0"),
])
def test_the_commit_choice_gradient_names_what_it_needs(settings, named):
    base = {"policy": "diffusion", "rollout": {"cache": "dual"}, "likelihood": {"estimator": "trajectory"}}
    with pytest.raises(ConfigError, match=named):
        config_of(base, **settings).validate()

"""The masked-diffusion sampler: equality with the official LLaDA algorithm, trajectory invariants, plug-ins, errors."""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dllm_ais.likelihood import trajectory_logprobs
from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.sampling.diffusion import (
    REMASKING_RULES,
    DiffusionSamplerConfig,
    MaskedDiffusionSampler,
    gumbel_argmax,
    parallel_commit_counts,
    register_remasking_rule,
    sampling_logprobs,
    transfer_schedule,
)

MASK, EOS, PAD = 127, 126, 126


@pytest.fixture(scope="module")
def model() -> LLaDAModelLM:
    """Tiny random LLaDA; its LM head is scaled up so predictions are peaked rather than near uniform, which keeps
    confidences apart (near-ties would make order-sensitive comparisons depend on float rounding)."""
    torch.manual_seed(0)
    tiny = LLaDAModelLM(LLaDAConfig(
        d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=128, embedding_size=128,
        max_sequence_length=256, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD,
    )).eval()
    with torch.no_grad():
        tiny.model.transformer.ff_out.weight.mul_(20)
    return tiny


class RecordingModel(torch.nn.Module):
    """Forwards to `inner` (optionally adding `logit_bias` to the logits) and keeps a copy of every canvas it sees."""

    def __init__(self, inner: torch.nn.Module, config=None, logit_bias: torch.Tensor | None = None):
        super().__init__()
        self.inner = inner
        self.config = config if config is not None else inner.config
        self.logit_bias = logit_bias
        self.canvases: list[torch.Tensor] = []

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        self.canvases.append(input_ids.clone())
        output = self.inner(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep)
        if self.logit_bias is not None:
            output.logits = output.logits + self.logit_bias
        return output


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 120, (n,), generator=generator).tolist() for n in lengths]


def official_llada_generate(model, prompt, attention_mask, steps, gen_length, block_length, cfg_scale, mask_id):
    """The official LLaDA `generate` loop at temperature 0 with low-confidence remasking, written plainly:
    full-row operations, a per-row topk, no block slicing."""
    batch, prompt_length = prompt.shape
    x = torch.full((batch, prompt_length + gen_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones(batch, gen_length, dtype=attention_mask.dtype)], dim=1)
    prompt_index = x != mask_id
    n_blocks = gen_length // block_length
    steps_per_block = steps // n_blocks
    with torch.no_grad():
        for block in range(n_blocks):
            block_end = prompt_length + (block + 1) * block_length
            masked_in_block = (x[:, block_end - block_length:block_end] == mask_id).sum(dim=1).tolist()
            num_transfer = [
                [n // steps_per_block + (1 if i < n % steps_per_block else 0) for i in range(steps_per_block)]
                for n in masked_in_block
            ]
            for i in range(steps_per_block):
                mask_index = x == mask_id
                if cfg_scale > 0:
                    un_x = x.clone()
                    un_x[prompt_index] = mask_id
                    both_mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
                    cond, uncond = model(torch.cat([x, un_x]), attention_mask=both_mask).logits.chunk(2)
                    logits = uncond + (cfg_scale + 1) * (cond - uncond)
                else:
                    logits = model(x, attention_mask=attention_mask).logits
                x0 = logits.argmax(dim=-1)
                x0_p = F.softmax(logits, dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
                x0_p[:, block_end:] = -math.inf
                x0 = torch.where(mask_index, x0, x)
                confidence = torch.where(mask_index, x0_p, -math.inf)
                transfer = torch.zeros_like(x0, dtype=torch.bool)
                for j in range(batch):
                    _, chosen = torch.topk(confidence[j], k=num_transfer[j][i])
                    transfer[j, chosen] = True
                x[transfer] = x0[transfer]
    return x


@pytest.fixture(scope="module")
def bf16_model(model) -> LLaDAModelLM:
    """The tiny model in bfloat16, where confidences often tie exactly (topk's tie-breaking then decides)."""
    return copy.deepcopy(model).to(torch.bfloat16)


@pytest.mark.parametrize(
    "lengths, padded, gen_length, block_length, steps, cfg_scale, dtype",
    [
        pytest.param([7], False, 32, 32, 16, 0.0, torch.float32, id="single-prompt"),
        pytest.param([4, 10, 7], True, 32, 16, 16, 0.0, torch.float32, id="left-padded-batch"),
        pytest.param([6, 9], True, 64, 16, 20, 0.0, torch.float32, id="several-blocks-uneven-schedule"),
        pytest.param([5, 8], True, 32, 16, 16, 1.5, torch.float32, id="cfg"),
        pytest.param([4, 10, 7], True, 64, 16, 16, 0.0, torch.bfloat16, id="bfloat16-ties"),
    ],
)
def test_greedy_matches_official_llada_generate(
    model, bf16_model, lengths, padded, gen_length, block_length, steps, cfg_scale, dtype
):
    model = bf16_model if dtype == torch.bfloat16 else model
    ids, attention = left_padded(random_prompts(lengths))
    attention = attention if padded else None
    expected = official_llada_generate(model, ids, attention, steps, gen_length, block_length, cfg_scale, MASK)
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=gen_length, block_length=block_length, steps=steps, cfg_scale=cfg_scale, mask_token_id=MASK,
    ))
    rollout = sampler.sample(model, ids, attention)
    assert torch.equal(rollout.sequences, expected)
    assert rollout.completion_ids.unique().numel() > 2  # a non-degenerate completion
    assert (rollout.commit_step >= 0).all() and (rollout.step_logprobs <= 0).all()


def test_padding_leaves_greedy_completion_unchanged(model):
    alone, with_others = random_prompts([6, 11], seed=3)
    config = DiffusionSamplerConfig(gen_length=32, block_length=16, steps=16, mask_token_id=MASK)
    single = MaskedDiffusionSampler(config).sample(model, torch.tensor([alone]))
    ids, attention = left_padded([alone, with_others])
    batched = MaskedDiffusionSampler(config).sample(model, ids, attention)
    assert torch.equal(batched.completion_ids[0], single.completion_ids[0])
    assert torch.equal(batched.commit_step[0], single.commit_step[0])


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_sampled_trajectory_invariants(model, remasking):
    temperature, gen_length, block_length, steps = 0.9, 32, 16, 10  # 5 steps per block: counts 4, 3, 3, 3, 3
    ids, attention = left_padded(random_prompts([5, 9, 7], seed=1))
    recorder = RecordingModel(model)
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=gen_length, block_length=block_length, steps=steps, temperature=temperature,
        remasking=remasking, mask_token_id=MASK,
    ))
    rollout = sampler.sample(recorder, ids, attention, generator=torch.Generator().manual_seed(0))
    prompt_length = ids.shape[1]
    assert len(recorder.canvases) == steps
    states = recorder.canvases + [rollout.sequences]
    assert all(torch.equal(state[:, :prompt_length], ids) for state in states)
    completions = [state[:, prompt_length:] for state in states]
    steps_per_block = steps // (gen_length // block_length)
    for step in range(steps):
        before, after = completions[step], completions[step + 1]
        was_masked, is_masked = before == MASK, after == MASK
        committed = was_masked & ~is_masked
        scheduled = block_length // steps_per_block + int(step % steps_per_block < block_length % steps_per_block)
        assert (committed.sum(dim=1) == scheduled).all()
        block = step // steps_per_block
        assert not committed[:, : block * block_length].any() and not committed[:, (block + 1) * block_length:].any()
        assert torch.equal(after[~was_masked], before[~was_masked])  # committed tokens never change
        assert (is_masked <= was_masked).all()
        assert torch.equal(rollout.commit_step == step, committed)
        logits = model(states[step], attention_mask=rollout.attention_mask).logits[:, prompt_length:]
        recomputed = F.log_softmax(logits.float() / temperature, dim=-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(rollout.step_logprobs[committed], recomputed[committed], atol=1e-5, rtol=1e-5)
    assert not (rollout.completion_ids == MASK).any()


def test_generator_seed_determines_rollout(model):
    ids, attention = left_padded(random_prompts([5, 8], seed=2))
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=32, block_length=16, steps=16, temperature=0.9, mask_token_id=MASK,
    ))

    def draw(seed):
        return sampler.sample(model, ids, attention, generator=torch.Generator().manual_seed(seed))

    first, again, other = draw(7), draw(7), draw(8)
    for name in ("sequences", "step_logprobs", "commit_step", "completion_mask"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert not torch.equal(first.sequences, other.sequences)


def test_callable_remasking_rule_leftmost_first_commits_left_to_right(model):
    def leftmost_first(block_logits, candidates, generator):
        return -torch.arange(candidates.shape[1], dtype=torch.float32).expand(candidates.shape)

    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=32, block_length=16, steps=16, temperature=0.9, remasking=leftmost_first, mask_token_id=MASK,
    ))
    ids, attention = left_padded(random_prompts([4, 6]))
    rollout = sampler.sample(model, ids, attention, generator=torch.Generator().manual_seed(0))
    tokens_per_step = 2
    expected = (torch.arange(32) // tokens_per_step).expand(2, -1)
    assert torch.equal(rollout.commit_step, expected)


def test_registered_remasking_rule_is_selectable_by_name(model):
    def rightmost_first(block_logits, candidates, generator):
        return torch.arange(candidates.shape[1]).expand(candidates.shape)  # integer scores are accepted

    register_remasking_rule("rightmost_first_test", rightmost_first)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_remasking_rule("rightmost_first_test", rightmost_first)
        sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
            gen_length=16, block_length=16, steps=8, remasking="rightmost_first_test", mask_token_id=MASK,
        ))
        rollout = sampler.sample(model, torch.tensor([random_prompts([5])[0]]))
        assert torch.equal(rollout.commit_step[0], torch.arange(15, -1, -1) // 2)
    finally:
        REMASKING_RULES.pop("rightmost_first_test")


# ------------------------------------------------------------------------------------------------------------------
# Fast rollouts: block KV cache, parallel decoding, autoregressive order (ALGORITHMS.md §1b)
# ------------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def recorded_inputs(model):
    """Yield a list that gets the input ids of every forward of `model` (a clone: the sampler edits its canvas)."""
    inputs = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(
        (args[0] if args else kwargs["input_ids"]).clone()), with_kwargs=True)
    try:
        yield inputs
    finally:
        handle.remove()


def positions_computed(model, sampler, ids, attention, **kwargs) -> tuple[int, object]:
    """(token positions of one row that the model ran on in all, the rollout)."""
    with recorded_inputs(model) as inputs:
        rollout = sampler.sample(model, ids, attention, **kwargs)
    return sum(x.shape[1] for x in inputs), rollout


def threshold_count(confidences: list[float], threshold: float) -> int:
    return max(1, sum(c > threshold for c in confidences))


def factor_count(confidences: list[float], factor: float) -> int:
    return max([1] + [n for n, c in enumerate(confidences, start=1) if (n + 1) * (1 - c) < factor])


def test_parallel_commit_counts_threshold_and_factor_rules():
    scores = torch.tensor([[0.95, 0.5, 0.91, 0.2], [0.3, 0.2, 0.1, 0.05], [0.99, 0.98, 0.97, 0.96], [0.9] * 4])
    still_masked = torch.tensor([[True] * 4, [True] * 4, [True, True, False, True], [False] * 4])
    assert parallel_commit_counts(scores, still_masked, threshold=0.9).tolist() == [2, 1, 3, 0]
    # factor f = 1, row 0: n = 1, 2 pass (2·0.05, 3·0.09 < 1), n = 3 does not (4·0.5); row 2: 2·0.01, 3·0.02, 4·0.04
    assert parallel_commit_counts(scores, still_masked, factor=1.0).tolist() == [2, 1, 3, 0]
    assert parallel_commit_counts(scores, still_masked, factor=0.08).tolist() == [1, 1, 2, 0]
    with pytest.raises(ValueError, match="exactly one"):
        parallel_commit_counts(scores, still_masked, threshold=0.9, factor=1.0)


@pytest.mark.parametrize("rule, value", [("threshold", 0.15), ("threshold", 0.2), ("factor", 3.0)])
def test_parallel_decoding_commits_what_its_rule_says_each_step_until_the_block_is_filled(model, rule, value):
    """At τ = 0 the candidate is the argmax and its score the model's probability of it: replaying every recorded
    canvas, each step commits, in every row with masked positions left in the block, exactly the rule's top set.
    (The random model's confidences are about 0.14-0.3, hence the low thresholds.)"""
    ids, attention = left_padded(random_prompts([5, 9, 7], seed=4))
    gen_length, block_length, prompt_length = 32, 16, ids.shape[1]
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=gen_length, block_length=block_length, steps=2, mask_token_id=MASK, **{rule: value}))
    with recorded_inputs(model) as canvases:
        rollout = sampler.sample(model, ids, attention)
    count = threshold_count if rule == "threshold" else factor_count
    block = 0
    for step, canvas in enumerate(canvases):
        committed = rollout.commit_step == step
        masked = canvas[:, prompt_length:] == MASK
        if not committed.any():  # a forward of a block's step budget after the block was filled: commits nothing
            assert not masked[:, block * block_length:(block + 1) * block_length].any()
            continue
        block = int(committed.any(dim=0).nonzero()[0]) // block_length
        in_block = masked & (torch.arange(gen_length) // block_length == block)
        confidence = model(canvas, attention_mask=rollout.attention_mask).logits[:, prompt_length:].softmax(-1).amax(-1)
        expected = torch.zeros_like(masked)
        for row in range(len(ids)):
            positions = in_block[row].nonzero().flatten()
            order = confidence[row, positions].argsort(descending=True)
            n = count(confidence[row, positions[order]].tolist(), value) if len(positions) else 0
            expected[row, positions[order[:n]]] = True
        assert torch.equal(rollout.commit_step == step, expected), f"step {step}"
    assert not (rollout.completion_ids == MASK).any()
    steps_with_commits = torch.stack([(rollout.commit_step == t).any(dim=1) for t in range(len(canvases))]).sum(0)
    assert torch.equal(rollout.num_steps, steps_with_commits)
    assert len(canvases) > 2 and (rollout.num_steps < gen_length).all()  # parallel: fewer steps than tokens


def test_threshold_extremes_one_token_per_step_or_one_step_per_block(model):
    ids, attention = left_padded(random_prompts([5, 9]))
    base = dict(gen_length=32, block_length=16, mask_token_id=MASK)
    DiffusionSamplerConfig(**base, steps=15, threshold=0.9)  # the step schedule, hence its divisibility, is unused
    one_per_step = MaskedDiffusionSampler(DiffusionSamplerConfig(**base, steps=32)).sample(model, ids, attention)
    never_exceeded = MaskedDiffusionSampler(DiffusionSamplerConfig(**base, threshold=1.0)).sample(model, ids, attention)
    assert torch.equal(never_exceeded.sequences, one_per_step.sequences)
    assert torch.equal(never_exceeded.commit_step, one_per_step.commit_step)
    assert never_exceeded.num_steps.tolist() == [32, 32]

    steps, rollout = positions_computed(
        model, MaskedDiffusionSampler(DiffusionSamplerConfig(**base, threshold=0.0)), ids, attention)
    assert steps == 2 * (ids.shape[1] + 32)  # each block filled by its first forward
    assert torch.equal(rollout.commit_step, (torch.arange(32) // 16).expand(2, -1))
    assert rollout.num_steps.tolist() == [2, 2]


CACHED_VARIANTS = [
    pytest.param(dict(cache="prefix"), id="prefix"),
    pytest.param(dict(cache="dual"), id="dual"),
    pytest.param(dict(cache="prefix", threshold=0.17), id="prefix-threshold"),
    pytest.param(dict(cache="dual", threshold=0.17), id="dual-threshold"),
    pytest.param(dict(cache="dual", factor=3.0), id="dual-factor"),
    pytest.param(dict(cache="prefix", remasking="left_to_right", steps=32), id="prefix-ar-order"),
]


@pytest.mark.parametrize("options", CACHED_VARIANTS)
def test_cached_sampler_gives_each_row_of_a_mixed_length_batch_its_tokens_alone(model, options):
    """Left-padded prompts of different lengths share one cache (and one cache_position) without mixing rows."""
    prompts = random_prompts([3, 11, 6], seed=5)
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        **{"gen_length": 32, "block_length": 16, "steps": 16, "mask_token_id": MASK, **options}))
    ids, attention = left_padded(prompts)
    batched = sampler.sample(model, ids, attention, generator=torch.Generator().manual_seed(0))
    for row, prompt in enumerate(prompts):
        alone = sampler.sample(model, torch.tensor([prompt]), generator=torch.Generator().manual_seed(0))
        assert torch.equal(batched.completion_ids[row], alone.completion_ids[0]), f"row {row}"
        assert batched.num_steps[row] == alone.num_steps[0]


@pytest.mark.parametrize("options", [
    pytest.param(dict(cache="prefix"), id="prefix"),
    pytest.param(dict(cache="dual", threshold=0.15), id="dual-threshold"),
    pytest.param(dict(cache="prefix", factor=3.0, remasking="random"), id="prefix-factor-random"),
    pytest.param(dict(cache="dual", cfg_scale=1.0), id="dual-cfg"),
])
def test_cache_refreshed_every_step_is_exactly_the_uncached_sampler(model, options):
    ids, attention = left_padded(random_prompts([4, 9, 6], seed=6))
    base = dict(gen_length=32, block_length=16, steps=16, temperature=0.9, mask_token_id=MASK)
    cache_free = {key: value for key, value in options.items() if key != "cache"}
    uncached = MaskedDiffusionSampler(DiffusionSamplerConfig(**base, **cache_free))
    refreshed = MaskedDiffusionSampler(DiffusionSamplerConfig(**base, **options, cache_refresh_interval=1))
    expected = uncached.sample(model, ids, attention, generator=torch.Generator().manual_seed(1))
    got = refreshed.sample(model, ids, attention, generator=torch.Generator().manual_seed(1))
    for name in ("sequences", "step_logprobs", "commit_step", "num_steps"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_cached_steps_run_only_their_positions_and_record_the_approximate_logits(model):
    """prefix recomputes the block and what follows it, dual the block only; the recorded log-probs are those of the
    cached (approximate) logits, so an uncached replay of the trajectory differs from them — and equals them without
    the cache."""
    ids, attention = left_padded(random_prompts([5, 9], seed=7))
    prompt_length, gen_length, block_length, steps = ids.shape[1], 32, 16, 8  # 4 steps per block
    canvas_length = prompt_length + gen_length
    expected_positions = {
        "none": steps * canvas_length,
        "prefix": 2 * canvas_length + 3 * (gen_length + (gen_length - block_length)),
        "dual": 2 * canvas_length + 3 * 2 * block_length,
    }
    for cache, positions in expected_positions.items():
        sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
            gen_length=gen_length, block_length=block_length, steps=steps, temperature=0.9, mask_token_id=MASK,
            cache=cache))
        generator = torch.Generator().manual_seed(3)
        computed, rollout = positions_computed(model, sampler, ids, attention, generator=generator)
        assert computed == positions, cache
        replayed = trajectory_logprobs(model, rollout, MASK, temperature=0.9)
        if cache == "none":
            torch.testing.assert_close(replayed, rollout.step_logprobs, atol=1e-5, rtol=0)
        else:
            assert (replayed - rollout.step_logprobs).abs().max() > 1e-3, cache


def test_left_to_right_remasking_decodes_in_autoregressive_order_and_the_trajectory_is_its_exact_likelihood(model):
    ids, attention = left_padded(random_prompts([5, 9], seed=8))
    prompt_length, gen_length = ids.shape[1], 32
    ar_order = dict(gen_length=gen_length, steps=gen_length, remasking="left_to_right", mask_token_id=MASK)
    one_position_blocks = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=gen_length, block_length=1, steps=gen_length, mask_token_id=MASK)).sample(model, ids, attention)
    rollout = MaskedDiffusionSampler(DiffusionSamplerConfig(**ar_order, block_length=16)).sample(model, ids, attention)
    assert torch.equal(rollout.commit_step, torch.arange(gen_length).expand(2, -1))
    assert torch.equal(rollout.sequences, one_position_blocks.sequences)

    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(**ar_order, block_length=16, temperature=0.9))
    rollout = sampler.sample(model, ids, attention, generator=torch.Generator().manual_seed(0))
    exact = torch.zeros(2, gen_length)  # log p(o_k | prompt, o_<k, masks after k), one full forward per token
    for k in range(gen_length):
        canvas = torch.cat([rollout.sequences[:, :prompt_length + k], torch.full((2, gen_length - k), MASK)], dim=1)
        logits = model(canvas, attention_mask=rollout.attention_mask).logits[:, prompt_length + k]
        exact[:, k] = logits.div(0.9).log_softmax(-1).gather(-1, rollout.completion_ids[:, k:k + 1]).squeeze(-1)
    torch.testing.assert_close(rollout.step_logprobs, exact, atol=1e-5, rtol=0)
    torch.testing.assert_close(trajectory_logprobs(model, rollout, MASK, temperature=0.9), exact, atol=1e-5, rtol=0)

    # With the prefix cache, blocks of 16 save compute; blocks of 1 would refresh at every step and save nothing.
    canvas_length = prompt_length + gen_length
    blocks_of = {1: gen_length * canvas_length, 16: 2 * canvas_length + 15 * (gen_length + gen_length - 16)}
    for block_length, positions in blocks_of.items():
        cached = MaskedDiffusionSampler(DiffusionSamplerConfig(**ar_order, block_length=block_length, cache="prefix"))
        assert positions_computed(model, cached, ids, attention)[0] == positions


def test_the_completion_mask_runs_through_the_first_eos(model):
    eos_bias = torch.zeros(128)
    eos_bias[EOS] = 8.0
    eos_prone = RecordingModel(model, logit_bias=eos_bias)
    ids = torch.tensor(random_prompts([6, 6], seed=4))
    base = dict(gen_length=32, block_length=16, steps=16, mask_token_id=MASK)

    plain = MaskedDiffusionSampler(DiffusionSamplerConfig(**base)).sample(eos_prone, ids)
    first_eos = (plain.completion_ids == EOS).int().argmax(dim=1)
    assert (plain.completion_ids == EOS).any(dim=1).all()
    assert torch.equal(plain.completion_mask.sum(dim=1), first_eos + 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gen_length=100, block_length=32), "not a multiple of block_length"),
        (dict(gen_length=64, block_length=32, steps=15), "not a multiple of the number of blocks"),
        (dict(mask_token_id=5, pad_token_id=5), "pad_token_id equals mask_token_id"),
        (dict(remasking="lowest_entropy"), r"valid names: \['entropy', 'left_to_right', 'low_confidence', 'maskgit_plus', 'origin', 'random', 'top_log_odds', 'top_probability', 'topk_margin'\]"),
        (dict(schedule="cosine"), "schedule='cosine': choose one of even, time_linear"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k=-1 must be an integer >= 0"),
        (dict(position_temperature=-1.0), "position_temperature=-1.0 must be >= 0"),
        (dict(remasking="origin", threshold=0.9), "remasking='origin' commits a random number"),
        (dict(remasking="origin", cache="dual", cache_refresh_interval=2), "leave the interval unset"),
        (dict(temperature=-0.1), "temperature=-0.1 must be >= 0"),
        (dict(cache="full"), "cache='full': choose one of none, prefix, dual"),
        (dict(cache="dual", cache_refresh_interval=0), "cache_refresh_interval=0 must be a positive int"),
        (dict(threshold=0.9, factor=1.0), "threshold and factor are two parallel-decoding rules"),
        (dict(threshold=1.5), r"threshold=1.5 must be a confidence in \[0, 1\]"),
        (dict(factor=0.0), "factor=0.0 must be a finite number > 0"),
    ],
)
def test_invalid_config_is_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DiffusionSamplerConfig(**kwargs)


def _config_without(model, **overrides):
    config = copy.deepcopy(model.config)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_mask_id", "No mask token id"),
        ("no_eos_id", "No EOS token id"),
        ("pad_is_mask_in_model_config", "pad_token_id equals mask_token_id"),
        ("prompt_too_long", "exceeds the model's max_sequence_length=256"),
        ("prompt_contains_mask", r"Prompts \[1\] contain the mask token id 127"),
        ("attention_mask_shape", "attention_mask has shape"),
    ],
)
def test_invalid_inputs_are_rejected_before_any_forward(model, case, message):
    ids, attention = left_padded(random_prompts([5, 8]))
    sampler_kwargs = dict(gen_length=32, block_length=16, steps=16)
    model_config = None
    if case == "no_mask_id":
        model_config = _config_without(model, mask_token_id=None)
    elif case == "no_eos_id":
        model_config = _config_without(model, eos_token_id=None)
    elif case == "pad_is_mask_in_model_config":
        model_config = _config_without(model, pad_token_id=MASK)
    elif case == "prompt_too_long":
        ids, attention = left_padded(random_prompts([230, 8]))
    elif case == "prompt_contains_mask":
        ids[1, -2] = MASK
    elif case == "attention_mask_shape":
        attention = attention[:, 1:]
    counting = RecordingModel(model, config=model_config)
    with pytest.raises(ValueError, match=message):
        MaskedDiffusionSampler(DiffusionSamplerConfig(**sampler_kwargs)).sample(counting, ids, attention)
    assert len(counting.canvases) == 0


def test_mask_id_from_config_overrides_model_config(model):
    """The mask id is configuration: a model config naming another mask id does not change what the sampler uses."""
    counting = RecordingModel(model, config=_config_without(model, mask_token_id=3))
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=16, block_length=16, steps=8, mask_token_id=MASK))
    rollout = sampler.sample(counting, torch.tensor([[5, 6, 7]]))
    assert (counting.canvases[0][0, 3:] == MASK).all()
    assert not (rollout.completion_ids == MASK).any()


def test_transfer_schedule_splits_evenly_with_remainder_first():
    schedule = transfer_schedule(torch.tensor([7, 9, 0, 2]), steps=3)
    assert schedule.tolist() == [[3, 2, 2], [3, 3, 3], [0, 0, 0], [1, 1, 0]]
    assert schedule.dtype == torch.long


def test_gumbel_argmax_greedy_draws_no_noise_and_tempered_draws_follow_softmax():
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    state = generator.get_state()
    assert gumbel_argmax(logits.expand(5, -1), 0.0, generator).tolist() == [2] * 5
    assert torch.equal(generator.get_state(), state)

    temperature = 0.7
    draws = gumbel_argmax(logits.expand(40000, -1), temperature, generator)
    frequencies = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(frequencies, torch.softmax(logits / temperature, dim=-1), atol=0.01, rtol=0)


def test_gumbel_argmax_equals_official_exp_form_for_the_same_noise():
    logits = 4 * torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    temperature = 0.9
    drawn = gumbel_argmax(logits, temperature, torch.Generator().manual_seed(5))
    uniform = torch.rand(logits.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    official = (logits.to(torch.float64).exp() / (-torch.log(uniform)) ** temperature).argmax(dim=-1)
    assert torch.equal(drawn, official)


def test_choose_positions_with_different_counts_per_row_matches_per_row_topk():
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=16, block_length=16, steps=8))
    row_scores = torch.rand(3, 12, generator=torch.Generator().manual_seed(0))
    row_scores[:, :4] = -math.inf
    counts = [1, 3, 0]
    chosen = sampler.choose_positions(row_scores, counts)
    for row, count in enumerate(counts):
        expected = torch.zeros(12, dtype=torch.bool)
        expected[torch.topk(row_scores[row], count).indices] = True
        assert torch.equal(chosen[row], expected)


def test_sampling_logprobs_is_tempered_log_softmax():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(1))
    for temperature, divisor in ((0.0, 1.0), (0.6, 0.6)):
        expected = F.log_softmax(logits.float() / divisor, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        result = sampling_logprobs(logits, tokens, temperature)
        assert result.dtype == torch.float32
        torch.testing.assert_close(result, expected)


def test_replay_scores_the_completion_along_the_samplers_own_order(model):
    """`replay` teacher-forces a completion through the sampler's stages: its tokens are unchanged, every position is
    committed once on the sampler's schedule, the recorded log-probs are the trajectory estimator's along the replayed
    order, and a fast (dual cache, threshold) rollout replayed by the exact sampler gets the exact schedule's order."""
    ids, attention = left_padded(random_prompts([5, 9, 7], seed=3))
    exact = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=16, block_length=8, steps=8, temperature=0.9,
                                                          mask_token_id=MASK))
    fast = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=16, block_length=8, steps=8, temperature=0.9,
                                                         mask_token_id=MASK, cache="dual", threshold=0.5))
    rollout = fast.sample(model, ids, attention, generator=torch.Generator().manual_seed(1))
    replayed = exact.replay(model, rollout)
    assert torch.equal(replayed.sequences, rollout.sequences)
    assert torch.equal(replayed.completion_mask, rollout.completion_mask)
    steps = replayed.commit_step
    assert torch.equal(torch.stack([torch.bincount(row, minlength=8) for row in steps]), torch.full((3, 8), 2))
    assert bool((steps[:, :8] < 4).all() and (steps[:, 8:] >= 4).all())  # block by block
    torch.testing.assert_close(replayed.step_logprobs, trajectory_logprobs(model, replayed, MASK, temperature=0.9),
                               atol=1e-5, rtol=0)
    assert not torch.equal(replayed.commit_step, rollout.commit_step)  # the fast sampler took another order

    # The order is the remasking rule's on the forced tokens: left-to-right replays in autoregressive order.
    ar = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=16, block_length=8, steps=16, temperature=0.9,
                                                       mask_token_id=MASK, remasking="left_to_right"))
    assert torch.equal(ar.replay(model, rollout).commit_step, torch.arange(16).expand(3, -1))


def test_choose_positions_breaks_ties_as_a_topk_of_each_rows_own_count():
    """Tied scores, different counts per row: each row gets torch.topk(row, its count), the official per-row loop's
    tie-breaking. One topk of the largest count cut at each row's count (a rank-below-count mask, without grouping
    rows by count on the host) picks other tied positions here: topk(1) of 7 equal scores is not topk(5)'s first."""
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=16, block_length=16, steps=8))
    row_scores = torch.zeros(2, 7)
    counts = [1, 5]
    chosen = sampler.choose_positions(row_scores, counts)
    for row, count in enumerate(counts):
        expected = torch.zeros(7, dtype=torch.bool)
        expected[torch.topk(row_scores[row], count).indices] = True
        assert torch.equal(chosen[row], expected)


@pytest.mark.parametrize("steps", [16, 64])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_threshold_decoding_reads_the_device_about_once_per_block(steps, cache):
    """The shipped run's decoder (`threshold: 0.9`) on the embedded LLaDA and its digits prompts, 64 positions in 4
    blocks: the host reads of a `sample` call are about two per block (each block runs the steps the one before it
    needed with its counts on the device, then reads what is left), where it read at every step before —
    and, greedy, the tokens are those of a decoder that reads at every step (`_denoise_block_in_parallel` with a
    budget of one step, which stops each block as soon as it is filled). (Sampled, the forwards of a budget past a
    block's last commit draw noise too, so a seed gives other draws of the same distribution.)"""
    from dllm_ais.bench.common import host_reads
    from dllm_ais.bench.mismatch import validation_prompts
    from dllm_ais.config import EMBEDDED_RECIPE, load_config
    from dllm_ais.loading import load_model, load_tokenizer

    config = load_config(EMBEDDED_RECIPE, ["--output_dir=/tmp/unused"])
    model = load_model(config.model_name_or_path, torch.float32).eval()
    ids, attention = validation_prompts(config, load_tokenizer(config.model_name_or_path), 8, seed=0)
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=64, block_length=16, steps=steps, cache=cache,
                                                            threshold=0.9, temperature=0.0))
    with host_reads() as counter:
        rollout = sampler.sample(model, ids, attention)
    blocks = 64 // 16  # two reads a block at most but in the first (a read per halving), two of the prompts
    assert counter["reads"] <= 2 * blocks + 4, counter

    class ReadsEveryStep(MaskedDiffusionSampler):
        """Every block a step at a time, each followed by its read: stops a block as soon as it is filled."""

        def _denoise_block_in_parallel(self, state, block, budget):
            return super()._denoise_block_in_parallel(state, block, None)

        @staticmethod
        def _next_run(left, budget):
            return min(left, 1)

    with host_reads() as every_step:
        stepwise = ReadsEveryStep(sampler.config).sample(model, ids, attention)
    assert every_step["reads"] > counter["reads"]
    assert torch.equal(rollout.sequences, stepwise.sequences)
    torch.testing.assert_close(rollout.step_logprobs, stepwise.step_logprobs, atol=1e-5, rtol=0)
    assert torch.equal(rollout.num_steps, stepwise.num_steps)

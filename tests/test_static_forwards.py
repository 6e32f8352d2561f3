"""The compiled engine's static forwards (`rollout.compile`): the same rollouts as the eager engine, key/value buffers
allocated once and written in place, prompts bucketed; on a GPU, the forwards replayed as CUDA graphs."""

import pytest
import torch

from dllm_ais.engine import RolloutEngine
from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler
from dllm_ais.sampling.static_forwards import PROMPT_BUCKET, StaticForwards, bucketed_prompt_length

MASK, EOS, PAD = 127, 126, 126


def tiny_llada(device: str = "cpu", dtype: torch.dtype = torch.float32) -> LLaDAModelLM:
    """A tiny random LLaDA whose head is scaled up, so that its predictions are peaked and confidences apart."""
    torch.manual_seed(0)
    model = LLaDAModelLM(LLaDAConfig(
        d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=128, embedding_size=128,
        max_sequence_length=256, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD,
    )).eval()
    with torch.no_grad():
        model.model.transformer.ff_out.weight.mul_(20)
    return model.to(device=device, dtype=dtype)


def prompts(lengths: list[int], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of `lengths` tokens, and their attention mask."""
    generator = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(0, 120, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device)


def sample(model, config: DiffusionSamplerConfig, ids, mask, seed: int = 0):
    generator = torch.Generator(device=ids.device).manual_seed(seed)
    return MaskedDiffusionSampler(config).sample(model, ids, mask, generator)


SETTINGS = [
    dict(cache="none"),
    dict(cache="dual"),
    dict(cache="prefix"),
    dict(cache="dual", cache_refresh_interval=2),
    dict(cache="dual", threshold=0.7),
    dict(cache="none", cfg_scale=1.0),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_static_forwards_sample_what_the_eager_model_samples(settings, temperature):
    eager = tiny_llada()
    static = tiny_llada()
    static.static_forwards = StaticForwards(static, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, temperature=temperature,
                                    mask_token_id=MASK, eos_token_ids=(EOS,), pad_token_id=PAD, **settings)
    for lengths in ([7, 7, 7], [5, 9, 3]):  # unpadded, padded; both bucketed to PROMPT_BUCKET by the static forwards
        ids, mask = prompts(lengths)
        expected, got = sample(eager, config, ids, mask), sample(static, config, ids, mask)
        assert got.prompt_length == expected.prompt_length == max(lengths)
        assert torch.equal(got.sequences, expected.sequences)
        assert torch.equal(got.attention_mask, expected.attention_mask)
        assert torch.equal(got.commit_step, expected.commit_step)
        torch.testing.assert_close(got.step_logprobs, expected.step_logprobs, atol=1e-4, rtol=1e-4)


def test_the_key_value_buffers_are_allocated_once_per_canvas_shape_and_written_in_place():
    model = tiny_llada()
    forwards = model.static_forwards = StaticForwards(model, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, cache="dual", mask_token_id=MASK,
                                    eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = prompts([5, 9, 3])
    sample(model, config, ids, mask)
    (shape, buffers), = forwards.buffers.items()
    assert shape == (3, PROMPT_BUCKET + 32)
    addresses = [keys.data_ptr() for keys, _ in buffers]
    before = buffers[0][0].clone()
    sample(model, config, ids.flip(0), mask.flip(0))  # other prompts, the same canvas shape
    assert list(forwards.buffers) == [shape]
    assert [keys.data_ptr() for keys, _ in forwards.buffers[shape]] == addresses
    assert not torch.equal(forwards.buffers[shape][0][0], before)


def test_prompt_buckets_are_multiples_and_are_skipped_past_the_models_length():
    assert [bucketed_prompt_length(n) for n in (1, PROMPT_BUCKET, PROMPT_BUCKET + 1)] == [
        PROMPT_BUCKET, PROMPT_BUCKET, 2 * PROMPT_BUCKET]
    model = tiny_llada()  # max_sequence_length 256: a 200-token prompt + 32 fits, its bucket (256) + 32 does not
    model.static_forwards = StaticForwards(model, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=8, mask_token_id=MASK, eos_token_ids=(EOS,),
                                    pad_token_id=PAD)
    ids, mask = prompts([200, 190])
    assert sample(model, config, ids, mask).sequences.shape == (2, 232)


def test_scoring_under_autograd_never_uses_the_static_forwards():
    model = tiny_llada()
    model.static_forwards = StaticForwards(model, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=16, block_length=8, steps=8, cache="dual", mask_token_id=MASK,
                                    eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = prompts([5, 9])
    rollout = sample(model, config, ids, mask)
    sampler = MaskedDiffusionSampler(config)
    positions = torch.arange(rollout.prompt_length, rollout.sequences.shape[1])
    logits = sampler.scoring_logits(model, rollout.sequences, rollout.attention_mask, positions)
    assert logits.requires_grad
    assert len(model.static_forwards.buffers) == 1  # the rollout's; scoring made none


def test_a_forward_that_cannot_be_captured_runs_without_graphs_said_in_one_warning(monkeypatch, caplog):
    import dllm_ais.sampling.static_forwards as static_forwards

    def cannot_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(static_forwards, "_CapturedForward", cannot_capture)
    monkeypatch.setattr(static_forwards.torch.cuda, "graph_pool_handle", lambda: "pool")
    eager, model = tiny_llada(), tiny_llada()
    model.static_forwards = StaticForwards(model, cuda_graphs=True)
    config = DiffusionSamplerConfig(gen_length=16, block_length=8, steps=8, cache="dual", mask_token_id=MASK,
                                    eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = prompts([7, 7])
    with caplog.at_level("WARNING", logger="dllm_ais"):
        got, expected = sample(model, config, ids, mask), sample(eager, config, ids, mask)
    assert torch.equal(got.sequences, expected.sequences) and not model.static_forwards.cuda_graphs
    assert [record.getMessage() for record in caplog.records] == [
        "the rollout engine's forward cannot be captured as a CUDA graph (operation not permitted when stream is "
        "capturing); its sampling forwards run without graphs from now on."]


@pytest.mark.slow
def test_the_compiled_engine_samples_what_the_eager_engine_samples():
    """torch.compile (Inductor on this CPU) of every block: the rollouts of a compiled engine match the eager one's."""
    trainer = tiny_llada()
    eager, compiled = RolloutEngine(trainer, "bf16"), RolloutEngine(trainer, "bf16", compile=True)
    assert eager.execution_path == "eager" and compiled.execution_path.startswith("compiled")
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, cache="dual", mask_token_id=MASK,
                                    eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = prompts([5, 9, 3])
    expected, got = sample(eager.model, config, ids, mask), sample(compiled.model, config, ids, mask)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.step_logprobs, expected.step_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_rollouts_match_the_eager_engine():
    """On a GPU, the compiled FP8 engine (compiled blocks, CUDA graphs) against the eager one, in bfloat16, for each
    cache mode: greedy tokens and the recorded log-probs agree within the compiled kernels' rounding (printed as the
    share of equal tokens and the largest log-prob gap), and a replayed graph's rollout equals its first one."""
    trainer = tiny_llada("cuda", torch.bfloat16)
    eager, compiled = RolloutEngine(trainer, "fp8"), RolloutEngine(trainer, "fp8", compile=True)
    assert "CUDA graphs" in compiled.execution_path
    ids, mask = prompts([PROMPT_BUCKET, PROMPT_BUCKET - 3, PROMPT_BUCKET - 9, PROMPT_BUCKET], "cuda")
    agreement = {}
    for cache in ("none", "dual", "prefix"):
        config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, cache=cache, mask_token_id=MASK,
                                        eos_token_ids=(EOS,), pad_token_id=PAD)
        first = sample(compiled.model, config, ids, mask)  # captures this cache mode's graphs
        expected, got = sample(eager.model, config, ids, mask), sample(compiled.model, config, ids, mask)
        assert torch.equal(got.sequences, first.sequences) and torch.equal(got.step_logprobs, first.step_logprobs)
        completion = slice(expected.prompt_length, None)
        same = (got.sequences[:, completion] == expected.sequences[:, completion]).float().mean().item()
        gap = (got.step_logprobs - expected.step_logprobs).abs().max().item()
        print(f"cuda graphs fp8 cache={cache}: completion tokens equal {same:.3f}, largest |Δ log-prob| {gap:.2e}")
        agreement[cache] = same
    assert min(agreement.values()) >= 0.75, agreement

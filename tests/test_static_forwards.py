"""The compiled engine's static forwards (`rollout.compile`): the same rollouts as the eager engine, key/value buffers
allocated once and written in place, prompts bucketed; the autoregressive decode step against a static cache; on a
GPU, the forwards replayed as CUDA graphs."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import dllm_ais
from dllm_ais.engine import RolloutEngine
from dllm_ais.likelihood import causal_logprobs
from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.sampling.autoregressive import STOP_CHECK_INTERVAL, AutoregressiveSampler, AutoregressiveSamplerConfig
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler
from dllm_ais.sampling.fp8_cache import FP8KeyValueCache
from dllm_ais.sampling.forwards import PROMPT_BUCKET, StaticForwards, bucketed_prompt_length

MASK, EOS, PAD = 127, 126, 126
QWEN3_ASSET = Path(dllm_ais.__file__).parent / "assets" / "tiny_qwen3"
QWEN3_EOS = 2  # the asset's EOS and pad id; its vocabulary has 104 tokens


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


def tiny_qwen3(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The embedded tiny Qwen3 (a trained causal LM)."""
    return AutoModelForCausalLM.from_pretrained(QWEN3_ASSET, dtype=dtype).eval().to(device)


def prompts(lengths: list[int], device: str = "cpu", vocab: int = 120, pad: int = PAD
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of `lengths` tokens below `vocab`, and their attention mask."""
    generator = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids.to(device), mask.to(device)


def sample(model, config: DiffusionSamplerConfig, ids, mask, seed: int = 0, forwards=None):
    generator = torch.Generator(device=ids.device).manual_seed(seed)
    return MaskedDiffusionSampler(config).sample(model, ids, mask, generator, forwards)


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
    forwards = StaticForwards(static, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, temperature=temperature,
                                    mask_token_id=MASK, eos_token_ids=(EOS,), pad_token_id=PAD, **settings)
    for lengths in ([7, 7, 7], [5, 9, 3]):  # unpadded, padded; both bucketed to PROMPT_BUCKET by the static forwards
        ids, mask = prompts(lengths)
        expected, got = sample(eager, config, ids, mask), sample(static, config, ids, mask, forwards=forwards)
        assert got.prompt_length == expected.prompt_length == max(lengths)
        assert torch.equal(got.sequences, expected.sequences)
        assert torch.equal(got.attention_mask, expected.attention_mask)
        assert torch.equal(got.commit_step, expected.commit_step)
        torch.testing.assert_close(got.step_logprobs, expected.step_logprobs, atol=1e-4, rtol=1e-4)


FP8_CACHE_SETTINGS = [dict(cache="dual"), dict(cache="prefix", cache_refresh_interval=3), dict(cache="dual", threshold=0.7)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("settings", FP8_CACHE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_fp8_cache_in_static_buffers_samples_what_the_eager_fp8_cache_samples(settings, temperature):
    """`cache_dtype: fp8` through the static forwards: FP8 storage allocated once per canvas shape, refreshed in place.
    An FP8 scale spans the whole canvas, its padding included, so the prompts here are a bucket wide: the static
    forwards pad them no further, and both samplers quantize the same canvas."""
    eager = tiny_llada()
    static = tiny_llada()
    forwards = StaticForwards(static, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, temperature=temperature,
                                    mask_token_id=MASK, eos_token_ids=(EOS,), pad_token_id=PAD, cache_dtype="fp8",
                                    **settings)
    storage = None
    for lengths in ([PROMPT_BUCKET] * 3, [PROMPT_BUCKET - 4, PROMPT_BUCKET, PROMPT_BUCKET - 9]):
        ids, mask = prompts(lengths)
        expected, got = sample(eager, config, ids, mask), sample(static, config, ids, mask, forwards=forwards)
        assert torch.equal(got.sequences, expected.sequences)
        assert torch.equal(got.commit_step, expected.commit_step)
        torch.testing.assert_close(got.step_logprobs, expected.step_logprobs, atol=1e-4, rtol=1e-4)
        (shape, cache), = forwards.buffers.items()
        assert shape == (3, PROMPT_BUCKET + 32, "fp8") and isinstance(cache, FP8KeyValueCache)
        keys, scales = cache.layers[0][0]
        assert keys.dtype == torch.float8_e4m3fn
        if storage is not None:  # the second batch's refreshes wrote the first batch's storage in place
            assert (keys.data_ptr(), scales.data_ptr()) == storage[:2] and not torch.equal(scales, storage[2])
        storage = keys.data_ptr(), scales.data_ptr(), scales.clone()


def test_the_key_value_buffers_are_allocated_once_per_canvas_shape_and_written_in_place():
    model = tiny_llada()
    forwards = StaticForwards(model, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, cache="dual", mask_token_id=MASK,
                                    eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = prompts([5, 9, 3])
    sample(model, config, ids, mask, forwards=forwards)
    (shape, buffers), = forwards.buffers.items()
    assert shape == (3, PROMPT_BUCKET + 32, "none")
    addresses = [keys.data_ptr() for keys, _ in buffers]
    before = buffers[0][0].clone()
    sample(model, config, ids.flip(0), mask.flip(0), forwards=forwards)  # other prompts, the same canvas shape
    assert list(forwards.buffers) == [shape]
    assert [keys.data_ptr() for keys, _ in forwards.buffers[shape]] == addresses
    assert not torch.equal(forwards.buffers[shape][0][0], before)


def test_prompt_buckets_are_multiples_and_are_skipped_past_the_models_length():
    assert [bucketed_prompt_length(n) for n in (1, PROMPT_BUCKET, PROMPT_BUCKET + 1)] == [
        PROMPT_BUCKET, PROMPT_BUCKET, 2 * PROMPT_BUCKET]
    model = tiny_llada()  # max_sequence_length 256: a 200-token prompt + 32 fits, its bucket (256) + 32 does not
    forwards = StaticForwards(model, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=8, mask_token_id=MASK, eos_token_ids=(EOS,),
                                    pad_token_id=PAD)
    ids, mask = prompts([200, 190])
    assert sample(model, config, ids, mask, forwards=forwards).sequences.shape == (2, 232)


def test_scoring_never_uses_the_engines_static_forwards():
    model = tiny_llada()
    forwards = StaticForwards(model, cuda_graphs=False)
    config = DiffusionSamplerConfig(gen_length=16, block_length=8, steps=8, cache="dual", mask_token_id=MASK,
                                    eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = prompts([5, 9])
    rollout = sample(model, config, ids, mask, forwards=forwards)
    sampler = MaskedDiffusionSampler(config)
    positions = torch.arange(rollout.prompt_length, rollout.sequences.shape[1])
    logits = sampler.scoring_logits(model, rollout.sequences, rollout.attention_mask, positions)
    assert logits.requires_grad
    with torch.no_grad():
        list(sampler.decoder_logits(model, rollout))
    assert len(forwards.buffers) == 1  # the rollout's; scoring and the decoder replay made none


def test_a_forward_that_cannot_be_captured_runs_without_graphs_said_in_one_warning(monkeypatch, caplog):
    import dllm_ais.sampling.forwards as static_forwards

    def cannot_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(static_forwards, "_CapturedForward", cannot_capture)
    monkeypatch.setattr(static_forwards.torch.cuda, "graph_pool_handle", lambda: "pool")
    eager, model = tiny_llada(), tiny_llada()
    forwards = StaticForwards(model, cuda_graphs=True)
    config = DiffusionSamplerConfig(gen_length=16, block_length=8, steps=8, cache="dual", mask_token_id=MASK,
                                    eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = prompts([7, 7])
    with caplog.at_level("WARNING", logger="dllm_ais"):
        got, expected = sample(model, config, ids, mask, forwards=forwards), sample(eager, config, ids, mask)
    assert torch.equal(got.sequences, expected.sequences) and not forwards.cuda_graphs
    assert [record.getMessage() for record in caplog.records] == [
        "the rollout engine's forward cannot be captured as a CUDA graph (operation not permitted when stream is "
        "capturing); its sampling forwards run without graphs from now on."]


def qwen3_prompts(lengths: list[int], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return prompts(lengths, device, vocab=100, pad=QWEN3_EOS)


def decode(model, ids, mask, seed: int = 0, forwards=None, **settings):
    config = AutoregressiveSamplerConfig(**{"max_new_tokens": 24, **settings})
    generator = torch.Generator(device=ids.device).manual_seed(seed)
    return AutoregressiveSampler(config).sample(model, ids, mask, generator, forwards)


AR_SETTINGS = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=8, top_p=0.9)]


@pytest.mark.parametrize("settings", AR_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_static_decoding_samples_what_the_eager_decoding_samples(settings):
    eager, static = tiny_qwen3(), tiny_qwen3()
    forwards = StaticForwards(static, cuda_graphs=False)
    for lengths in ([7, 7, 7], [5, 9, 3]):  # unpadded, left-padded
        ids, mask = qwen3_prompts(lengths)
        expected, got = decode(eager, ids, mask, **settings), decode(static, ids, mask, forwards=forwards, **settings)
        for name in ("sequences", "attention_mask", "completion_mask", "commit_step", "num_steps"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name
        assert got.prompt_length == expected.prompt_length
        torch.testing.assert_close(got.step_logprobs, expected.step_logprobs, atol=1e-5, rtol=0)
        replayed = causal_logprobs(static, got.sequences, got.attention_mask, got.prompt_length,
                                   settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0))
        valid = got.completion_mask
        torch.testing.assert_close(got.step_logprobs[valid], replayed[valid], atol=1e-5, rtol=0)
    assert list(forwards.decode_caches) == [(3, PROMPT_BUCKET + 24)]  # both prompt widths share one bucket


def test_the_static_decode_cache_is_allocated_once_per_bucket_and_refilled_in_place():
    model = tiny_qwen3()
    forwards = StaticForwards(model, cuda_graphs=False)
    ids, mask = qwen3_prompts([5, 9, 3])
    first = decode(model, ids, mask, temperature=1.0, forwards=forwards)
    (shape, cache), = forwards.decode_caches.items()
    addresses = [layer.keys.data_ptr() for layer in cache.layers]
    decode(model, *qwen3_prompts([4, 4, 4]), temperature=1.0, forwards=forwards)  # another prompt width, the same bucket
    again = decode(model, ids, mask, temperature=1.0, forwards=forwards)
    assert list(forwards.decode_caches) == [shape] and forwards.decode_caches[shape] is cache
    assert [layer.keys.data_ptr() for layer in cache.layers] == addresses
    assert torch.equal(again.sequences, first.sequences)  # emptied between calls: nothing of the last call is read


def test_static_decoding_checks_the_early_stop_every_interval_and_records_the_same_rollout():
    eager, static = tiny_qwen3(), tiny_qwen3()
    forwards = StaticForwards(static, cuda_graphs=False)
    ids, mask = qwen3_prompts([5, 9, 3])
    every_token_ends = dict(temperature=1.0, eos_token_ids=tuple(range(104)), max_new_tokens=3 * STOP_CHECK_INTERVAL)
    calls = []
    handle = static.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        got = decode(static, ids, mask, forwards=forwards, **every_token_ends)
    finally:
        handle.remove()
    expected = decode(eager, ids, mask, **every_token_ends)
    assert len(calls) == STOP_CHECK_INTERVAL  # the prompts' forward, then steps up to the first check
    assert got.completion_mask.sum(1).tolist() == [1, 1, 1]
    for name in ("sequences", "completion_mask", "num_steps"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    torch.testing.assert_close(got.step_logprobs, expected.step_logprobs, atol=1e-5, rtol=0)


def test_the_autoregressive_policys_engine_is_compiled_like_the_diffusion_ones(tokenizer, tmp_path):
    from conftest import tiny_qwen3 as qwen3_for
    from test_trainer import make_trainer

    trainer = make_trainer(tokenizer, tmp_path, model_fn=qwen3_for, rollout={"compile": True})
    assert trainer.engine.execution_path.startswith("compiled")
    assert isinstance(trainer.engine.forwards, StaticForwards) and not hasattr(trainer.engine.model, "static_forwards")


@pytest.mark.slow
def test_the_compiled_engine_samples_what_the_eager_engine_samples():
    """torch.compile (Inductor on this CPU) of every block: the rollouts of a compiled engine match the eager one's."""
    trainer = tiny_llada()
    eager, compiled = RolloutEngine(trainer, "bf16"), RolloutEngine(trainer, "bf16", compile=True)
    assert eager.execution_path == "eager" and compiled.execution_path.startswith("compiled")
    config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, cache="dual", mask_token_id=MASK,
                                    eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = prompts([5, 9, 3])
    expected, got = sample(eager.model, config, ids, mask), sample(compiled.model, config, ids, mask, forwards=compiled.forwards)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.step_logprobs, expected.step_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_the_compiled_autoregressive_engine_decodes_what_the_eager_engine_decodes():
    """torch.compile (Inductor on this CPU) of every Qwen3 block, the static cache written inside the compiled
    blocks: the compiled engine's rollouts match the eager one's."""
    trainer = tiny_qwen3()
    eager, compiled = RolloutEngine(trainer, "bf16"), RolloutEngine(trainer, "bf16", compile=True)
    ids, mask = qwen3_prompts([5, 9, 3])
    for settings in AR_SETTINGS[:2]:
        expected, got = decode(eager.model, ids, mask, **settings), decode(compiled.model, ids, mask, forwards=compiled.forwards, **settings)
        assert torch.equal(got.sequences, expected.sequences)
        torch.testing.assert_close(got.step_logprobs, expected.step_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cache_dtype, caches", [("none", ("none", "dual", "prefix")), ("fp8", ("dual", "prefix"))])
def test_cuda_graph_rollouts_match_the_eager_engine(cache_dtype, caches):
    """On a GPU, the compiled FP8 engine (compiled blocks, CUDA graphs) against the eager one, in bfloat16, for each
    cache mode, its keys/values stored as the model returns them or in FP8 (`cache_dtype: fp8`, refreshed in place
    inside the graphs), prompts whose batch is a bucket wide (no further padding, so the FP8 cache's scales span the
    same canvas): greedy tokens and the recorded log-probs agree within the compiled kernels' rounding (printed as the
    share of equal tokens and the largest log-prob gap), and a replayed graph's rollout equals its first one."""
    trainer = tiny_llada("cuda", torch.bfloat16)
    eager, compiled = RolloutEngine(trainer, "fp8"), RolloutEngine(trainer, "fp8", compile=True)
    assert "CUDA graphs" in compiled.execution_path
    ids, mask = prompts([PROMPT_BUCKET, PROMPT_BUCKET - 3, PROMPT_BUCKET - 9, PROMPT_BUCKET], "cuda")
    agreement = {}
    for cache in caches:
        config = DiffusionSamplerConfig(gen_length=32, block_length=8, steps=16, cache=cache, cache_dtype=cache_dtype,
                                        mask_token_id=MASK, eos_token_ids=(EOS,), pad_token_id=PAD)
        first = sample(compiled.model, config, ids, mask, forwards=compiled.forwards)  # captures this cache mode's graphs
        expected, got = sample(eager.model, config, ids, mask), sample(compiled.model, config, ids, mask, forwards=compiled.forwards)
        assert torch.equal(got.sequences, first.sequences) and torch.equal(got.step_logprobs, first.step_logprobs)
        completion = slice(expected.prompt_length, None)
        same = (got.sequences[:, completion] == expected.sequences[:, completion]).float().mean().item()
        gap = (got.step_logprobs - expected.step_logprobs).abs().max().item()
        print(f"cuda graphs fp8 cache={cache} cache_dtype={cache_dtype}: completion tokens equal {same:.3f}, "
              f"largest |Δ log-prob| {gap:.2e}")
        agreement[cache] = same
    assert compiled.forwards.graphs, "no forward was captured"
    assert min(agreement.values()) >= 0.75, agreement


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decoding_reproduces_its_log_probs_and_replays_identically():
    """On a GPU, the compiled FP8 engine's autoregressive decoding (compiled Qwen3 blocks, the decode step replayed as
    one CUDA graph against the static cache, whose write offset the capture's warm-ups leave in place): every step of
    every call replays one graph; a replay's rollout equals the first (capturing) call's; the recorded log-probs are
    those the same model gives the rollout teacher-forced, within bfloat16 rounding (a wrong cache position or mask
    would move them by far more); the share of greedy tokens equal to the eager engine's is printed."""
    trainer = tiny_qwen3("cuda", torch.bfloat16)
    eager, compiled = RolloutEngine(trainer, "fp8"), RolloutEngine(trainer, "fp8", compile=True)
    ids, mask = qwen3_prompts([12, 9, 5, 12], "cuda")
    for settings in AR_SETTINGS[:2]:
        first = decode(compiled.model, ids, mask, max_new_tokens=40, forwards=compiled.forwards, **settings)
        got = decode(compiled.model, ids, mask, max_new_tokens=40, forwards=compiled.forwards, **settings)
        assert torch.equal(got.sequences, first.sequences) and torch.equal(got.step_logprobs, first.step_logprobs)
        replayed = causal_logprobs(compiled.model, got.sequences, got.attention_mask, got.prompt_length,
                                   settings["temperature"])
        valid = got.completion_mask
        gap = (got.step_logprobs[valid] - replayed[valid]).abs().max().item()
        expected = decode(eager.model, ids, mask, max_new_tokens=40, **settings)
        same = (got.completion_ids == expected.completion_ids).float().mean().item()
        print(f"cuda graph decoding {settings}: |recorded − teacher-forced log-prob| ≤ {gap:.2e}, "
              f"completion tokens equal to the eager engine's {same:.3f}")
        assert gap < 0.1, gap
    assert len(compiled.forwards.graphs) == 1

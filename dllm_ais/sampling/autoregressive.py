"""Autoregressive sampler: token-by-token decoding of a transformers causal LM (Qwen3, Llama, ...) into a `Rollout`.

Supported: ancestral sampling from softmax(shape_logits(logits)) with temperature, top-k and top-p
(transformers' own warpers, in `generate`'s order), greedy decoding (temperature 0), several EOS ids,
left-padded batches with an attention mask, the model's KV cache. Not supported, and rejected by
`AutoregressiveSamplerConfig.from_generation_kwargs`: beam search, repetition/length penalties,
min-p/typical-p, n-gram blocking, several return sequences per prompt (repeat the prompt instead).

The rollout engine's forwards, when compiled (`rollout.compile`: `StaticForwards`), decode at static shapes:
the prompts fill a transformers `StaticCache` sized to the prompt length's bucket plus `max_new_tokens`, and each step
is one token per row under an attention mask of the cache's whole length, replayed as a CUDA graph on a GPU
(`dllm_ais.sampling.forwards`). The early stop is then checked every `STOP_CHECK_INTERVAL` steps only: a check
reads `finished` on the host, which waits for every step queued on the device; the steps run past the last EOS emit
pad with log-prob 0, as finished rows always do, so the `Rollout` is the same as with a check every step.

The recorded `step_logprobs` are log-probs under the distribution actually sampled (after processing),
so `dllm_ais.likelihood.causal_logprobs(model, rollout.sequences, rollout.attention_mask, P, τ, top_k,
top_p)` reproduces them on the same model: their ratio measures only a difference between models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dllm_ais.likelihood import (
    causal_position_ids,
    check_sampling_parameters,
    is_plain_int,
    require_causal_lm,
    selective_log_softmax,
    shape_logits,
)
from dllm_ais.rollout import PromptError, Rollout, completion_mask_through_first_eos, token_id_tuple
from dllm_ais.sampling.forwards import EagerForwards, StaticForwards, bucketed_prompt_length

__all__ = ["AutoregressiveSampler", "AutoregressiveSamplerConfig", "STOP_CHECK_INTERVAL"]

STOP_CHECK_INTERVAL = 16  # static decoding: steps between the checks whether every row has finished

_GENERATE_KWARGS_WITH_NEUTRAL_VALUE = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_p": None,
    "typical_p": 1.0,
    "use_cache": True,
}


@dataclass
class AutoregressiveSamplerConfig:
    """Decoding settings.

    Attributes:
        max_new_tokens: completion length L; every rollout is padded to exactly L.
        temperature: τ > 0 samples from softmax(logits / τ); 0 decodes greedily.
        top_k: keep the k most likely tokens (0 = off; note `generate` defaults to 50, this to 0).
        top_p: keep the smallest set of tokens with probability ≥ top_p (1 = off).
        eos_token_ids: ids that end a completion; empty = the model's generation_config / config EOS.
        pad_token_id: emitted after EOS; None = the model config's pad id, else the first EOS id.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not is_plain_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int; got {self.max_new_tokens!r}")
        check_sampling_parameters(self.temperature, self.top_k, self.top_p)
        self.eos_token_ids = token_id_tuple(self.eos_token_ids)
        if self.pad_token_id is not None and not is_plain_int(self.pad_token_id):
            raise ValueError(f"pad_token_id must be an int or None; got {self.pad_token_id!r}")

    @classmethod
    def from_generation_kwargs(cls, **generation_kwargs: Any) -> "AutoregressiveSamplerConfig":
        """Build a config from `model.generate`-style keywords, rejecting what this sampler cannot do.

        Understood: max_new_tokens, temperature, top_k, top_p, do_sample (False = greedy), eos_token_id
        (int or list), pad_token_id. Accepted only at their neutral value: num_beams=1,
        num_return_sequences=1, repetition_penalty=1.0, length_penalty=1.0, no_repeat_ngram_size=0,
        min_p=None, typical_p=1.0, use_cache=True, num_beam_groups=1. Anything else raises ValueError.
        """
        kwargs = dict(generation_kwargs)
        unsupported = []
        for key, neutral in _GENERATE_KWARGS_WITH_NEUTRAL_VALUE.items():
            if key in kwargs and kwargs.pop(key) != neutral:
                unsupported.append(f"{key}={generation_kwargs[key]!r} (only {neutral!r} is supported)")
        fields = {}
        if "eos_token_id" in kwargs:
            fields["eos_token_ids"] = kwargs.pop("eos_token_id")
        if kwargs.pop("do_sample", True) is False:
            fields["temperature"] = 0.0
            kwargs.pop("temperature", None)
        for key in ("max_new_tokens", "temperature", "top_k", "top_p", "pad_token_id"):
            if key in kwargs:
                fields[key] = kwargs.pop(key)
        unsupported += [f"{key}={value!r}" for key, value in kwargs.items()]
        if unsupported:
            raise ValueError(
                "AutoregressiveSampler does not support: " + ", ".join(unsupported)
                + ". It samples with temperature/top_k/top_p (or greedily) only; remove these settings."
            )
        return cls(**fields)


class AutoregressiveSampler:
    """Decodes completions from a causal LM with its KV cache; see the module docstring for what is supported."""

    def __init__(self, config: AutoregressiveSamplerConfig | None = None):
        self.config = config if config is not None else AutoregressiveSamplerConfig()

    def special_tokens(self, model: nn.Module) -> tuple[tuple[int, ...], int]:
        """(EOS ids, pad id): from the config, else model.generation_config / model.config; pad falls back to EOS."""
        eos_ids = self.config.eos_token_ids
        for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
            if not eos_ids:
                eos_ids = token_id_tuple(getattr(source, "eos_token_id", None))
        pad_id = self.config.pad_token_id
        if pad_id is None:
            pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        if pad_id is None and eos_ids:
            pad_id = eos_ids[0]
        if pad_id is None:
            raise ValueError(
                "AutoregressiveSampler needs a pad token id to fill finished rows: set "
                "AutoregressiveSamplerConfig(pad_token_id=...) or eos_token_ids, or model.config.pad_token_id."
            )
        return eos_ids, pad_id

    @torch.no_grad()
    def sample(
        self,
        model: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        generator: torch.Generator | None = None,
        forwards: EagerForwards | None = None,
    ) -> Rollout:
        """Decode `max_new_tokens` steps after left-padded prompts `input_ids` [B, P], the forwards run by `forwards`
        (`dllm_ais.sampling.forwards`; the rollout engine hands its own; None = the model as it is).

        Step k: s = shape_logits(f(x)_{last}, τ, top_k, top_p) in float32; token ~ softmax(s) drawn with
        `torch.multinomial(generator=generator)` (argmax for τ = 0); step_logprobs[:, k] = log softmax(s)[token];
        commit_step[:, k] = k; num_steps = the steps through the row's first EOS. Rows that have emitted an EOS emit
        `pad` (log-prob 0) from then on; decoding stops when every row has finished (checked every step, or every
        STOP_CHECK_INTERVAL steps when the model decodes at static shapes) — with a model sharded by FSDP2, when every
        process's rows have (`EagerForwards.agreed`), so that all run the same forwards — and the completion is padded
        to exactly max_new_tokens.
        Draws happen on the generator's device (pass one on the model's device to avoid a copy per step).
        """
        require_causal_lm(model, "AutoregressiveSampler")
        cfg = self.config
        eos_ids, pad_id = self.special_tokens(model)
        attention_mask = self._check_prompts(model, input_ids, attention_mask)
        batch, prompt_length = input_ids.shape
        device = input_ids.device
        eos = torch.tensor(eos_ids, dtype=torch.long, device=device)

        static = forwards is not None and forwards.static_shapes
        decode = (_StaticDecode(forwards, attention_mask, cfg.max_new_tokens) if static
                  else _DynamicDecode(model, attention_mask))
        stop_check_interval = STOP_CHECK_INTERVAL if static else 1
        stop = forwards or EagerForwards(model)  # agreed: sharded (FSDP2), all processes stop together
        tokens, logprobs = [], []
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        logits = decode.prefill(input_ids)
        for step in range(1, cfg.max_new_tokens + 1):
            scores = shape_logits(logits.float(), cfg.temperature, cfg.top_k, cfg.top_p)
            token = self._choose(scores, generator)
            logprob = selective_log_softmax(scores, token)
            token = token.masked_fill(finished, pad_id)
            tokens.append(token)
            logprobs.append(logprob.masked_fill(finished, 0.0))
            finished |= torch.isin(token, eos)
            if step == cfg.max_new_tokens or (step % stop_check_interval == 0
                                              and bool(stop.agreed(finished.all().reshape(1), "min")[0])):
                break
            logits = decode.step(token)

        missing = cfg.max_new_tokens - len(tokens)
        completion = torch.nn.functional.pad(torch.stack(tokens, dim=1), (0, missing), value=pad_id)
        step_logprobs = torch.nn.functional.pad(torch.stack(logprobs, dim=1), (0, missing), value=0.0)
        completion_mask = completion_mask_through_first_eos(completion, eos_ids)
        return Rollout(
            sequences=torch.cat([input_ids, completion], dim=1),
            attention_mask=torch.cat([attention_mask, attention_mask.new_ones(batch, cfg.max_new_tokens)], dim=1),
            completion_mask=completion_mask,
            step_logprobs=step_logprobs,
            commit_step=torch.arange(cfg.max_new_tokens, device=device).expand(batch, -1).clone(),
            prompt_length=prompt_length,
            num_steps=completion_mask.sum(dim=1),
        )

    def _choose(self, scores: Tensor, generator: torch.Generator | None) -> Tensor:
        """argmax(scores) for τ = 0, else one draw per row from softmax(scores) on the generator's device."""
        if self.config.temperature == 0:
            return scores.argmax(dim=-1)
        probs = scores.softmax(dim=-1)
        if generator is not None:
            probs = probs.to(generator.device)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(scores.device)

    def _check_prompts(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Validate left-padded prompts and the canvas length; return the attention mask (all ones if None)."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be [batch, prompt_length] with prompt_length ≥ 1; got {tuple(input_ids.shape)}"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}; got {tuple(attention_mask.shape)}"
            )
        real = attention_mask.bool()
        if not bool(real[:, -1].all()) or bool((real[:, 1:] < real[:, :-1]).any()):
            raise ValueError(
                "prompts must be left-padded (padding first, every prompt ending in a real token); "
                "tokenize with tokenizer.padding_side = 'left'."
            )
        max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if max_positions is not None and input_ids.shape[1] + self.config.max_new_tokens > max_positions:
            raise PromptError(
                f"prompt length {input_ids.shape[1]} + max_new_tokens {self.config.max_new_tokens} exceeds the model's "
                f"max_position_embeddings={max_positions}; shorten the prompts or lower max_new_tokens."
            )
        return attention_mask


class _DynamicDecode:
    """The decode forwards with the model's own (growing) cache: the prompts, then one token per row, the attention
    mask extended by one column per step. `prefill` and `step` return the next token's logits [B, V]."""

    def __init__(self, model: nn.Module, attention_mask: Tensor):
        self.model, self.attention_mask = model, attention_mask
        self.positions, self.cache = causal_position_ids(attention_mask), None

    def prefill(self, input_ids: Tensor) -> Tensor:
        return self._forward(input_ids)

    def step(self, token: Tensor) -> Tensor:
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(token), 1)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        return self._forward(token.unsqueeze(1))

    def _forward(self, step_input: Tensor) -> Tensor:
        output = self.model(input_ids=step_input, attention_mask=self.attention_mask, position_ids=self.positions,
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = output.past_key_values
        return output.logits[:, -1]


class _StaticDecode:
    """The decode forwards at static shapes (`StaticForwards`): the prompts [B, P] fill a `StaticCache` with room for
    bucketed_prompt_length(P) + max_new_tokens tokens, then each step writes one token per row at the cache's next
    position, under one attention mask covering the whole cache (the prompts' mask, ones for the completion, zeros
    for the room left unused), so that every step has one shape. `prefill` and `step` return the next token's logits
    [B, V]."""

    def __init__(self, forwards: StaticForwards, attention_mask: Tensor, max_new_tokens: int):
        batch, prompt_length = attention_mask.shape
        length = bucketed_prompt_length(prompt_length) + max_new_tokens
        self.forwards = forwards
        self.cache = forwards.decode_cache(batch, length)
        completion_and_room = torch.arange(length - prompt_length, device=attention_mask.device) < max_new_tokens
        self.attention_mask = torch.cat([attention_mask, completion_and_room.to(attention_mask.dtype).expand(batch, -1)],
                                        dim=1)
        self.positions = causal_position_ids(attention_mask)

    def prefill(self, input_ids: Tensor) -> Tensor:
        output = self.forwards.model(input_ids=input_ids, attention_mask=self.attention_mask, position_ids=self.positions,
                                     past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.positions = self.positions[:, -1:]
        return output.logits[:, -1]

    def step(self, token: Tensor) -> Tensor:
        self.positions = self.positions + 1
        return self.forwards.logits(token.unsqueeze(1), self.attention_mask, 1, past_key_values=self.cache,
                                    position_ids=self.positions)[:, -1]

"""Native Dream: the masked-diffusion transformer of Dream-org/Dream-v0-{Base,Instruct}-7B and apple/DiffuCoder-7B,
registered with transformers' Auto classes under model_type "Dream" (the official checkpoints' own type).

Dream is Qwen2.5 run without a causal mask. The module tree mirrors the official ``modeling_dream.py`` so the Hub
safetensors load unchanged and what we save loads in the official code::

    model.embed_tokens                               token embedding (padding_idx = pad_token_id)
    model.layers.{i}.input_layernorm                 RMSNorm
    model.layers.{i}.self_attn.{q,k,v}_proj          with bias (always, whatever `attention_bias` says)
    model.layers.{i}.self_attn.o_proj                no bias
    model.layers.{i}.post_attention_layernorm        RMSNorm
    model.layers.{i}.mlp.{gate,up,down}_proj         SwiGLU: down(act(gate(x)) * up(x)), no biases
    model.norm                                       final RMSNorm
    lm_head                                          LM head (tied to embed_tokens with tie_word_embeddings)

The class names are the official ones: `DreamModel` is the LM (``architectures: ["DreamModel"]``, what the official
``auto_map`` gives AutoModel), `DreamBaseModel` its transformer under ``model``.

The logits are returned unshifted, as the official forward returns them. Dream was initialised from an autoregressive
model: the token at position i is predicted by the logits at position i - 1 (`dllm_ais.models.families`
`shift_logits_right` puts them in place).

Differences from the official forward, none of them on real tokens: a 2-D attention mask hides padded *keys* only
(the official mask also blanks padded query rows, whose outputs are then undefined), so padded positions get finite
logits that mean nothing.

Key/value cache (for block-cached masked-diffusion sampling), with the interface and semantics of dllm_ais' LLaDA: a
forward with ``use_cache=True`` returns every layer's keys (RoPE applied) and values at every position,
``past_key_values`` = one ``(keys, values)`` pair of [B, num_key_value_heads, T, head_dim] tensors per layer (not
repeated to the query heads). A later forward may run on a subset of the T canvas positions only: ``input_ids``
[B, n] are the tokens at canvas positions ``cache_position`` [n]; their keys and values are written into the cache at
those positions (in place; into a copy under grad) and their queries attend to all T cached positions, under the
canvas's [B, T] attention mask. RoPE positions are those of the uncached forward of the whole canvas (cumsum of the
[B, T] mask minus one, or 0..T-1 without a mask) read at ``cache_position``. Because every position attends to every
other, the cached keys/values of the other positions are stale once the canvas changes: reuse is an approximation
that the caller chooses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .llada import (  # relative: an export ships both files as remote code
    RMSNorm,
    apply_rotary,
    check_cached_forward,
    padding_mask,
    rotary_cos_sin,
    unsupported_config_message,
    write_into_layer_cache,
)

__all__ = ["CanvasPositions", "DreamConfig", "DreamBaseModel", "DreamModel", "canvas_positions"]

KeyValueCache = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (keys, values) of shape [B, num_key_value_heads, T, head_dim]; the keys have RoPE applied."""


@dataclass(repr=False)
class DreamConfig(PreTrainedConfig):
    """Configuration of a Dream model, with the field names of the official ``configuration_dream.py``.

    Defaults are the values of Dream-v0-Instruct-7B's config.json (Qwen2.5-7B's shape, mask 151666, pad 151643).
    `attention_bias`, `mlp_bias`, `max_window_layers` and `sliding_window` are kept so configs round-trip; the official
    model ignores the first two (q/k/v always carry a bias, o_proj and the MLP never) and so does this one. Sliding
    windows and RoPE scaling are rejected at model construction with a message naming the field.
    """

    model_type = "Dream"

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int | None = 4
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = False
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    attention_dropout: float = 0.0
    attention_bias: bool = False
    mlp_bias: bool = False
    mask_token_id: int | None = 151666
    pad_token_id: int | None = 151643
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151643

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def check_supported(self) -> None:
        """Raise ValueError naming every config value this implementation does not support."""
        problems = []
        if self.use_sliding_window:
            problems.append("use_sliding_window=True (supported: false)")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            problems.append(f"rope_scaling={self.rope_scaling!r} (supported: null)")
        if self.hidden_act not in ACT2FN:
            problems.append(f"hidden_act={self.hidden_act!r} is not a transformers activation")
        if self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size={self.hidden_size} is not divisible by "
                            f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if problems:
            raise ValueError(unsupported_config_message("Dream", problems))


class CanvasPositions(NamedTuple):
    """What a forward over n inputs resolves before its layers run (`canvas_positions`)."""

    first_layer: tuple[torch.Tensor, torch.Tensor] | None
    """The cache's first (keys, values) pair, read once (an FP8 cache dequantizes a fresh pair per access); None
    without a cache."""
    cache_position: torch.Tensor
    """[n]: the inputs' canvas indices."""
    position_ids: torch.Tensor
    """[B or 1, n]: the inputs' RoPE positions."""
    key_position_ids: torch.Tensor
    """[B or 1, T]: the RoPE positions of every key attended to (the whole canvas with a cache; the inputs' own
    otherwise)."""


def canvas_positions(x: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                     past_key_values, cache_position: torch.Tensor | None, num_layers: int,
                     max_position_embeddings: int) -> CanvasPositions:
    """Check a forward of the inputs `x` [B, n, ...] (against `past_key_values`, a cache of `num_layers` layers, or
    none) and resolve its positions: real tokens numbered from 0 (cumsum of the canvas's [B, T] `attention_mask`
    minus one, read at `cache_position` with a cache), or the canvas indices `cache_position` (default 0..n-1)
    without a mask; explicit `position_ids` [B, n] win for the inputs. Raise ValueError on an unusable cache or a
    canvas longer than `max_position_embeddings`."""
    length = x.shape[1]
    first_layer = None
    if past_key_values is not None:
        first_layer = past_key_values[0]
        cached_keys = first_layer[0]
        canvas_length = cached_keys.shape[2]
        check_cached_forward(cached_keys, len(past_key_values), num_layers, x, cache_position, attention_mask,
                             position_ids)
    else:
        canvas_length = length
        if cache_position is not None:
            if cache_position.shape != (length,):
                raise ValueError(f"cache_position must give the canvas positions of the {length} inputs (a 1-D "
                                 "tensor).")
            if attention_mask is not None and position_ids is None:
                raise ValueError("Without past_key_values, cache_position sets the positions of unmasked inputs "
                                 "only: pass attention_mask=None, or position_ids [B, n] explicitly.")
            canvas_length = int(cache_position.max()) + 1
    if canvas_length > max_position_embeddings:
        raise ValueError(f"Sequence length {canvas_length} exceeds max_position_embeddings="
                         f"{max_position_embeddings}.")
    if cache_position is None:
        cache_position = torch.arange(length, device=x.device)
    if attention_mask is not None:  # numbered over the whole canvas (the inputs themselves when uncached)
        key_position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    elif past_key_values is not None:
        key_position_ids = torch.arange(canvas_length, device=x.device)[None]
    else:
        key_position_ids = cache_position[None]
    if position_ids is None:
        position_ids = key_position_ids if past_key_values is None else key_position_ids[:, cache_position]
    elif past_key_values is None:
        key_position_ids = position_ids
    return CanvasPositions(first_layer, cache_position, position_ids, key_position_ids)


class DreamAttention(nn.Module):
    """Grouped-query SDPA attention; RoPE applied in the activations' dtype, as the official code does. Dream's
    (Qwen2.5's) has biases on the query/key/value projections only; with `qk_norm` (Qwen3's, SDAR's) each query and
    key head is RMS-normed before RoPE, and `qkv_bias` / `output_bias` say which projections carry biases."""

    def __init__(self, config: PreTrainedConfig, qkv_bias: bool = True, output_bias: bool = False,
                 qk_norm: bool = False):
        super().__init__()
        d, self.n_heads, self.n_kv_heads, self.head_dim = (config.hidden_size, config.num_attention_heads,
                                                            config.num_key_value_heads, config.head_dim)
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=output_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        layer_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache_position: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, n, d], cos/sin [B, 1, n, head_dim] in x's dtype, attn_mask None or bool [B or 1, 1, 1 or n, T]
        (True = key attended to) → ([B, n, d], (keys, values) [B, n_kv_heads, T, head_dim] attended to).

        Without `layer_cache` T = n. With it, the inputs' keys/values are written into the cached pair at
        `cache_position` [n] (in place; into a copy under grad, where the cache may be part of the graph) and the
        queries attend to the T cached positions under `attn_mask`."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        if layer_cache is not None:
            k, v = write_into_layer_cache(layer_cache, cache_position, k, v)
        attn = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=attn_mask, is_causal=False,
            dropout_p=self.attention_dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.o_proj(attn.transpose(1, 2).reshape(batch, length, -1)), (k, v)


class DreamMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), without biases."""

    def __init__(self, config: DreamConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DreamDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); `attention` defaults to Dream's."""

    def __init__(self, config: PreTrainedConfig, attention: nn.Module | None = None):
        super().__init__()
        self.self_attn = attention if attention is not None else DreamAttention(config)
        self.mlp = DreamMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        layer_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache_position: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(output [B, n, d], (keys, values) attended to); see `DreamAttention.forward` for the cache."""
        attn, key_values = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, layer_cache, cache_position)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), key_values


def run_layers(layers: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attn_mask: torch.Tensor | None, past_key_values: KeyValueCache | None, first_layer: Any,
               cache_position: torch.Tensor | None, use_cache: bool) -> tuple[torch.Tensor, KeyValueCache | None]:
    """(hidden states after every layer, the layers' (keys, values) with `use_cache` else None): the decoder layers in
    turn, each on its cached pair of `past_key_values` (the first layer's as `canvas_positions` prepared it)."""
    new_cache = [] if use_cache else None
    for index, layer in enumerate(layers):
        layer_cache = None
        if past_key_values is not None:
            layer_cache = first_layer if index == 0 else past_key_values[index]
        x, key_values = layer(x, cos, sin, attn_mask, layer_cache, cache_position)
        if use_cache:
            new_cache.append(key_values)
    return x, new_cache


class LanguageModelEmbeddings:
    """The embedding accessors transformers asks of an LM holding its transformer as ``model`` (with
    ``embed_tokens``) and its head as ``lm_head``."""

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value


class DreamPreTrainedModel(PreTrainedModel):
    """Weights are initialised by transformers' default `_init_weights`, which is the official Dream one: normal(0,
    initializer_range) Linear and Embedding weights, zero biases, the padding embedding row zeroed, RMSNorm weights 1
    (and none of it over weights a checkpoint loaded)."""

    config_class = DreamConfig
    config: DreamConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DreamDecoderLayer"]
    _supports_sdpa = True


class DreamBaseModel(DreamPreTrainedModel):
    """The Dream transformer (the official `DreamBaseModel`): final-normed hidden states [B, n, d] (and, on request,
    the layers' keys/values)."""

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        config.check_supported()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DreamDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        past_key_values: KeyValueCache | None = None,
        cache_position: torch.Tensor | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, KeyValueCache | None]:
        """(hidden states [B, n, d] of the input embeddings `x` [B, n, d], the layers' (keys, values) with `use_cache`
        else None); see `DreamModel.forward` for the mask, the positions and the cache."""
        first_layer, cache_position, position_ids, _ = canvas_positions(
            x, attention_mask, position_ids, past_key_values, cache_position, len(self.layers),
            self.config.max_position_embeddings)
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
        x, new_cache = run_layers(self.layers, x, cos, sin, padding_mask(attention_mask), past_key_values,
                                  first_layer, cache_position, use_cache)
        return self.norm(x), new_cache


class DreamModel(LanguageModelEmbeddings, DreamPreTrainedModel):
    """Dream for masked-diffusion language modelling (the official `DreamModel`: transformer + LM head);
    `forward` returns `CausalLMOutputWithPast` with unshifted logits.

    Registered for `AutoModel` and `AutoModelForCausalLM`, so `AutoModelForCausalLM.from_pretrained(
    "Dream-org/Dream-v0-Instruct-7B")` needs no trust_remote_code.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: KeyValueCache | None = None,
        cache_position: torch.Tensor | None = None,
        use_cache: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits [B, n', V] of the n input positions, unshifted: all of them (`logits_to_keep` = 0), the last
        `logits_to_keep` (an int), or those at the indices `logits_to_keep` (a 1-D tensor into the n inputs).

        `attention_mask` (1 = real token, 0 = padding) hides padded keys from every query: attention is otherwise
        full (bidirectional). It covers the inputs [B, n], or with `past_key_values` every cached position [B, T].
        `position_ids` [B, n] default to the real tokens numbered from 0 in each row (cumsum(attention_mask) - 1 over
        the whole canvas, as the official generation passes them for left-padded prompts, read at `cache_position`
        with a cache), or the inputs' canvas positions `cache_position` (default 0..n-1) without a mask; so a
        left-padded row's real tokens get the logits they would get unpadded.

        `past_key_values` (from a forward with `use_cache=True` over the whole canvas: per layer (keys, values)
        [B, num_key_value_heads, T, head_dim], keys with RoPE; or any sequence of such pairs, e.g. an
        `FP8KeyValueCache`) is written at `cache_position` [n] (the inputs' canvas indices; in place, into a copy
        under grad) and attended to at every position. `use_cache=True` returns the layers' (keys, values) in the
        output's `past_key_values` (the updated cache with `past_key_values`, a new one without).
        """
        unexpected = {k for k, v in kwargs.items() if v is not None and k != "return_dict"}
        if unexpected:
            raise TypeError(f"DreamModel.forward got unsupported arguments: {sorted(unexpected)} (supported: "
                            "input_ids, attention_mask, position_ids, inputs_embeds, logits_to_keep, "
                            "past_key_values, cache_position, use_cache, return_dict)")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x, new_cache = self.model(x, attention_mask, position_ids, past_key_values, cache_position, bool(use_cache))
        if isinstance(logits_to_keep, torch.Tensor):
            x = x[:, logits_to_keep]
        elif logits_to_keep:
            x = x[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(x), past_key_values=new_cache)


def register_with_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel`/`AutoModelForCausalLM` resolve model_type "Dream" to this implementation."""
    AutoConfig.register(DreamConfig.model_type, DreamConfig, exist_ok=True)
    AutoModel.register(DreamConfig, DreamModel, exist_ok=True)
    AutoModelForCausalLM.register(DreamConfig, DreamModel, exist_ok=True)

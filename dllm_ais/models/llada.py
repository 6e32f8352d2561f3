"""Native LLaDA: the masked-diffusion transformer of GSAI-ML/LLaDA-8B, registered with transformers' Auto classes.

The module tree mirrors the official checkpoints so their safetensors load unchanged and what we save loads
in the official code::

    model.transformer.wte                     token embedding
    model.transformer.blocks.{i}.attn_norm    RMSNorm
    model.transformer.blocks.{i}.{q,k,v}_proj / attn_out
    model.transformer.blocks.{i}.ff_norm      RMSNorm
    model.transformer.blocks.{i}.{ff_proj,up_proj,ff_out}   SwiGLU: ff_out(silu(ff_proj(x)) * up_proj(x))
    model.transformer.ln_f                    final RMSNorm
    model.transformer.ff_out                  untied LM head (absent with weight_tying)

Unlike a causal LM every position attends to every other (bidirectional); padding is excluded through the
attention mask only.

Key/value cache (for block-cached masked-diffusion sampling, Fast-dLLM style): a forward with ``use_cache=True``
returns every layer's keys (RoPE applied) and values at every position, ``past_key_values`` = one
``(keys, values)`` pair of [B, n_kv_heads, T, head_dim] tensors per layer. A later forward may then run on a subset
of the T positions only: ``input_ids`` [B, n] are the tokens at canvas positions ``cache_position`` [n]; their keys
and values are written into the cache at those positions (in place) and their queries attend to all T cached
positions, under the [B, T] attention mask. Because every position attends to every other, the cached keys/values
of the other positions are stale once the canvas changes: reuse is an approximation that the caller chooses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["LLaDAConfig", "LLaDAModel", "LLaDAModelLM"]

KeyValueCache = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (keys, values) of shape [B, n_kv_heads, T, head_dim]; the keys have RoPE applied."""


def unsupported_config_message(family: str, problems: list[str]) -> str:
    """The one-line error for a `family` config.json asking for options this implementation lacks: each of
    `problems`, and the fix (edit config.json, or run the model's own code by the user's own
    --trust_remote_code=true)."""
    return (f"This {family} config uses options dllm_ais does not implement: " + "; ".join(problems)
            + ". Edit config.json, or run the official remote code with --trust_remote_code=true.")


@dataclass(repr=False)
class LLaDAConfig(PreTrainedConfig):
    """Configuration of a LLaDA model, with the OLMo field names of the official config.json.

    Defaults are those of LLaDA-8B-Instruct. Fields the official schema carries but this implementation
    does not support (ALiBi, QK layer norm, QKV clipping, non-llama blocks, ...) are kept so configs
    round-trip, and rejected at model construction with a message naming the field.
    """

    model_type = "llada"

    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int | None = None
    n_layers: int = 32
    mlp_hidden_size: int | None = 12288
    mlp_ratio: int = 4
    vocab_size: int = 126464
    embedding_size: int | None = 126464
    block_type: str = "llama"
    activation_type: str = "silu"
    layer_norm_type: str = "rms"
    rms_norm_eps: float = 1e-5
    rope: bool = True
    rope_theta: float = 500000.0
    rope_full_precision: bool = True
    weight_tying: bool = False
    include_bias: bool = False
    include_qkv_bias: bool = False
    bias_for_layer_norm: bool | None = None
    attention_layer_norm: bool = False
    attention_layer_norm_with_affine: bool = True
    layer_norm_with_affine: bool = True
    alibi: bool = False
    alibi_bias_max: float = 8.0
    clip_qkv: float | None = None
    multi_query_attention: bool | None = None
    scale_logits: bool = False
    input_emb_norm: bool = False
    max_sequence_length: int = 4096
    init_std: float = 0.02
    init_fn: str = "mitchell"
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    mask_token_id: int | None = 126336
    eos_token_id: int | None = 126081
    pad_token_id: int | None = 126081
    use_cache: bool = False

    def __post_init__(self, **kwargs):
        if self.n_kv_heads is None:
            self.n_kv_heads = 1 if self.multi_query_attention else self.n_heads
        super().__post_init__(**kwargs)

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def ffn_hidden_size(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    @property
    def padded_vocab_size(self) -> int:
        return self.embedding_size if self.embedding_size is not None else self.vocab_size

    def check_supported(self) -> None:
        """Raise ValueError naming every config value this implementation does not support."""
        unsupported = {
            "block_type": (self.block_type, self.block_type == "llama", '"llama"'),
            "activation_type": (self.activation_type, self.activation_type in ("silu", "swiglu"), '"silu"'),
            "layer_norm_type": (self.layer_norm_type, self.layer_norm_type in ("rms", "rmsnorm"), '"rms"'),
            "rope": (self.rope, self.rope, "true"),
            "alibi": (self.alibi, not self.alibi, "false"),
            "attention_layer_norm": (self.attention_layer_norm, not self.attention_layer_norm, "false"),
            "clip_qkv": (self.clip_qkv, self.clip_qkv is None, "null"),
        }
        problems = [f"{key}={value!r} (supported: {want})" for key, (value, ok, want) in unsupported.items() if not ok]
        if self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if problems:
            raise ValueError(unsupported_config_message("LLaDA", problems))


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in float32 and cast back (OLMo's RMSLayerNorm)."""

    def __init__(self, size: int, eps: float, affine: bool = True, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if affine else None
        self.bias = nn.Parameter(torch.zeros(size)) if affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            dtype = x.dtype
            xf = x.float()
            x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        if self.weight is not None:
            x = self.weight * x
        if self.bias is not None:
            x = x + self.bias
        return x


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim] in float32 for absolute `positions` of any shape ([n], or [B, n] per sequence):
    angle(p, i) = p / theta^(2i/head_dim), halves concatenated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half([a, b]) = [-b, a] over the last dim."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The [B, 1, 1, T] boolean mask that hides padded keys (0 in `attention_mask` [B, T]) from every query, or None
    without a mask. Built without reading the mask's values on the host (no synchronisation inside a forward): a
    caller whose batch has no padding passes None and gets the unmasked attention kernels."""
    return None if attention_mask is None else attention_mask.bool()[:, None, None, :]


@torch.compiler.disable
def write_into_layer_cache(layer_cache: tuple[torch.Tensor, torch.Tensor], cache_position: torch.Tensor,
                           keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cached (keys, values) [B, H_kv, T, D] with `keys`/`values` [B, H_kv, n, D] written at the positions
    `cache_position` [n]: in place, or into a copy under grad (the cache may then be part of the graph, as in a
    cached trajectory replay).

    Never compiled: a compiled block writes its input buffers out of place and copies each whole buffer back (the
    compiled engine's profile in BENCHMARKS.md); run eagerly between the block's compiled halves, the write touches
    only the n positions."""
    cached_keys, cached_values = layer_cache
    keys, values = keys.to(cached_keys.dtype), values.to(cached_values.dtype)
    if torch.is_grad_enabled():
        return cached_keys.index_copy(2, cache_position, keys), cached_values.index_copy(2, cache_position, values)
    return cached_keys.index_copy_(2, cache_position, keys), cached_values.index_copy_(2, cache_position, values)


def check_cached_forward(cached_keys: torch.Tensor, num_cached_layers: int, num_layers: int, inputs: torch.Tensor,
                         cache_position: torch.Tensor | None, attention_mask: torch.Tensor | None,
                         position_ids: torch.Tensor | None = None) -> None:
    """Raise ValueError, naming every problem, unless a forward of `inputs` [B, n, ...] against a cache whose first
    layer's keys are `cached_keys` [B, H, T, D] (of `num_cached_layers` layers, for a model of `num_layers`) has the
    inputs' canvas positions `cache_position` [n], an `attention_mask` covering the canvas [B, T] (or none) and
    `position_ids` for the n inputs (or none)."""
    batch, length = inputs.shape[:2]
    canvas_length = cached_keys.shape[2]
    problems = []
    if num_cached_layers != num_layers:
        problems.append(f"past_key_values holds {num_cached_layers} layers, the model {num_layers}")
    if cached_keys.shape[0] != batch:
        problems.append(f"past_key_values holds {cached_keys.shape[0]} rows, the inputs {batch}")
    if cache_position is None or cache_position.shape != (length,):
        problems.append(f"cache_position must give the cache positions of the {length} inputs (a 1-D tensor of "
                        "canvas indices)")
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, canvas_length):
        problems.append(f"attention_mask must cover all {canvas_length} cached positions ([B, {canvas_length}], got "
                        f"{list(attention_mask.shape)})")
    if position_ids is not None and position_ids.shape[-1] != length:
        problems.append(f"position_ids must give the positions of the {length} inputs")
    if problems:
        raise ValueError("Invalid cached forward: " + "; ".join(problems) + ". Pass the cache that a use_cache=True "
                         "forward of this model over the whole canvas returned, with cache_position [n] and the "
                         "canvas's [B, T] attention_mask.")


class LLaDABlock(GradientCheckpointingLayer):
    """Pre-norm transformer block with bidirectional SDPA attention and a SwiGLU MLP."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        d, heads, kv_heads = config.d_model, config.n_heads, config.n_kv_heads
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.rope_full_precision = config.rope_full_precision
        self.attention_dropout = config.attention_dropout
        qkv_bias = config.include_bias or config.include_qkv_bias
        norm_bias = bool(config.bias_for_layer_norm if config.bias_for_layer_norm is not None else config.include_bias)
        self.attn_norm = RMSNorm(d, config.rms_norm_eps, config.layer_norm_with_affine, norm_bias)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=config.include_bias)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps, config.layer_norm_with_affine, norm_bias)
        self.ff_proj = nn.Linear(d, config.ffn_hidden_size, bias=config.include_bias)
        self.up_proj = nn.Linear(d, config.ffn_hidden_size, bias=config.include_bias)
        self.ff_out = nn.Linear(config.ffn_hidden_size, d, bias=config.include_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        layer_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache_position: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(output [B, n, d], (keys, values) attended to). With `layer_cache`, the inputs' keys/values are written
        into it at `cache_position` (in place; into a copy under grad, where the cache may be part of the graph) and
        the queries attend to all of its positions."""
        batch, length, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope_full_precision:
            q, k = apply_rotary(q.float(), cos, sin).to(v.dtype), apply_rotary(k.float(), cos, sin).to(v.dtype)
        else:
            q, k = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        if layer_cache is not None:
            k, v = write_into_layer_cache(layer_cache, cache_position, k, v)
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=False,
            dropout_p=self.attention_dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        x = x + self.attn_out(attn.transpose(1, 2).reshape(batch, length, -1))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h)), (k, v)


class LLaDAPreTrainedModel(PreTrainedModel):
    config_class = LLaDAConfig
    config: LLaDAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDABlock"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class LLaDAModel(LLaDAPreTrainedModel):
    """The LLaDA transformer under the official module names: returns logits over the (padded) vocabulary."""

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        config.check_supported()
        modules = {
            "wte": nn.Embedding(config.padded_vocab_size, config.d_model),
            "blocks": nn.ModuleList(LLaDABlock(config) for _ in range(config.n_layers)),
            "ln_f": RMSNorm(config.d_model, config.rms_norm_eps, config.layer_norm_with_affine,
                            bool(config.bias_for_layer_norm if config.bias_for_layer_norm is not None else config.include_bias)),
        }
        if not config.weight_tying:
            modules["ff_out"] = nn.Linear(config.d_model, config.padded_vocab_size, bias=config.include_bias)
        self.transformer = nn.ModuleDict(modules)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: KeyValueCache | None = None,
        cache_position: torch.Tensor | None = None,
        use_cache: bool = False,
    ) -> CausalLMOutputWithPast:
        """Logits [B, n', V] of the n input positions: all of them (`logits_to_keep` = 0), the last
        `logits_to_keep` (an int), or those at the indices `logits_to_keep` (a 1-D tensor into the n inputs).

        `attention_mask` (1 = real token, 0 = padding) hides padded keys from every query; it covers the inputs
        [B, n], or with `past_key_values` every cached position [B, T]. Positions are absolute indices: 0..n-1, or
        `cache_position` [n] (the inputs' positions in the cache; default 0..n-1). RoPE makes real-token scores
        depend only on relative distance, so left padding with a mask leaves the real tokens' logits unchanged.

        `past_key_values` (from a forward with `use_cache=True` over the whole canvas) is updated in place at
        `cache_position` and attended to at every position; `use_cache=True` returns it (a new one without
        `past_key_values`) in the output's `past_key_values`.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        x = self.transformer.wte(input_ids) if inputs_embeds is None else inputs_embeds
        if self.config.input_emb_norm:
            x = x * self.config.d_model**0.5
        length = x.shape[1]
        canvas_length = length
        if past_key_values is not None:
            canvas_length = past_key_values[0][0].shape[2]
            check_cached_forward(past_key_values[0][0], len(past_key_values), len(self.transformer.blocks), x,
                                 cache_position, attention_mask)
        elif cache_position is not None:
            canvas_length = int(cache_position.max()) + 1
        if cache_position is None:
            cache_position = torch.arange(length, device=x.device)
        if canvas_length > self.config.max_sequence_length:
            raise ValueError(
                f"Sequence length {canvas_length} exceeds max_sequence_length={self.config.max_sequence_length}."
            )
        cos, sin = rotary_cos_sin(cache_position, self.config.d_model // self.config.n_heads, self.config.rope_theta)
        attn_mask = padding_mask(attention_mask)
        new_cache = []
        for index, block in enumerate(self.transformer.blocks):
            layer_cache = None if past_key_values is None else past_key_values[index]
            x, key_values = block(x, cos, sin, attn_mask, layer_cache, cache_position)
            if use_cache:
                new_cache.append(key_values)
        if isinstance(logits_to_keep, torch.Tensor):
            x = x[:, logits_to_keep]
        elif logits_to_keep:
            x = x[:, -logits_to_keep:]
        x = self.transformer.ln_f(x)
        # The untied head runs as a module: FSDP2 gathers a module's sharded weights only when the module is called.
        logits = F.linear(x, self.transformer.wte.weight) if self.config.weight_tying else self.transformer.ff_out(x)
        if self.config.scale_logits:
            logits = logits * (1.0 / self.config.d_model**0.5)
        return CausalLMOutputWithPast(logits=logits, past_key_values=new_cache if use_cache else None)


class LLaDAModelLM(LLaDAPreTrainedModel):
    """LLaDA for masked-diffusion language modelling; `forward` returns `CausalLMOutputWithPast` (see `LLaDAModel`).

    Registered for `AutoModel` and `AutoModelForCausalLM` (as the official `auto_map` does), so
    `AutoModelForCausalLM.from_pretrained("GSAI-ML/LLaDA-8B-Instruct")` needs no trust_remote_code.
    """

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.transformer.wte = value

    def get_output_embeddings(self) -> nn.Module | None:
        return None if self.config.weight_tying else self.model.transformer.ff_out

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: KeyValueCache | None = None,
        cache_position: torch.Tensor | None = None,
        use_cache: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        unexpected = {k for k, v in kwargs.items() if v is not None and k != "return_dict"}
        if unexpected:
            raise TypeError(f"LLaDAModelLM.forward got unsupported arguments: {sorted(unexpected)}")
        return self.model(input_ids, attention_mask, inputs_embeds, logits_to_keep, past_key_values, cache_position,
                          bool(use_cache))


def register_with_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel`/`AutoModelForCausalLM` resolve model_type "llada" to this implementation."""
    AutoConfig.register(LLaDAConfig.model_type, LLaDAConfig, exist_ok=True)
    AutoModel.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)
    AutoModelForCausalLM.register(LLaDAConfig, LLaDAModelLM, exist_ok=True)

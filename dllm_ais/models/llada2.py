"""Native LLaDA2.0 / LLaDA2.1: the mixture-of-experts block-diffusion transformer of inclusionAI/LLaDA2.0-mini,
-flash and LLaDA2.1-*, registered with transformers' Auto classes under model_type "llada2_moe" (the official
checkpoints' own type).

The module tree mirrors the official ``modeling_llada2_moe.py`` (class names too: `LLaDA2MoeModelLM` is the LM,
``architectures: ["LLaDA2MoeModelLM"]``; `LLaDA2MoeModel` the transformer under ``model``), except the routed experts,
which are stacked::

    model.word_embeddings                                  token embedding (padding_idx = pad_token_id)
    model.layers.{i}.input_layernorm                       RMSNorm
    model.layers.{i}.attention.query_key_value            fused q/k/v projection (bias iff use_qkv_bias)
    model.layers.{i}.attention.{query,key}_layernorm       RMSNorm over each head's head_dim features, before RoPE
                                                           (iff use_qk_norm)
    model.layers.{i}.attention.dense                       output projection (bias iff use_bias)
    model.layers.{i}.post_attention_layernorm              RMSNorm
    model.layers.{i}.mlp.{gate,up,down}_proj               layers i < first_k_dense_replace: dense SwiGLU
    model.layers.{i}.mlp.gate.weight / .expert_bias        the others: the router [E, d] and its selection bias [E]
    model.layers.{i}.mlp.experts.gate_up_proj              [E, 2 * moe_intermediate_size, d]: each expert's gate
                                                           rows, then its up rows
    model.layers.{i}.mlp.experts.down_proj                 [E, d, moe_intermediate_size]
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj   one SwiGLU of width moe_intermediate_size ×
                                                           num_shared_experts, on every token
    model.norm                                             final RMSNorm
    lm_head                                                LM head (tied to word_embeddings with tie_word_embeddings)

The official checkpoints store each routed expert as its own SwiGLU (``mlp.experts.{e}.{gate,up,down}_proj.weight``).
A checkpoint conversion registered with transformers (`register_with_auto_classes`) stacks them on load and splits
them again on save, so the Hub safetensors load unchanged and what we save has the official keys.

Attention: every query and key head RMS-normed (qk-norm), then RoPE on the first ``int(head_dim *
partial_rotary_factor)`` features of each head only (its own frequencies over that width: theta^(-2i/rope_dim)), the
rest passed through. The mask is block-causal, as SDAR's (`dllm_ais.models.sdar`): blocks of ``config.block_size``
positions counted from each row's first real token, bidirectional inside a block, causal across blocks, padded keys
hidden. The official forward builds no mask of its own: its ``generate`` passes this one (blocks from canvas index 0
of its one unpadded row; ``block_length`` 32 there, ``block_size`` here, a field the official config does not have).
The logits are not shifted: position i's logits predict the token at i. Key/value cache, 4-D training masks and
``logits_to_keep`` follow SDAR's forward exactly.

Router (`route`), as the official ``LLaDA2MoeGate`` computes it, per token, in float32: scores s = sigmoid(W_g x) [E];
the selection uses s + expert_bias only: experts are cut into ``n_group`` groups of consecutive ids, each group scored
by the sum of its two best biased scores, the ``topk_group`` best groups kept, and the ``num_experts_per_tok`` best
biased scores among their experts chosen. The chosen experts' weights are their UNBIASED scores s, divided by their
sum (+1e-20; with more than one expert per token) and multiplied by ``routed_scaling_factor``. The MoE output is
sum_k w_k · expert_k(x) (combined in float32, as the official code does) plus the shared experts' SwiGLU of x.

Routing replay (`dllm_ais.models.routing`): each MoE block's `routing_tape`, when set, sees the experts its router
selects and may hand back a recorded selection instead (the rollout engine's). The experts are then the recorded
ones and their weights this router's own unbiased scores at them, renormalised as above: the selection is discrete
and carries no gradient either way, while recomputed weights keep the router's gradient and the trainer's numerics
(rollout routing replay, R3, as autoregressive MoE RL does it); replayed weights would carry the engine's rounding
into the trainer and cut the router off from the loss.

Experts (`LLaDA2MoeExperts`): the (token, choice) pairs are sorted by expert and each expert's rows multiply its own
weights in one grouped matmul per projection (``torch.nn.functional.grouped_mm``: one kernel on CUDA, no loop over
experts in Python). Each expert's slice of the stacked weights is an ``nn.Linear`` weight [out, in]: an FP8 rollout
engine quantizes each expert's rows as it does a Linear's (per-row scales [E, out, 1]) and swaps the experts'
`grouped_mm` for one that quantizes the activation rows per row and runs the same sorted rows through
``torch._scaled_grouped_mm`` (`dllm_ais.quantization.quantize_stacked_experts_`); LoRA adapts the stacks through
peft's ``target_parameters`` (one adapter per expert). The router stays in float32 (a plain parameter, never a Linear
to quantize or a LoRA target unless named).

Differences from the official code, none of them on the logits of a forward: ``attention_dropout`` defaults to 0.0
(the official class says 0.1 and applies it in train mode; a config.json that sets it is followed); the logits keep
the model's dtype (the official LM casts them to float32); ``norm_head``, ``embedding_dropout``, ``output_dropout``,
``use_sliding_window``, ``sliding_window`` and ``max_window_layers`` are kept so configs round-trip and are unused, as
in the official code; no router logits or load-balancing loss are returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

# relative imports: an export ships these files as remote code
from .llada import RMSNorm, apply_rotary, unsupported_config_message, write_into_layer_cache
from .sdar import KeyValueCache, block_causal_hidden_states, kept_logits

__all__ = ["LLaDA2MoeConfig", "LLaDA2MoeExperts", "LLaDA2MoeModel", "LLaDA2MoeModelLM", "expert_weights",
           "grouped_expert_swiglu", "plain_grouped_mm", "route", "router_scores", "select_experts"]


@dataclass(repr=False)
class LLaDA2MoeConfig(PreTrainedConfig):
    """Configuration of a LLaDA2.x model, with the field names of the official ``configuration_llada2_moe.py``.

    Defaults are the values of LLaDA2.0-mini's config.json (16B total, 1.4B active: 20 layers, the first dense, 256
    experts in 8 groups, 8 chosen per token among the best 4 groups, one shared expert), with its generation's mask
    156895 and EOS 156892. `block_size` (ours) is the block of the attention mask: the official generation's default
    block_length 32. `mask_token_id` (ours) is the official generation's default mask_id. See the module docstring
    for `attention_dropout` and the fields kept unused.
    """

    model_type = "llada2_moe"

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int | None = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    use_qk_norm: bool = True
    use_bias: bool = False
    rms_norm_eps: float = 1e-6
    norm_head: bool = False
    tie_word_embeddings: bool = False
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    output_dropout: float = 0.0
    initializer_range: float = 0.02
    max_position_embeddings: int = 32768
    rope_theta: float = 600000.0
    use_cache: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    rope_scaling: dict | None = None
    num_experts: int | None = 256
    num_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    moe_intermediate_size: int | None = 512
    first_k_dense_replace: int = 1
    head_dim: int | None = 128
    output_router_logits: bool = False
    partial_rotary_factor: float = 0.5
    block_size: int = 32
    mask_token_id: int | None = 156895
    pad_token_id: int | None = 156892
    eos_token_id: int | None = 156892

    def __post_init__(self, **kwargs):
        if not self.num_key_value_heads:  # the official class's default 0: one key/value head per query head
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)

    @property
    def rope_dim(self) -> int:
        """The leading features of each head that RoPE rotates: int(head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` is a mixture of experts (the official rule: experts configured and index ≥
        first_k_dense_replace), not a dense SwiGLU."""
        return self.num_experts is not None and index >= self.first_k_dense_replace

    def check_supported(self) -> None:
        """Raise ValueError naming every config value this implementation does not support."""
        problems = []
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            problems.append(f"rope_scaling={self.rope_scaling!r} (supported: null)")
        if self.hidden_act not in ACT2FN:
            problems.append(f"hidden_act={self.hidden_act!r} is not a transformers activation")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_dim < 2 or self.rope_dim % 2:
            problems.append(f"partial_rotary_factor={self.partial_rotary_factor} gives {self.rope_dim} rotary "
                            f"features of head_dim={self.head_dim} (RoPE rotates pairs: an even number ≥ 2)")
        if self.block_size < 1:
            problems.append(f"block_size={self.block_size} (supported: 1 or more)")
        if self.num_experts is not None:
            problems.extend(self.expert_problems())
        if problems:
            raise ValueError(unsupported_config_message("LLaDA2", problems))

    def expert_problems(self) -> list[str]:
        """The routing and expert-shape values the router and the grouped matmul cannot take."""
        problems = []
        if self.n_group < 1 or self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            problems.append(f"n_group={self.n_group} must split num_experts={self.num_experts} into groups of 2 or "
                            "more experts (each group is scored by its two best)")
        elif not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group={self.topk_group} (supported: 1 to n_group={self.n_group})")
        elif not 1 <= self.num_experts_per_tok <= self.topk_group * (self.num_experts // self.n_group):
            problems.append(f"num_experts_per_tok={self.num_experts_per_tok} (supported: 1 to the "
                            f"{self.topk_group * (self.num_experts // self.n_group)} experts of topk_group groups)")
        for field in ("hidden_size", "moe_intermediate_size"):
            if (getattr(self, field) or 0) % 8:
                problems.append(f"{field}={getattr(self, field)} is not a multiple of 8 (the grouped expert matmul "
                                "needs 16-byte rows)")
        return problems


def router_scores(hidden: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """The unbiased router scores s = sigmoid(W_g x) [N, E], float32, of the tokens `hidden` [N, d]."""
    return F.linear(hidden.float(), router_weight.float()).sigmoid()


def select_experts(scores: torch.Tensor, expert_bias: torch.Tensor, top_k: int, n_group: int,
                   topk_group: int) -> torch.Tensor:
    """The experts [N, top_k] (long) the scores [N, E] select: group-limited top-k of s + `expert_bias` (module
    docstring)."""
    biased = scores + expert_bias
    grouped = biased.view(len(scores), n_group, -1)
    best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    kept = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter(1, best_groups, True)
    candidates = grouped.masked_fill(~kept[..., None], float("-inf")).flatten(1)
    return candidates.topk(top_k, dim=-1).indices


def expert_weights(scores: torch.Tensor, experts: torch.Tensor, routed_scaling_factor: float) -> torch.Tensor:
    """The weights [N, k] (float32) of the chosen `experts` [N, k]: their unbiased scores, divided by their sum
    (+1e-20; when k > 1), times `routed_scaling_factor`."""
    weights = scores.gather(1, experts)
    if experts.shape[1] > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor


def route(hidden: torch.Tensor, router_weight: torch.Tensor, expert_bias: torch.Tensor, top_k: int, n_group: int,
          topk_group: int, routed_scaling_factor: float, experts: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, top_k] long, weights [N, top_k] float32) of the tokens `hidden` [N, d] under the router
    `router_weight` [E, d] and its selection bias `expert_bias` [E] (the official LLaDA2 routing: module
    docstring). Given `experts` [N, top_k] (a replayed selection), those are the experts, weighted by this router's
    own scores."""
    scores = router_scores(hidden, router_weight)
    if experts is None:
        experts = select_experts(scores, expert_bias, top_k, n_group, topk_group)
    return experts, expert_weights(scores, experts, routed_scaling_factor)


def plain_grouped_mm(rows: torch.Tensor, stacked: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """rows [N, in] sorted by expert times their experts' weights: group g (rows group_ends[g-1]:group_ends[g]) by
    ``stacked[g].T`` ([E, out, in], each slice an ``nn.Linear`` weight), one ``grouped_mm`` → [N, out]."""
    return F.grouped_mm(rows, stacked.transpose(1, 2), offs=group_ends)


def grouped_expert_swiglu(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                          experts: torch.Tensor, weights: torch.Tensor, act_fn,
                          grouped_mm=plain_grouped_mm) -> torch.Tensor:
    """sum_k weights[n, k] · down_e(act(gate_e(x_n)) * up_e(x_n)) with e = experts[n, k], [N, d] in x's dtype, for
    tokens `x` [N, d], stacked experts `gate_up_proj` [E, 2I, d] (gate rows, then up rows) and `down_proj` [E, d, I].

    The N·top_k (token, choice) rows are sorted by expert, so each expert's rows are one contiguous group, and each
    projection is one `grouped_mm(rows, stacked, group_ends)` over the groups (`plain_grouped_mm`, or a quantized
    engine's); the combination runs in `weights`' dtype (float32)."""
    num_tokens, top_k = experts.shape
    choices = experts.flatten()
    order = choices.argsort(stable=True)
    group_ends = torch.bincount(choices, minlength=gate_up_proj.shape[0]).cumsum(0).to(torch.int32)
    rows = x[order // top_k]
    gate, up = grouped_mm(rows, gate_up_proj, group_ends).chunk(2, dim=-1)
    outputs = grouped_mm(act_fn(gate) * up, down_proj, group_ends)
    per_choice = torch.zeros_like(outputs).index_copy(0, order, outputs).view(num_tokens, top_k, -1)
    return (per_choice.to(weights.dtype) * weights[..., None]).sum(1).to(x.dtype)


class LLaDA2MoeMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) of width `intermediate_size`, without biases (the dense layers'
    MLP and the shared experts)."""

    def __init__(self, config: LLaDA2MoeConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LLaDA2MoeGate(nn.Module):
    """The router: `weight` [E, d] and the selection bias buffer `expert_bias` [E] (saved with the checkpoint);
    `forward` gives each token's experts and weights (`route`)."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def forward(self, hidden: torch.Tensor, experts: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [N, top_k], float32 weights [N, top_k]) of the tokens `hidden` [N, d] (`route`: the given
        `experts`, weighted by this router's scores, or its own selection)."""
        return route(hidden, self.weight, self.expert_bias, self.top_k, self.n_group, self.topk_group,
                     self.routed_scaling_factor, experts)

    def selection(self, scores: torch.Tensor) -> torch.Tensor:
        """The experts [N, top_k] this router selects from the scores [N, E] (`select_experts`)."""
        return select_experts(scores, self.expert_bias, self.top_k, self.n_group, self.topk_group)


class LLaDA2MoeExperts(nn.Module):
    """The routed experts, stacked: `gate_up_proj` [E, 2I, d] and `down_proj` [E, d, I] (`grouped_expert_swiglu`).
    `grouped_mm` is the grouped matmul they run through: `plain_grouped_mm`, or the one a quantized rollout engine
    sets beside the quantized stacks it puts in their place (`dllm_ais.quantization.quantize_stacked_experts_`)."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        width = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * width, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, width))
        self.act_fn = ACT2FN[config.hidden_act]
        self.grouped_mm = plain_grouped_mm

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return grouped_expert_swiglu(x, self.gate_up_proj, self.down_proj, experts, weights, self.act_fn,
                                     self.grouped_mm)


class LLaDA2MoeSparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP: the routed experts' weighted sum plus the shared experts (when configured).

    `routing_tape` (None outside `dllm_ais.models.routing`'s contexts) sees each forward's selection, and may replace
    it by a recorded one; the weights are always this router's own scores at the experts used."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.gate = LLaDA2MoeGate(config)
        self.experts = LLaDA2MoeExperts(config)
        self.shared_experts = (LLaDA2MoeMLP(config, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)
        self.routing_tape = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        if self.routing_tape is None:
            experts, weights = self.gate(tokens)
        else:
            scores = router_scores(tokens, self.gate.weight)
            experts = self.routing_tape.route(self.gate.selection(scores))
            weights = expert_weights(scores, experts, self.gate.routed_scaling_factor)
        routed = self.experts(tokens, experts, weights).view_as(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


class LLaDA2MoeAttention(nn.Module):
    """Grouped-query SDPA attention from one fused q/k/v projection, qk-norm and partial RoPE (module docstring)."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                        config.head_dim)
        self.attention_dropout = config.attention_dropout
        self.query_key_value = nn.Linear(config.hidden_size, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim,
                                         bias=config.use_qkv_bias)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.dense = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        layer_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache_position: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, n, d], cos/sin [B, 1, n, rope_dim] in x's dtype, attn_mask bool [B or 1, 1, n, T] (True = attended)
        → ([B, n, d], (keys, values) [B, n_kv_heads, T, head_dim] attended to); the cache as
        `dllm_ais.models.dream.DreamAttention.forward`."""
        batch, length, _ = x.shape
        qkv = self.query_key_value(x).view(batch, length, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = partial_rotary(q.transpose(1, 2), cos, sin), partial_rotary(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if layer_cache is not None:
            k, v = write_into_layer_cache(layer_cache, cache_position, k, v)
        attn = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=attn_mask, is_causal=False,
            dropout_p=self.attention_dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.dense(attn.transpose(1, 2).reshape(batch, length, -1)), (k, v)


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (`apply_rotary`) on the first cos.shape[-1] features of x's last dim; the others unchanged."""
    rope_dim = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :rope_dim], cos, sin), x[..., rope_dim:]), dim=-1)


class LLaDA2MoeDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)); the mlp dense or a mixture of experts
    (`LLaDA2MoeConfig.is_moe_layer`)."""

    def __init__(self, config: LLaDA2MoeConfig, index: int):
        super().__init__()
        self.attention = LLaDA2MoeAttention(config)
        self.mlp = (LLaDA2MoeSparseMoeBlock(config) if config.is_moe_layer(index)
                    else LLaDA2MoeMLP(config, config.intermediate_size))
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
        """(output [B, n, d], (keys, values) attended to); see `LLaDA2MoeAttention.forward` for the cache."""
        attn, key_values = self.attention(self.input_layernorm(x), cos, sin, attn_mask, layer_cache, cache_position)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), key_values


class LLaDA2MoePreTrainedModel(PreTrainedModel):
    """Weights initialised as the official code does: normal(0, initializer_range) Linear and Embedding weights and
    routed experts, zero biases, the padding embedding row zeroed, RMSNorm weights 1, the router kaiming-uniform
    (a = √5) and its expert bias 0 (none of it over weights a checkpoint loaded)."""

    config_class = LLaDA2MoeConfig
    config: LLaDA2MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LLaDA2MoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, LLaDA2MoeGate):
            init.kaiming_uniform_(module.weight, a=5**0.5)
            init.zeros_(module.expert_bias)


class LLaDA2MoeModel(LLaDA2MoePreTrainedModel):
    """The LLaDA2 transformer (the official `LLaDA2MoeModel`): final-normed hidden states (and, on request, the
    layers' keys/values) as a `BaseModelOutputWithPast`."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        config.check_supported()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(LLaDA2MoeDecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.word_embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: KeyValueCache | None = None,
        cache_position: torch.Tensor | None = None,
        use_cache: bool = False,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Hidden states [B, n, d] of the n inputs (and the layers' (keys, values) with `use_cache`); the mask, the
        positions and the cache as `dllm_ais.models.sdar.SDARForCausalLM.forward`."""
        return block_causal_hidden_states(self, self.word_embeddings, self.config.rope_dim, input_ids, attention_mask,
                                          position_ids, inputs_embeds, past_key_values, cache_position, use_cache,
                                          kwargs)


class LLaDA2MoeModelLM(LLaDA2MoePreTrainedModel):
    """LLaDA2 for block-diffusion language modelling (the official `LLaDA2MoeModelLM`: transformer + LM head);
    `forward` returns `CausalLMOutputWithPast` with unshifted logits.

    Registered for `AutoModelForCausalLM` (and `LLaDA2MoeModel` for `AutoModel`, as the official `auto_map` has
    them), so `AutoModelForCausalLM.from_pretrained("inclusionAI/LLaDA2.0-mini")` needs no trust_remote_code.
    """

    _tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.model = LLaDA2MoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.word_embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

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

        The block-causal mask over blocks of `config.block_size` position ids, a 2-D `attention_mask` (1 = real
        token) hiding padded keys, a 4-D bool one used as the mask itself, the default positions (a left-padded row's
        real tokens numbered from 0) and the cache are those of `dllm_ais.models.sdar.SDARForCausalLM.forward`.
        """
        output = self.model(input_ids, attention_mask, position_ids, inputs_embeds, past_key_values, cache_position,
                            bool(use_cache), **kwargs)
        return kept_logits(self.lm_head, output, logits_to_keep)


def official_expert_conversions() -> list[WeightConverter]:
    """The checkpoint conversion between the official per-expert keys (``mlp.experts.{e}.{gate,up,down}_proj.weight``)
    and the stacked `LLaDA2MoeExperts` parameters (transformers reverses it on save)."""
    return [
        WeightConverter(source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                        target_patterns="mlp.experts.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter(source_patterns="mlp.experts.*.down_proj.weight", target_patterns="mlp.experts.down_proj",
                        operations=[MergeModulelist(dim=0)]),
    ]


def register_with_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel`/`AutoModelForCausalLM` resolve model_type "llada2_moe" to this implementation
    (the official checkpoints' expert layout is converted on load and save however the class is reached: below)."""
    AutoConfig.register(LLaDA2MoeConfig.model_type, LLaDA2MoeConfig, exist_ok=True)
    AutoModel.register(LLaDA2MoeConfig, LLaDA2MoeModel, exist_ok=True)
    AutoModelForCausalLM.register(LLaDA2MoeConfig, LLaDA2MoeModelLM, exist_ok=True)


# At import, not in `register_with_auto_classes`: an export ships this file as remote code, which transformers imports
# without dllm_ais, and without the conversion it would leave the stacked experts at their initial values.
register_checkpoint_conversion_mapping(LLaDA2MoeConfig.model_type, official_expert_conversions(), overwrite=True)

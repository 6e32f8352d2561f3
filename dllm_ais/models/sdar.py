"""Native SDAR: the block-diffusion transformer of JetLM/SDAR-{1.7B,4B,8B}-Chat (continued from Qwen3), registered
with transformers' Auto classes under model_type "sdar" (the official checkpoints' own type).

SDAR is Qwen3 with a block-causal attention mask. The module tree mirrors the official ``modeling_sdar.py`` so the
Hub safetensors load unchanged and what we save loads in the official code::

    model.embed_tokens                               token embedding (padding_idx = pad_token_id)
    model.layers.{i}.input_layernorm                 RMSNorm
    model.layers.{i}.self_attn.{q,k,v,o}_proj        biases iff attention_bias
    model.layers.{i}.self_attn.{q,k}_norm            RMSNorm over each head's head_dim features, before RoPE
    model.layers.{i}.post_attention_layernorm        RMSNorm
    model.layers.{i}.mlp.{gate,up,down}_proj         SwiGLU: down(act(gate(x)) * up(x)), no biases
    model.norm                                       final RMSNorm
    lm_head                                          LM head (tied to embed_tokens with tie_word_embeddings)

The class names are the official ones: `SDARForCausalLM` is the LM (``architectures: ["SDARForCausalLM"]``),
`SDARModel` the transformer under ``model`` (what the official ``auto_map`` gives AutoModel).

Attention: the tokens are cut into blocks of ``config.block_size`` positions counted from the first real token
(block of a token = its position id // block_size); a query attends to every real key whose block is not after its
own — bidirectional inside a block, causal across blocks. That is the mask the official ``generate.py`` passes
(``tril`` over blocks, blocks from canvas index 0 of an unpadded prompt; the official forward builds none itself at
inference). The logits are not shifted: the logits at position i predict the token at i (the official generation
reads a masked position's proposal there, and its training loss pairs each noisy position's hidden state with its
own label).

Key/value cache, with the interface of dllm_ais' LLaDA and Dream: a forward with ``use_cache=True`` returns every
layer's keys (RoPE applied) and values at every position, ``past_key_values`` = one ``(keys, values)`` pair of
[B, num_key_value_heads, T, head_dim] tensors per layer. A later forward may run on a subset of the T canvas
positions: ``input_ids`` [B, n] are the tokens at canvas positions ``cache_position`` [n]; their keys and values are
written into the cache there (in place; into a copy under grad) and their queries attend to the cached positions
their blocks allow. Because a block's keys/values depend on that block and the blocks before it only, the cache of
finished blocks is exact: once a block's tokens are final and a forward has written their keys/values (the official
generation stores them by one forward of the clean block), a forward of a later block against the cache gives the
logits of the full forward.

Training-mode forward (`block_diffusion_logits`): the block-diffusion objective scores each noisy block against the
CLEAN blocks before it, which one block-causal forward of a canvas with masks in several blocks does not do (a block
would see the noise of the blocks before it). The official training doubles the input, [x_t | x_0], under a mask in
which a noisy block attends to itself (both directions) and to the clean blocks before it, and a clean block to the
clean blocks up to itself; x_0 takes the positions of x_t again. Here that is a mask and positions
(`block_diffusion_inputs`) passed to the ordinary forward (a 4-D ``attention_mask`` is used as the mask itself), so
a wrapped model (DDP, FSDP, LoRA) runs it as any forward; it equals, block by block, a forward of the noisy block
against the cache of the clean blocks before it (tests/test_sdar_likelihood.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .dream import (  # relative: an export ships these files as remote code
    DreamAttention,
    DreamDecoderLayer,
    LanguageModelEmbeddings,
    canvas_positions,
    run_layers,
)
from .families import position_logits
from .llada import RMSNorm, rotary_cos_sin, unsupported_config_message

__all__ = ["SDARConfig", "SDARForCausalLM", "SDARModel", "block_causal_mask", "block_diffusion_inputs",
           "block_diffusion_logits", "block_size_of", "canvas_blocks", "canvas_position_ids"]

KeyValueCache = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, (keys, values) of shape [B, num_key_value_heads, T, head_dim]; the keys have RoPE applied."""


@dataclass(repr=False)
class SDARConfig(PreTrainedConfig):
    """Configuration of an SDAR model, with the field names of the official ``configuration_sdar.py`` and
    config.json.

    Defaults are the values of SDAR-4B-Chat's config.json (Qwen3-4B's shape: head_dim 128 with hidden_size 2560 and
    32 heads; mask 151669 ``<|MASK|>``, block_size 4). `block_size` is the block of the attention mask and of
    training; `fuse_cross_entropy` (the official training loss kernel) and `max_window_layers` are kept so configs
    round-trip. Sliding windows and RoPE scaling are rejected at model construction with a message naming the field.
    """

    model_type = "sdar"

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = False
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 36
    attention_dropout: float = 0.0
    block_size: int = 4
    fuse_cross_entropy: bool = True
    mask_token_id: int | None = 151669
    pad_token_id: int | None = None
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151643

    def __post_init__(self, **kwargs):
        # The official config.json asks for "flex_attention", the official training kernel; this model always
        # attends through SDPA under its block-causal mask, and transformers would refuse to build it on that request.
        kwargs.pop("attn_implementation", None)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)

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
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} is odd (RoPE rotates pairs)")
        if self.block_size < 1:
            problems.append(f"block_size={self.block_size} (supported: 1 or more)")
        if problems:
            raise ValueError(unsupported_config_message("SDAR", problems))


def block_causal_mask(query_position_ids: torch.Tensor, key_position_ids: torch.Tensor, block_size: int,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B or 1, 1, n, T] bool (True = attended): query i sees key j iff j's block (position id // `block_size`) is
    not after i's and j is a real token (1 in `attention_mask` [B, T], when given). Built from tensors only: no
    host synchronisation inside a forward."""
    query_blocks = torch.div(query_position_ids, block_size, rounding_mode="floor")
    key_blocks = torch.div(key_position_ids, block_size, rounding_mode="floor")
    allowed = key_blocks[:, None, None, :] <= query_blocks[:, None, :, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    return allowed


def block_size_of(model: object) -> int:
    """``config.block_size`` of a block-causal model, or of the model a wrapper (DDP, FSDP, torch.compile) holds."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        block_size = getattr(getattr(candidate, "config", None), "block_size", None)
        if block_size is not None:
            return block_size
    raise ValueError(f"{type(model).__name__} has no config.block_size: pass an SDAR model (model_type 'sdar').")


def canvas_position_ids(attention_mask: torch.Tensor | None, length: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The position ids of a canvas as the forward numbers them, [B, length] (or [1, length] without
    `attention_mask`): real tokens from 0 in each row, padding 0."""
    if attention_mask is None:
        return torch.arange(length, device=device)[None]
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def canvas_blocks(attention_mask: torch.Tensor | None, length: int, block_size: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The block of each canvas position, [B, length] (or [1, length] without `attention_mask`): its position id
    (`canvas_position_ids`) // `block_size`."""
    return torch.div(canvas_position_ids(attention_mask, length, device), block_size, rounding_mode="floor")


def block_diffusion_inputs(noisy_ids: torch.Tensor, clean_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training-mode forward's inputs for noisy canvases `noisy_ids` [B, T] and their clean versions `clean_ids`
    [B, T] (`attention_mask` [B, T]: 1 = real token; None = none padded): (input_ids [B, 2T] = [x_t | x_0],
    position_ids [B, 2T] = the canvas's position ids twice, attention mask [B or 1, 1, 2T, 2T] bool, True =
    attended).

    With blocks by position id // `block_size`: a noisy query of block b attends to the noisy keys of block b and to
    the clean keys of the blocks before b; a clean query of block b to the clean keys of blocks up to b; padded keys
    to none."""
    if noisy_ids.shape != clean_ids.shape or noisy_ids.dim() != 2:
        raise ValueError(f"noisy_ids and clean_ids must be two [B, T] canvases of one shape; got "
                         f"{tuple(noisy_ids.shape)} and {tuple(clean_ids.shape)}")
    length = noisy_ids.shape[1]
    position_ids = canvas_position_ids(attention_mask, length, noisy_ids.device)
    blocks = torch.div(position_ids, block_size, rounding_mode="floor").repeat(1, 2)  # [B or 1, 2T]
    real = (torch.ones(1, length, dtype=torch.bool, device=noisy_ids.device) if attention_mask is None
            else attention_mask.bool()).repeat(1, 2)
    clean = torch.arange(2 * length, device=noisy_ids.device) >= length  # [2T]: the x_0 half
    query_blocks, key_blocks = blocks[:, :, None], blocks[:, None, :]
    noisy_to_noisy = ~clean[:, None] & ~clean[None, :] & (key_blocks == query_blocks)
    to_clean_before = ~clean[:, None] & clean[None, :] & (key_blocks < query_blocks)
    clean_to_clean = clean[:, None] & clean[None, :] & (key_blocks <= query_blocks)
    allowed = (noisy_to_noisy | to_clean_before | clean_to_clean) & real[:, None, :]
    input_ids = torch.cat([noisy_ids, clean_ids], dim=1)
    return input_ids, position_ids.repeat(1, 2).expand(len(input_ids), -1), allowed[:, None]


def block_diffusion_logits(model: nn.Module, noisy_ids: torch.Tensor, clean_ids: torch.Tensor,
                           attention_mask: torch.Tensor | None, logits_to_keep: torch.Tensor | int = 0
                           ) -> torch.Tensor:
    """The block-diffusion training-mode forward: logits [B, K, V] at the kept positions of the noisy canvases
    `noisy_ids` [B, T] (all, `logits_to_keep` = 0; the last ones, an int; the canvas positions of a 1-D tensor),
    each block computed against the clean blocks of `clean_ids` [B, T] before it — one forward of the doubled canvas
    `block_diffusion_inputs` builds, through `model` itself (any wrapper: DDP, FSDP, LoRA)."""
    length = noisy_ids.shape[1]
    if not isinstance(logits_to_keep, torch.Tensor):
        logits_to_keep = torch.arange(length - logits_to_keep if logits_to_keep else 0, length,
                                      device=noisy_ids.device)
    input_ids, position_ids, mask = block_diffusion_inputs(noisy_ids, clean_ids, attention_mask,
                                                           block_size_of(model))
    return position_logits(model, input_ids, mask, logits_to_keep, shifted=False, position_ids=position_ids)


class SDARDecoderLayer(DreamDecoderLayer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); Qwen3's attention (each query and key head RMS-normed
    before RoPE, biases iff ``attention_bias``) under the block-causal mask."""

    def __init__(self, config: SDARConfig):
        bias = config.attention_bias
        super().__init__(config, DreamAttention(config, qkv_bias=bias, output_bias=bias, qk_norm=True))


class SDARPreTrainedModel(PreTrainedModel):
    """Weights are initialised by transformers' default `_init_weights`, which is the official SDAR one: normal(0,
    initializer_range) Linear and Embedding weights, zero biases, the padding embedding row zeroed, RMSNorm weights 1
    (and none of it over weights a checkpoint loaded)."""

    config_class = SDARConfig
    config: SDARConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SDARDecoderLayer"]
    _supports_sdpa = True


def check_given_mask(attention_mask: torch.Tensor, inputs: torch.Tensor, position_ids: torch.Tensor | None,
                     past_key_values: KeyValueCache | None) -> None:
    """Raise ValueError unless a 4-D `attention_mask` (the mask itself, [B or 1, 1, n, n]) comes with the inputs'
    `position_ids` [B, n] and without a cache."""
    batch, length = inputs.shape[:2]
    problems = []
    if attention_mask.shape[1:] != (1, length, length) or attention_mask.shape[0] not in (1, batch):
        problems.append(f"a 4-D attention_mask must be [B or 1, 1, {length}, {length}]; got "
                        f"{tuple(attention_mask.shape)}")
    if position_ids is None or position_ids.shape != (batch, length):
        problems.append(f"a 4-D attention_mask needs position_ids [{batch}, {length}]")
    if past_key_values is not None:
        problems.append("a 4-D attention_mask is for a forward without past_key_values")
    if problems:
        raise ValueError("; ".join(problems) + " (see dllm_ais.models.sdar.block_diffusion_inputs).")


class SDARModel(SDARPreTrainedModel):
    """The SDAR transformer (the official `SDARModel`): final-normed hidden states (and, on request, the layers'
    keys/values) as a `BaseModelOutputWithPast`."""

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        config.check_supported()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(SDARDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

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
        """Hidden states [B, n, d] of the n inputs (and the layers' (keys, values) with `use_cache`); see
        `SDARForCausalLM.forward` for the mask, the positions and the cache."""
        return block_causal_hidden_states(self, self.embed_tokens, self.config.head_dim, input_ids, attention_mask,
                                          position_ids, inputs_embeds, past_key_values, cache_position, use_cache,
                                          kwargs)


def block_causal_hidden_states(transformer: nn.Module, embeddings: nn.Embedding, rope_dim: int,
                               input_ids: torch.LongTensor | None, attention_mask: torch.Tensor | None,
                               position_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor | None,
                               past_key_values: KeyValueCache | None, cache_position: torch.Tensor | None,
                               use_cache: bool, unsupported: dict) -> BaseModelOutputWithPast:
    """The forward of a block-causal transformer (SDAR's, LLaDA2's): `transformer`'s `layers` (each called as a
    `DreamDecoderLayer`) and final `norm` over the inputs embedded by `embeddings`, RoPE on the first `rope_dim`
    features of each head, under the block-causal mask of `transformer.config.block_size` (or a given 4-D mask), with
    the positions and the cache of `SDARForCausalLM.forward`. TypeError naming any `unsupported` argument passed."""
    unexpected = {k for k, v in unsupported.items() if v is not None and k != "return_dict"}
    if unexpected:
        raise TypeError(f"{type(transformer).__name__}.forward got unsupported arguments: {sorted(unexpected)} "
                        "(supported: input_ids, attention_mask, position_ids, inputs_embeds, logits_to_keep "
                        "(the LM), past_key_values, cache_position, use_cache, return_dict)")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
    config, layers = transformer.config, transformer.layers
    x = embeddings(input_ids) if inputs_embeds is None else inputs_embeds
    if attention_mask is not None and attention_mask.dim() == 4:
        check_given_mask(attention_mask, x, position_ids, past_key_values)
        first_layer, attn_mask = None, attention_mask.bool()
    else:
        first_layer, cache_position, position_ids, key_position_ids = canvas_positions(
            x, attention_mask, position_ids, past_key_values, cache_position, len(layers),
            config.max_position_embeddings)
        attn_mask = block_causal_mask(position_ids, key_position_ids, config.block_size, attention_mask)
    cos, sin = rotary_cos_sin(position_ids, rope_dim, config.rope_theta)
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    x, new_cache = run_layers(layers, x, cos, sin, attn_mask, past_key_values, first_layer, cache_position, use_cache)
    return BaseModelOutputWithPast(last_hidden_state=transformer.norm(x), past_key_values=new_cache)


def kept_logits(lm_head: nn.Module, output: BaseModelOutputWithPast,
                logits_to_keep: int | torch.Tensor) -> CausalLMOutputWithPast:
    """`lm_head`'s logits of the hidden states `output` holds: all positions (`logits_to_keep` = 0), the last
    `logits_to_keep` (an int), or those at the indices `logits_to_keep` (a 1-D tensor); its cache passed on."""
    x = output.last_hidden_state
    if isinstance(logits_to_keep, torch.Tensor):
        x = x[:, logits_to_keep]
    elif logits_to_keep:
        x = x[:, -logits_to_keep:]
    return CausalLMOutputWithPast(logits=lm_head(x), past_key_values=output.past_key_values)


class SDARForCausalLM(LanguageModelEmbeddings, SDARPreTrainedModel):
    """SDAR for block-diffusion language modelling (the official `SDARForCausalLM`: transformer + LM head);
    `forward` returns `CausalLMOutputWithPast` with unshifted logits.

    Registered for `AutoModelForCausalLM` (and `SDARModel` for `AutoModel`, as the official `auto_map` has them), so
    `AutoModelForCausalLM.from_pretrained("JetLM/SDAR-4B-Chat")` needs no trust_remote_code.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        self.model = SDARModel(config)
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

        Attention is block-causal over blocks of `config.block_size` position ids (module docstring);
        `attention_mask` (1 = real token, 0 = padding) hides padded keys besides. It covers the inputs [B, n], or
        with `past_key_values` every cached position [B, T]. A 4-D bool `attention_mask` [B or 1, 1, n, n] (True =
        attended) is the mask itself, with explicit `position_ids` and no cache: the training-mode forward's
        (`block_diffusion_inputs`). `position_ids` [B, n] (RoPE and the queries' blocks)
        default to the real tokens numbered from 0 in each row (cumsum(attention_mask) - 1 over the whole canvas,
        read at `cache_position` with a cache), or the inputs' canvas positions `cache_position` (default 0..n-1)
        without a mask; so a left-padded row's real tokens get the logits they would get unpadded. The cached keys'
        blocks follow the same numbering over the canvas.

        `past_key_values` (from a forward with `use_cache=True` over the whole canvas: per layer (keys, values)
        [B, num_key_value_heads, T, head_dim], keys with RoPE; or any sequence of such pairs, e.g. an
        `FP8KeyValueCache`) is written at `cache_position` [n] (the inputs' canvas indices; in place, into a copy
        under grad) and attended to under the block-causal mask. `use_cache=True` returns the layers' (keys, values)
        in the output's `past_key_values` (the updated cache with `past_key_values`, a new one without).
        """
        output = self.model(input_ids, attention_mask, position_ids, inputs_embeds, past_key_values, cache_position,
                            bool(use_cache), **kwargs)
        return kept_logits(self.lm_head, output, logits_to_keep)


def register_with_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel`/`AutoModelForCausalLM` resolve model_type "sdar" to this implementation."""
    AutoConfig.register(SDARConfig.model_type, SDARConfig, exist_ok=True)
    AutoModel.register(SDARConfig, SDARModel, exist_ok=True)
    AutoModelForCausalLM.register(SDARConfig, SDARForCausalLM, exist_ok=True)

"""What differs between the model families, one `ModelFamily` record each (`FAMILIES`), looked up by model_type
(`family_of`; `find_family` for a model_type that may be another causal LM of transformers). The sampler, the
likelihood estimators, SFT, the LoRA presets, export, evaluation's protocols, the Auto-class registration and the dry
run's name hints read these records (the dry run's tiny stand-in models are still built per family there).

=========  ================  ==========  ====================  ===================  =========  =================
family     model_type        policy      attention             logits predicting i  mask id    own protocol
=========  ================  ==========  ====================  ===================  =========  =================
LLaDA      ``llada``         diffusion   bidirectional         position i           126336     d1 (its sampler)
Dream      ``Dream``         diffusion   bidirectional         position i - 1       151666     dream
SDAR       ``sdar``          diffusion   block-causal (4)      position i           151669     sdar
LLaDA2.x   ``llada2_moe``    diffusion   block-causal (32)     position i           156895     llada2
Qwen3      ``qwen3`` (and    autoregr.   causal                position i - 1       none       none
           qwen2, llama)
=========  ================  ==========  ====================  ===================  =========  =================

The mask id is the released checkpoints' (each config.json's ``mask_token_id``, which wins); a block-causal
family's block size is its config's ``block_size`` (the default in brackets; the official LLaDA2 config has no such
field: 32 is its generation's default block_length).

Dream (and DiffuCoder, same architecture) was initialised from an autoregressive Qwen2.5 and keeps its next-token
head: the logits at position i - 1 predict the token at i; position 0, which has no predecessor, keeps its own (the
official generation code: ``cat([logits[:, :1], logits[:, :-1]], 1)``). Every place that turns a forward into
per-position logits goes through `position_logits` (or, where it already holds a forward's logits, the same index
map `logit_source_positions`), so the shift is written once.

Block-causal families (SDAR, LLaDA2.x: attention causal across blocks of ``block_size`` positions counted from the
first real token, bidirectional inside one): the sampler decodes them block by block along each row's own blocks,
against the exact cache of the finished blocks (`dllm_ais.sampling.diffusion`, "Block-causal models"), and every
likelihood estimator scores each of their blocks against the clean blocks before it (the training-mode forward,
`dllm_ais.models.sdar.block_diffusion_logits`). A position sees the later positions of its own block, so such a
model is never scored as a causal LM (`policy.is_diffusion` refuses ``policy: autoregressive`` for it).

How each family's own decoder, as this library runs it, differs from its official code (`dllm-ais eval --protocol`):

- LLaDA (d1's protocol, LLaDA's ``generate``): none on the tokens; `tests/test_llada.py` holds the parity check.
- Dream (``diffusion_generate``): the protocol is greedy; Dream's published runs sample at temperature 0.1 with
  top-p 0.9. Its ``alg_temp`` is `experimental.rollout_position_temperature`, used by no recipe yet.
- SDAR (JetAstra/SDAR ``generate.py``): threshold 0.9 (its README's engines) where ``generate.py`` defaults to 0.85;
  and when a step's quota exceeds the masks left in the block (only with fewer denoising steps than the block
  length), ``generate.py`` rewrites positions already filled, prompt tokens too, where ours caps the quota at the
  masks left.
- LLaDA2.0 (``generate`` of the official modeling_llada2_moe.py): `decoding_protocols.llada2_generate_settings`
  maps its arguments to the sampler's settings, whose greedy tokens are the official ones, batched
  (`tests/test_llada2_sampling.py`: a grid of its settings, with and without the cache). Its temperature 0 is not
  greedy: its draw samples softmax(logits) by ``torch.multinomial`` (it divides by τ only when τ > 0 and takes no
  argmax), so the parity check runs it with the draw replaced by the argmax and its probability, the sampler's
  τ = 0. At τ > 0 the sampler draws by Gumbel-max from the caller's generator (the same distribution, other draws),
  and with both top_k and top_p it keeps the nucleus first, then its top k, where ``generate`` keeps the top k,
  then their nucleus. ``eos_early_stop`` returns within the block (prompt included), the sampler's stop comes at
  the block's end: the same completion. A row whose last block ends before the batch's decodes its next block past
  its end (outside its completion). An EOS id inside a prompt: ``generate``'s early stop would cut the prompt there,
  the sampler reads completions only. The ``llada2`` protocol (the model's blocks, a step per position, threshold
  0.95 as ``generate`` defaults) runs on the rollout settings, which have no ``completion_length`` or
  ``stop_at_eos``: its last block is cut at gen_length (the sampler's default) and it decodes on after EOS.
- LLaDA2.1 (its ``generate`` with token editing; source: the copy the dllm project vendors,
  ``dllm/pipelines/llada21/models/modeling_llada21_moe.py``, the Hub file not in hand):
  `decoding_protocols.llada21_generate_settings` maps its arguments; greedy tokens equal the official ones, batched,
  with and without the cache (`tests/test_llada21_sampling.py`: a grid over thresholds, editing thresholds and
  post steps, most of its rows edited). Its ``generate`` hands the forward a 0/1 block mask in bfloat16, which that
  forward adds to the attention scores (a soft mask: the next blocks attended at e⁻¹ of the weight); the parity
  check and the sampler use the block-causal mask the model was trained with. Its loop runs on while masks remain,
  so a draw of the mask id (committed or written by an edit) can keep a block going forever; the sampler writes it
  and commits the position again as ``generate`` does, but ends a block after
  `sampling.diffusion.editing.editing_step_limit` steps. ``num_to_transfer`` must divide the block length (the even
  schedule's counts).

A new family: its model module under ``dllm_ais/models/`` (with ``register_with_auto_classes``), its record in
`FAMILIES`, its tests (`tests/test_families.py` checks every record against its module); plus, with a decoding
protocol of its own, that protocol's name in `dllm_ais.choices.EVAL_PROTOCOLS` (a test checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

NO_SETTINGS: Mapping[str, Any] = MappingProxyType({})
QWEN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelFamily:
    """What one model family is to this library.

    `model_types`: its config.json ``model_type`` values. `module`: its implementation, ``dllm_ais.models.<module>``
    (None: transformers' own classes). `policy`: ``diffusion`` or ``autoregressive``, what ``policy: auto`` trains
    it with. `attention`: ``bidirectional``, ``block-causal`` (blocks of the config's ``block_size``, from each row's
    first real token) or ``causal``. `shifted_logits`: whether the logits at position i - 1 predict the token at i
    (a diffusion family; `position_logits`). `mask_token_id`: the released checkpoints' mask token (the config class's
    default). `lora_targets`: the LoRA preset (module names, or a regex; None: no preset), `lora_target_parameters`
    the parameters LoRA adapts directly (peft's ``target_parameters``, by name suffix: stacked experts).
    `exported_files`: the files an export writes so that transformers alone loads it (exported name -> module under
    ``dllm_ais/models``) and `auto_map` the config.json entry naming them. `protocol`: its own decoder as a ``dllm-ais eval --protocol`` name
    (None: none yet), `protocol_rollout` that decoder's rollout settings over d1's, `protocol_blocks` its block length
    (``completion``: the whole completion; ``block_size``: the model's blocks), one step per token either way.
    `eval_protocol`: what ``dllm-ais eval`` decodes it with by default. `converts_from`: the causal model_types
    ``dllm-ais sft --as_block_diffusion`` turns into this family. `name_hints`: words of a model name (any case)
    that the dry run takes for this family when no config.json is reachable (the longest one a name contains wins:
    "llada2" over LLaDA's "llada").
    """

    name: str
    model_types: tuple[str, ...]
    module: str | None
    policy: str
    attention: str
    shifted_logits: bool = False
    mask_token_id: int | None = None
    lora_targets: str | tuple[str, ...] | None = None
    lora_target_parameters: tuple[str, ...] = ()
    exported_files: Mapping[str, str] = field(default_factory=lambda: NO_SETTINGS)
    auto_map: Mapping[str, str] = field(default_factory=lambda: NO_SETTINGS)
    protocol: str | None = None
    protocol_rollout: Mapping[str, Any] = field(default_factory=lambda: NO_SETTINGS)
    protocol_blocks: str | None = None
    eval_protocol: str = "d1"
    converts_from: tuple[str, ...] = ()
    name_hints: tuple[str, ...] = ()

    @property
    def is_diffusion(self) -> bool:
        return self.policy == "diffusion"

    @property
    def block_causal(self) -> bool:
        return self.attention == "block-causal"


def _auto_map(module: str, config: str, model: str, causal_lm: str | None = None) -> Mapping[str, str]:
    """The config.json ``auto_map`` of an export whose classes are in ``<module>.py``."""
    return MappingProxyType({"AutoConfig": f"{module}.{config}", "AutoModel": f"{module}.{model}",
                             "AutoModelForCausalLM": f"{module}.{causal_lm or model}"})


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "LLaDA", ("llada",), "llada", "diffusion", "bidirectional", mask_token_id=126336,
        # `ff_out` names both each block's down-projection and LLaDA's LM head: the regex pins it to blocks.N.
        lora_targets=r".*\.blocks\.\d+\.(q_proj|k_proj|v_proj|attn_out|ff_proj|up_proj|ff_out)",
        exported_files=MappingProxyType({"modeling_llada.py": "llada"}),
        auto_map=_auto_map("modeling_llada", "LLaDAConfig", "LLaDAModelLM"),
        protocol="d1", name_hints=("llada",)),
    ModelFamily(
        "Dream", ("Dream",), "dream", "diffusion", "bidirectional", shifted_logits=True, mask_token_id=151666,
        lora_targets=QWEN_LINEARS,
        exported_files=MappingProxyType({"modeling_dream.py": "dream", "llada.py": "llada"}),
        auto_map=_auto_map("modeling_dream", "DreamConfig", "DreamModel"),
        protocol="dream", protocol_rollout=MappingProxyType({"remasking": "entropy", "schedule": "time_linear"}),
        protocol_blocks="completion", name_hints=("dream", "diffucoder")),
    ModelFamily(
        # The official SDAR checkpoints ship JetLM's configuration_sdar.py and modeling_sdar.py; an export ships
        # ours instead (the same module tree and config fields) under the official file name.
        "SDAR", ("sdar",), "sdar", "diffusion", "block-causal", mask_token_id=151669, lora_targets=QWEN_LINEARS,
        exported_files=MappingProxyType({"modeling_sdar.py": "sdar", "dream.py": "dream", "llada.py": "llada",
                                         "families.py": "families"}),
        auto_map=_auto_map("modeling_sdar", "SDARConfig", "SDARModel", "SDARForCausalLM"),
        protocol="sdar",
        protocol_rollout=MappingProxyType({"remasking": "maskgit_plus", "threshold": 0.9, "cache": "dual"}),
        protocol_blocks="block_size", eval_protocol="sdar", converts_from=("qwen3",), name_hints=("sdar",)),
    ModelFamily(
        # LLaDA2's fused attention projections, the dense layers' MLP and the shared experts; the routed experts are
        # stacked parameters (LoRA through peft's target_parameters); never the router (mlp.gate) or the LM head.
        # The official checkpoints ship inclusionAI's configuration_llada2_moe.py and modeling_llada2_moe.py; an
        # export ships ours under the modeling file's name (the official per-expert keys and config fields).
        "LLaDA2.x", ("llada2_moe",), "llada2", "diffusion", "block-causal", mask_token_id=156895,
        lora_targets=("query_key_value", "dense", "gate_proj", "up_proj", "down_proj"),
        lora_target_parameters=("experts.gate_up_proj", "experts.down_proj"),
        exported_files=MappingProxyType({"modeling_llada2_moe.py": "llada2", "sdar.py": "sdar", "dream.py": "dream",
                                         "llada.py": "llada", "families.py": "families"}),
        auto_map=_auto_map("modeling_llada2_moe", "LLaDA2MoeConfig", "LLaDA2MoeModel", "LLaDA2MoeModelLM"),
        protocol="llada2",
        protocol_rollout=MappingProxyType({"remasking": "maskgit_plus", "threshold": 0.95, "cache": "dual"}),
        protocol_blocks="block_size", eval_protocol="llada2", name_hints=("llada2",)),
    ModelFamily(
        "Qwen3", ("qwen3", "qwen2", "llama"), None, "autoregressive", "causal", lora_targets=QWEN_LINEARS),
)
"""Every family, in the order its records are listed (and its presets named) in messages."""

__all__ = ["FAMILIES", "ModelFamily", "family_of", "find_family", "is_block_causal", "is_diffusion_family",
           "logit_source_positions", "logits_are_shifted", "model_type_of", "position_logits", "shift_logits_right"]

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def find_family(model_or_type: Any) -> ModelFamily | None:
    """The record of a model (or a model_type string); None for a model_type of none of `FAMILIES` (another causal
    LM of transformers, or no model_type)."""
    return _BY_MODEL_TYPE.get(_model_type(model_or_type))


def family_of(model_or_type: Any) -> ModelFamily:
    """The record of a model (or a model_type string); ValueError, one line naming the known model_types, for any
    other."""
    found = find_family(model_or_type)
    if found is None:
        raise ValueError(f"model_type {_model_type(model_or_type)!r} is none of dllm-ais's model families "
                         f"({', '.join(_BY_MODEL_TYPE)}): use a model of one of them, or add its record to "
                         "dllm_ais/models/families.py")
    return found


def is_diffusion_family(model_or_type: Any) -> bool:
    """Whether a model (or a model_type string) is of a masked-diffusion family (what ``policy: auto`` trains with
    the diffusion policy)."""
    found = find_family(model_or_type)
    return found is not None and found.is_diffusion


def model_type_of(model: Any) -> str | None:
    """``model.config.model_type`` of a model, or of the model a wrapper (DDP, FSDP, torch.compile) holds; None when
    there is none."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        model_type = getattr(getattr(candidate, "config", None), "model_type", None)
        if model_type is not None:
            return model_type
    return None


def _model_type(model_or_type: Any) -> str | None:
    return model_or_type if isinstance(model_or_type, str) or model_or_type is None else model_type_of(model_or_type)


def logits_are_shifted(model_or_type: Any) -> bool:
    """Whether a diffusion model (or a model_type string) predicts position i from the logits at i - 1 (its record's
    `shifted_logits`)."""
    found = find_family(model_or_type)
    return found is not None and found.shifted_logits


def is_block_causal(model_or_type: Any) -> bool:
    """Whether a diffusion model (or a model_type string) attends causally across blocks (its record's `attention`)."""
    found = find_family(model_or_type)
    return found is not None and found.block_causal


def shift_logits_right(logits: torch.Tensor) -> torch.Tensor:
    """Per-position logits [B, L, V] from a shifted family's logits [B, L, V]: position i gets the logits computed at
    i - 1; position 0 keeps its own."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def logit_source_positions(positions: torch.Tensor, shifted: bool) -> torch.Tensor:
    """The forward positions whose logits predict `positions` (any integer tensor): max(p − 1, 0) for a shifted
    family, p itself otherwise."""
    return (positions - 1).clamp_min(0) if shifted else positions


def position_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    logits_to_keep: torch.Tensor | int = 0, shifted: bool | None = None, **forward_kwargs
                    ) -> torch.Tensor:
    """Logits [B, K, V] predicting the kept positions of `input_ids` [B, T]: all of them (`logits_to_keep` = 0), the
    last `logits_to_keep` (an int), or the canvas positions of a 1-D tensor, whatever the family.

    An unshifted family is asked for those positions (``model(..., logits_to_keep=...)``); a shifted one for
    `logit_source_positions` of them, so its LM head too runs at K positions only. All positions are one plain
    forward (``shift_logits_right`` of it for a shifted family). `shifted` None = from the model's
    model_type. Extra keyword arguments go to the forward.
    """
    shifted = logits_are_shifted(model) if shifted is None else shifted
    keep_all = not isinstance(logits_to_keep, torch.Tensor) and not logits_to_keep
    if keep_all:  # one full forward, whatever the model's forward makes of logits_to_keep
        output = model(input_ids, attention_mask=attention_mask, **forward_kwargs)
    else:
        if shifted:
            length = input_ids.shape[1]
            if not isinstance(logits_to_keep, torch.Tensor):
                logits_to_keep = torch.arange(length - logits_to_keep, length, device=input_ids.device)
            logits_to_keep = logit_source_positions(logits_to_keep, True)
        output = model(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep, **forward_kwargs)
    logits = output.logits if hasattr(output, "logits") else output
    return shift_logits_right(logits) if keep_all and shifted else logits

"""Supervised fine-tuning to warm-start policies before RL: the LLaDA masked-diffusion objective (SDAR's
block-diffusion one for a block-causal model), and plain next-token cross-entropy for causal LMs, on the same
`[left-padded prompt | answer + EOS padding]` canvas.

Masked-diffusion loss per sequence with answer length |a|:  t ~ U(0, 1),  p = (1 − ε)·t + ε,  each answer token masked i.i.d. with
probability p (the prompt never), and

    L = (1/|a|) · Σ_{masked i} −log p_θ(x_i | x_masked) / p

averaged over the batch. EOS padding after the answer is part of the target, so the model learns to stop.

Block diffusion (SDAR, `dllm_ais.models.families.is_block_causal`): the same masks, loss and weights, but the logits
are the model's training-mode forward (`dllm_ais.models.sdar.block_diffusion_logits`: [x_t | x_0], each noisy block
against the clean blocks before it), as SDAR is trained. `block_diffusion_from_causal` makes such a model from a
causal Qwen3 (SDAR is continued from Qwen3: the same weights under a block-causal mask, plus a mask token), which
``dllm-ais sft --as_block_diffusion BLOCK_SIZE`` then trains.

Prefix masks (`SFTConfig(masking="prefix")`, beyond LLaDA's recipe): per sequence a cut c drawn uniformly over the
answer's tokens, the answer before c clean, every position from c on masked, and the `prefix_window` tokens from c
scored with plain cross-entropy. Nothing after a scored token is ever visible, so a worked answer that repeats its
results on later lines (a column's digit in the line's total) cannot be learnt by copying them back — which is what
the i.i.d. masks above mostly teach on such answers (docs/notes/long-completion-chain-sums.md). It is the conditional that block-wise
low-confidence decoding of the first masked tokens needs. A `random_masking_share` of the steps keeps the i.i.d. loss,
so the model still fills any masked pattern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from dllm_ais.choices import SFT_MASKINGS
from dllm_ais.data import tokenize_prompts
from dllm_ais.likelihood import causal_position_ids
from dllm_ais.models import SDARConfig, SDARForCausalLM
from dllm_ais.models.families import family_of, is_block_causal, position_logits
from dllm_ais.models.sdar import block_diffusion_logits

ADDED_MASK_TOKEN = "<|MASK|>"
"""The mask token `block_diffusion_from_causal` adds to a tokenizer without one (SDAR's own)."""


def masked_diffusion_sft_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, answer_mask: torch.Tensor,
                              mask_token_id: int, generator: torch.Generator | None = None, eps: float = 1e-3) -> torch.Tensor:
    """The LLaDA SFT loss above for a batch [B, T]; `answer_mask` marks the positions that may be masked and scored.
    A block-causal model (SDAR) scores the masked tokens by its training-mode forward, each block against the clean
    blocks before it (module docstring)."""
    batch = input_ids.shape[0]
    t = torch.rand(batch, generator=generator, device=input_ids.device)
    p_mask = (1 - eps) * t + eps
    masked = (torch.rand(input_ids.shape, generator=generator, device=input_ids.device) < p_mask[:, None]) & answer_mask
    noisy = torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids)
    if is_block_causal(model):
        logits = block_diffusion_logits(model, noisy, input_ids, attention_mask)
    else:
        logits = position_logits(model, noisy, attention_mask)
    token_loss = F.cross_entropy(logits[masked].float(), input_ids[masked], reduction="none")
    rows = masked.nonzero()[:, 0]
    answer_length = answer_mask.sum(1).clamp(min=1)
    return (token_loss / (p_mask[rows] * answer_length[rows])).sum() / batch


def prefix_masked_sft_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, answer_mask: torch.Tensor,
                           answer_lengths: torch.Tensor, mask_token_id: int, window: int = 8,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """Prefix-mask loss (module docstring) for a batch [B, T] whose answers start at one column (left-padded prompts):
    cut c_b ~ U{0, …, answer_lengths_b − 1} within the answer, positions ≥ c_b masked, and

        L = mean over b and c_b ≤ i < c_b + window (inside the canvas) of −log p_θ(x_i | x_<c_b).
    """
    batch, width = input_ids.shape
    answer_start = width - int(answer_mask[0].sum())
    cut = answer_start + (torch.rand(batch, generator=generator, device=input_ids.device)
                          * answer_lengths.clamp(min=1)).long()
    position = torch.arange(width, device=input_ids.device)
    masked = position[None, :] >= cut[:, None]
    scored = masked & (position[None, :] < (cut + window)[:, None])
    noisy = torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids)
    logits = position_logits(model, noisy, attention_mask)
    return F.cross_entropy(logits[scored].float(), input_ids[scored])


def block_diffusion_from_causal(model: torch.nn.Module, tokenizer, block_size: int) -> SDARForCausalLM:
    """An SDAR model of blocks of `block_size` holding a causal Qwen3's weights, as SDAR was continued from Qwen3:
    the same module tree and weights, attention block-causal instead of causal, and ``mask_token_id`` the
    tokenizer's mask token — `ADDED_MASK_TOKEN`, added to `tokenizer` (in place) when it has none, with an embedding
    and LM-head row grown for it if the vocabulary has no spare row. ValueError naming the fix for another
    model_type or an unsupported config (sliding windows, RoPE scaling)."""
    source, convertible = model.config, family_of(SDARConfig.model_type).converts_from
    if source.model_type not in convertible:
        raise ValueError(f"--as_block_diffusion converts a causal {' or '.join(convertible)} model "
                         f"(SDAR's architecture); got model_type {source.model_type!r}: pass a Qwen3 checkpoint")
    if tokenizer.mask_token_id is None:
        tokenizer.add_special_tokens({"mask_token": ADDED_MASK_TOKEN})
    rope = getattr(source, "rope_parameters", None) or {}
    config = SDARConfig(
        vocab_size=max(source.vocab_size, len(tokenizer)), hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size, num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads, num_key_value_heads=source.num_key_value_heads,
        head_dim=getattr(source, "head_dim", None), hidden_act=source.hidden_act,
        max_position_embeddings=source.max_position_embeddings, rms_norm_eps=source.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(source, "rope_theta", 10000.0))),
        rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
        use_sliding_window=bool(getattr(source, "use_sliding_window", False)),
        attention_bias=bool(getattr(source, "attention_bias", False)),
        tie_word_embeddings=bool(source.tie_word_embeddings), max_window_layers=source.num_hidden_layers,
        block_size=block_size, mask_token_id=tokenizer.mask_token_id, pad_token_id=source.pad_token_id,
        bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id)
    if source.vocab_size < config.vocab_size:
        model.resize_token_embeddings(config.vocab_size)
    sdar = SDARForCausalLM(config).to(dtype=model.dtype, device=model.device)
    missing, unexpected = sdar.load_state_dict(model.state_dict(), strict=False)
    missing = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"Qwen3 -> SDAR weight map: missing {missing}, unexpected {unexpected}")
    return sdar


def causal_sft_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, answer_mask: torch.Tensor,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over answer tokens; positions count real tokens only (left padding)."""
    logits = model(input_ids, attention_mask=attention_mask, position_ids=causal_position_ids(attention_mask)).logits[:, :-1]
    targets = answer_mask[:, 1:]
    return F.cross_entropy(logits[targets].float(), input_ids[:, 1:][targets])


def build_sft_batch(tokenizer, prompts: list, answers: list[str], gen_length: int, device="cpu"):
    """Canvas `[left-padded chat prompt | answer <eot> EOS…]` with the answer padded to `gen_length` by EOS.

    Returns input_ids, attention_mask and answer_mask [B, P + gen_length], the RL rollout layout exactly.
    """
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)
    end_of_turn = tokenizer.get_vocab().get("<|eot_id|>")
    answer_rows = []
    for answer in answers:
        ids = tokenizer(answer, add_special_tokens=False).input_ids + ([end_of_turn] if end_of_turn is not None else [])
        if len(ids) > gen_length:
            raise ValueError(f"Answer of {len(ids)} tokens does not fit gen_length={gen_length}.")
        answer_rows.append(ids + [tokenizer.eos_token_id] * (gen_length - len(ids)))
    answer_ids = torch.tensor(answer_rows)
    input_ids = torch.cat([prompt_ids, answer_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(answer_ids)], dim=1)
    answer_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    answer_mask[:, prompt_ids.shape[1]:] = True
    return input_ids.to(device), attention_mask.to(device), answer_mask.to(device)


@dataclass
class SFTConfig:
    steps: int = 1000
    batch_size: int = 64
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    gen_length: int = 16
    # If set, each step pads its answers with EOS to a length drawn uniformly from gen_length, gen_length + 32, ...,
    # max_gen_length, so a masked-diffusion model learns to end its answer on any canvas in that range.
    max_gen_length: int | None = None
    seed: int = 0
    masking: str = "random"  # masked-diffusion masks: "random" (LLaDA's i.i.d. ones) or "prefix" (module docstring)
    prefix_window: int = 8  # prefix masks: tokens scored after the cut
    random_masking_share: float = 0.2  # prefix masks: the share of steps that use the i.i.d. masks instead

    def __post_init__(self):
        if self.masking not in SFT_MASKINGS:
            raise ValueError(f"masking={self.masking!r}: one of {', '.join(SFT_MASKINGS)}")

    def canvas_lengths(self) -> list[int]:
        """The answer lengths a step may pad to."""
        return list(range(self.gen_length, (self.max_gen_length or self.gen_length) + 1, 32))


def run_sft(model, tokenizer, dataset, config: SFTConfig, mask_token_id: int | None,
            answer_column: str = "answer") -> list[float]:
    """Train `model` in place on `dataset` (`prompt` + answer column); returns the losses.

    With a `mask_token_id` the model is a masked-diffusion LM (LLaDA SFT loss; block diffusion's for SDAR); without, a
    causal LM.
    """
    if config.masking == "prefix" and is_block_causal(model):
        raise ValueError("masking='prefix' masks everything after a cut across the whole canvas; a block-diffusion "
                         "(SDAR) model trains with masking='random' (each block against the clean blocks before it)")
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(config.seed)
    order = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(config.warmup_steps, 1))
                                                 * max(0.0, 1 - s / config.steps))
    lengths = config.canvas_lengths()
    model.train()
    losses = []
    for _ in (bar := tqdm(range(config.steps), desc="SFT")):
        rows = dataset.select(torch.randint(len(dataset), (config.batch_size,), generator=order).tolist())
        gen_length = lengths[torch.randint(len(lengths), (1,), generator=order).item()] if len(lengths) > 1 else lengths[0]
        batch = build_sft_batch(tokenizer, rows["prompt"], rows[answer_column], gen_length, device)
        if mask_token_id is None:
            loss = causal_sft_loss(model, *batch)
        elif config.masking == "prefix" and torch.rand(1, generator=order).item() >= config.random_masking_share:
            input_ids, _, answer_mask = batch
            answer_lengths = (answer_mask & (input_ids != tokenizer.eos_token_id)).sum(1)
            loss = prefix_masked_sft_loss(model, *batch, answer_lengths, mask_token_id, config.prefix_window,
                                          generator)
        else:
            loss = masked_diffusion_sft_loss(model, *batch, mask_token_id=mask_token_id, generator=generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses

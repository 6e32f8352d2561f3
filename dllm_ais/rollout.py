"""The `Rollout`: what every sampler (diffusion or autoregressive) hands to the rest of the pipeline.

It imports no other dllm_ais module, so that `sampling` (which builds it) and `likelihood` (which scores it) both
import it from below."""

from __future__ import annotations

import operator
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

import torch


class PromptError(ValueError):
    """Prompts a sampler cannot complete (too long for the model, holding the mask token); the message says why."""


@dataclass
class Rollout:
    """A batch of sampled completions on a fixed canvas `[left-padded prompt | completion]`.

    Shapes: B sequences, P prompt positions (left padded), L completion positions.

    Attributes:
        sequences: [B, P + L] prompt and completion token ids.
        attention_mask: [B, P + L] 1 for real tokens, 0 for left padding of the prompt.
        completion_mask: [B, L] True for completion tokens that count: up to and including the first EOS.
        step_logprobs: [B, L] float32 log-probability of each completion token under the sampling
            distribution at the moment it was committed (after temperature and any other processing); with a
            token-editing decoder, the sum over the position's writes (its commit and each edit).
        commit_step: [B, L] index of the denoising step (diffusion) or decoding step (autoregressive)
            at which each completion token was committed.
        prompt_length: P.
        num_steps: optional [B] number of steps (model evaluations) each row took: the diffusion steps that
            committed at least one of its tokens, or the autoregressive steps through its first EOS. With parallel
            decoding it varies per row; None when the sampler does not record it.
        records: what a sampler's recorders (experimental plug-ins) recorded beside the tokens, by name: each a
            dataclass whose tensor fields have the batch first (e.g. the complete ratio's "commit_choice",
            `dllm_ais.sampling.diffusion.choice.CommitChoiceRecord`; a token-editing decoder's "edits",
            `dllm_ais.sampling.diffusion.editing.EditRecord`); `select`, `to` and `concatenate` carry them.
    """

    sequences: torch.LongTensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    step_logprobs: torch.Tensor
    commit_step: torch.LongTensor
    prompt_length: int
    num_steps: torch.LongTensor | None = None
    records: dict[str, Any] = field(default_factory=dict)

    @property
    def completion_ids(self) -> torch.LongTensor:
        """[B, L] completion token ids."""
        return self.sequences[:, self.prompt_length :]

    @property
    def prompt_ids(self) -> torch.LongTensor:
        """[B, P] left-padded prompt ids."""
        return self.sequences[:, : self.prompt_length]

    @property
    def gen_length(self) -> int:
        return self.sequences.shape[1] - self.prompt_length

    def to(self, device: torch.device | str) -> "Rollout":
        return self._map_tensors(lambda t: t.to(device))

    def select(self, rows: slice | torch.Tensor) -> "Rollout":
        """The rollout restricted to some sequences (a slice or an index tensor over the batch)."""
        return self._map_tensors(lambda t: t[rows])

    def _map_tensors(self, fn) -> "Rollout":
        mapped = {f.name: fn(v) if torch.is_tensor(v := getattr(self, f.name)) else v for f in fields(self)}
        mapped["records"] = {name: _map_record(record, fn) for name, record in self.records.items()}
        return Rollout(**mapped)

    @staticmethod
    def concatenate(parts: list["Rollout"]) -> "Rollout":
        """One rollout holding the sequences of `parts` (same canvas layout) in order; an optional field (a record,
        a record's field) stays None (is left out) unless every part has it."""
        if len({part.prompt_length for part in parts}) != 1:
            raise ValueError("Rollouts with different prompt lengths cannot share one canvas.")
        joined = {f.name: _joined([getattr(part, f.name) for part in parts]) for f in fields(Rollout)
                  if f.name != "records"}
        shared = set.intersection(*(set(part.records) for part in parts))
        joined["records"] = {name: _joined_records([part.records[name] for part in parts]) for name in shared}
        return Rollout(**joined)


def _joined(values: list):
    """The parts' values of one field: their tensors concatenated (None unless every part has one), or the first
    part's value when the field holds no tensor."""
    if not torch.is_tensor(values[0]):
        return values[0]
    return torch.cat(values) if all(torch.is_tensor(v) for v in values) else None


def _joined_records(records: list) -> Any:
    """The parts' records of one recorder: by its own ``joined(parts)`` when it has one (a record whose width varies
    per call, e.g. padded to its most edits), else field by field (`_joined`)."""
    if hasattr(records[0], "joined"):
        return records[0].joined(records)
    return dataclasses.replace(records[0], **{f.name: _joined([getattr(r, f.name) for r in records])
                                              for f in fields(records[0])})


def _map_record(record: Any, fn) -> Any:
    """A recorder's record with `fn` applied to its tensor fields."""
    return dataclasses.replace(record, **{f.name: fn(v) for f in fields(record)
                                          if torch.is_tensor(v := getattr(record, f.name))})


def completion_mask_through_first_eos(completion_ids: torch.Tensor, eos_token_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
    """[B, L] bool mask that is True up to and including the first token in `eos_token_ids` (all True if none)."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_token_ids:
        is_eos |= completion_ids == eos
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return eos_before == 0


def token_id_tuple(ids: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """Normalise an id or a sequence of ids to a tuple of ints (None → ()); anything but integers is a ValueError."""
    if ids is None:
        return ()
    ids = (ids,) if not isinstance(ids, (list, tuple)) else tuple(ids)
    if any(isinstance(i, bool) or not hasattr(i, "__index__") for i in ids):
        raise ValueError(f"token ids must be ints; got {ids!r}")
    return tuple(operator.index(i) for i in ids)


def padding_or_none(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """`attention_mask` when it marks padding (a 0 anywhere), None when it is absent or all ones: the models apply a
    mask they are given without reading its values, so an unpadded batch passes None and runs the unmasked attention
    kernels. One host read of the mask, once per sampling or replay call."""
    return None if attention_mask is None or bool(attention_mask.all()) else attention_mask

"""Sampling stage: rollouts from a diffusion or autoregressive policy, all returning a `Rollout`."""
from dllm_ais.rollout import Rollout, completion_mask_through_first_eos

__all__ = ["Rollout", "completion_mask_through_first_eos"]

"""The `Rollout` contract's old path: it lives in `dllm_ais.rollout`, below both `sampling` and `likelihood`."""
from dllm_ais.rollout import PromptError, Rollout, completion_mask_through_first_eos, token_id_tuple

__all__ = ["PromptError", "Rollout", "completion_mask_through_first_eos", "token_id_tuple"]

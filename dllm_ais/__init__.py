"""dllm-ais: RL fine-tuning of masked-diffusion LMs with FP8 rollouts and adaptive importance sampling.

The package layout follows one GRPO step: `sampling` → `rewards` → `likelihood` → `correction` → `loss` → `trainer`
(with `engine` for the low-precision rollout copy, `policy` as the diffusion/autoregressive seam, `tasks` holding one
module per task and `evaluation` scoring a policy on held-out prompts).
Importing the package registers the native LLaDA with transformers' Auto classes.
"""
import os

# torchao's CUDA extension libraries cannot load on CPU builds of torch and print noise on import.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from dllm_ais.models import LLaDAConfig, LLaDAModel, LLaDAModelLM  # noqa: E402  (registers "llada")
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler  # noqa: E402
from dllm_ais.sampling.autoregressive import AutoregressiveSampler, AutoregressiveSamplerConfig  # noqa: E402
from dllm_ais.sampling.rollout import Rollout  # noqa: E402
from dllm_ais import correction  # noqa: E402
from dllm_ais.config import GRPOConfig, load_config  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLaDAConfig", "LLaDAModel", "LLaDAModelLM", "DiffusionSamplerConfig", "MaskedDiffusionSampler",
    "AutoregressiveSampler", "AutoregressiveSamplerConfig", "Rollout", "correction", "GRPOConfig", "load_config",
    "GRPOTrainer", "RolloutEngine",
]


def __getattr__(name: str):
    """Heavier entry points load on first use, so `import dllm_ais` stays light."""
    if name == "GRPOTrainer":
        from dllm_ais.trainer import GRPOTrainer

        return GRPOTrainer
    if name == "RolloutEngine":
        from dllm_ais.engine import RolloutEngine

        return RolloutEngine
    raise AttributeError(f"module 'dllm_ais' has no attribute {name!r}")

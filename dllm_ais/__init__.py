"""dllm-ais: RL fine-tuning of masked-diffusion LMs with FP8 rollouts and adaptive importance sampling.

The package layout follows one GRPO step (`grpo`): `sampling` → `rewards` → `likelihood` → `correction` → `loss`,
run by the loop in `trainer` (with `engine` for the low-precision rollout copy, `policy` as the diffusion/autoregressive
seam, `tasks` holding one module per task and `evaluation` scoring a policy on held-out prompts). docs/architecture.md
has one line per module.

`import dllm_ais` is light (no torch), so `dllm-ais --help` is instant: the names below load on first use, and the
native LLaDA is registered with transformers' Auto classes as soon as transformers is imported (at once if it already
is), so `import dllm_ais` followed by `AutoModelForCausalLM.from_pretrained(<a LLaDA checkpoint>)` works.
"""
import importlib
import importlib.abc
import importlib.util
import os
import sys

# torchao's CUDA extension libraries cannot load on CPU builds of torch and print noise on import.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from dllm_ais.config import GRPOConfig, load_config  # noqa: E402  (light)

__version__ = "0.1.0"

_LAZY = {
    "LLaDAConfig": "dllm_ais.models", "LLaDAModel": "dllm_ais.models", "LLaDAModelLM": "dllm_ais.models",
    "DiffusionSamplerConfig": "dllm_ais.sampling.diffusion", "MaskedDiffusionSampler": "dllm_ais.sampling.diffusion",
    "AutoregressiveSampler": "dllm_ais.sampling.autoregressive",
    "AutoregressiveSamplerConfig": "dllm_ais.sampling.autoregressive",
    "Rollout": "dllm_ais.sampling.rollout", "GRPOTrainer": "dllm_ais.trainer", "RolloutEngine": "dllm_ais.engine",
}
__all__ = [*_LAZY, "correction", "GRPOConfig", "load_config"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "correction":
        return importlib.import_module("dllm_ais.correction")
    raise AttributeError(f"module 'dllm_ais' has no attribute {name!r}")


class _RegisterLLaDAOnTransformersImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `transformers` is about to be imported, it wraps that module's loader so that
    `dllm_ais.models` (which registers LLaDA with the Auto classes) is imported right after transformers is."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            importlib.import_module("dllm_ais.models")

        spec.loader.exec_module = exec_module
        return spec


if "transformers" in sys.modules:
    importlib.import_module("dllm_ais.models")
elif not any(isinstance(finder, _RegisterLLaDAOnTransformersImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterLLaDAOnTransformersImport())

"""Model implementations registered with transformers' Auto classes on `import dllm_ais`."""
from dllm_ais.models.llada import LLaDAConfig, LLaDAModel, LLaDAModelLM, register_with_auto_classes

register_with_auto_classes()

__all__ = ["LLaDAConfig", "LLaDAModel", "LLaDAModelLM"]

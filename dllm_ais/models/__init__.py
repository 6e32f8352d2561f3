"""Model implementations registered with transformers' Auto classes on `import dllm_ais`."""
from dllm_ais.models import dream, llada, sdar
from dllm_ais.models.dream import DreamBaseModel, DreamConfig, DreamModel
from dllm_ais.models.llada import LLaDAConfig, LLaDAModel, LLaDAModelLM
from dllm_ais.models.sdar import SDARConfig, SDARForCausalLM, SDARModel

llada.register_with_auto_classes()
dream.register_with_auto_classes()
sdar.register_with_auto_classes()

__all__ = ["DreamBaseModel", "DreamConfig", "DreamModel", "LLaDAConfig", "LLaDAModel", "LLaDAModelLM", "SDARConfig",
           "SDARForCausalLM", "SDARModel"]

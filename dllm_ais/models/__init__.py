"""Model implementations registered with transformers' Auto classes on `import dllm_ais`."""
from dllm_ais.models import dream, llada, llada2, sdar
from dllm_ais.models.dream import DreamBaseModel, DreamConfig, DreamModel
from dllm_ais.models.llada import LLaDAConfig, LLaDAModel, LLaDAModelLM
from dllm_ais.models.llada2 import LLaDA2MoeConfig, LLaDA2MoeModel, LLaDA2MoeModelLM
from dllm_ais.models.sdar import SDARConfig, SDARForCausalLM, SDARModel

llada.register_with_auto_classes()
dream.register_with_auto_classes()
sdar.register_with_auto_classes()
llada2.register_with_auto_classes()

__all__ = ["DreamBaseModel", "DreamConfig", "DreamModel", "LLaDA2MoeConfig", "LLaDA2MoeModel", "LLaDA2MoeModelLM",
           "LLaDAConfig", "LLaDAModel", "LLaDAModelLM", "SDARConfig", "SDARForCausalLM", "SDARModel"]

"""Model implementations, each registered with transformers' Auto classes on `import dllm_ais` (every family record
with a module, `families.FAMILIES`)."""
import importlib

from dllm_ais.models.dream import DreamBaseModel, DreamConfig, DreamModel
from dllm_ais.models.families import FAMILIES
from dllm_ais.models.llada import LLaDAConfig, LLaDAModel, LLaDAModelLM
from dllm_ais.models.llada2 import LLaDA2MoeConfig, LLaDA2MoeModel, LLaDA2MoeModelLM
from dllm_ais.models.sdar import SDARConfig, SDARForCausalLM, SDARModel

for _family in FAMILIES:
    if _family.module is not None:
        importlib.import_module(f"dllm_ais.models.{_family.module}").register_with_auto_classes()

__all__ = ["DreamBaseModel", "DreamConfig", "DreamModel", "LLaDA2MoeConfig", "LLaDA2MoeModel", "LLaDA2MoeModelLM",
           "LLaDAConfig", "LLaDAModel", "LLaDAModelLM", "SDARConfig", "SDARForCausalLM", "SDARModel"]

"""What the benchmarks share: the device line printed beside every figure, timing with the device queue drained,
random tiny LLaDA models, and peak-memory measurements in a fresh child process."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
import contextlib
from collections.abc import Callable, Iterator

import torch


def describe_device(device: torch.device) -> str:
    """The device line beside every figure: the GPU's name, or the CPU's with torch's thread count."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"cpu {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s)"


def resolve_device(name: str) -> torch.device:
    """`auto` (cuda when torch sees one, else cpu), `cpu` or `cuda`; a cuda request without CUDA is one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch sees no CUDA device; use --device cpu.")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_and_cpu_seconds(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """Wall time and this process's CPU time of fn(), with the device queue drained before and after."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def random_llada(vocab: int, d_model: int, n_layers: int, n_heads: int, mlp_hidden_size: int, max_length: int):
    """A randomly initialised LLaDA (seed 0): mask id = vocab − 1, EOS = pad = vocab − 2."""
    from dllm_ais.models import LLaDAConfig, LLaDAModelLM

    torch.manual_seed(0)
    return LLaDAModelLM(LLaDAConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=n_heads, n_layers=n_layers,
                                    mlp_hidden_size=mlp_hidden_size, vocab_size=vocab, embedding_size=vocab,
                                    max_sequence_length=max_length, mask_token_id=vocab - 1, eos_token_id=vocab - 2,
                                    pad_token_id=vocab - 2))


TINY_DREAM = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 160, "mask_token_id": 159, "pad_token_id": 158,
              "eos_token_id": 158, "bos_token_id": 157}


def random_dream(max_length: int, tiny: bool = False):
    """A randomly initialised Dream (seed 0) at Dream-v0-7B's shape (`DreamConfig`'s defaults: Qwen2.5-7B's), or a
    tiny one, with room for `max_length` positions."""
    from dllm_ais.models import DreamConfig, DreamModel

    torch.manual_seed(0)
    return DreamModel(DreamConfig(max_position_embeddings=max_length, **(TINY_DREAM if tiny else {})))


TINY_LLADA2 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 16, "n_group": 2,
               "topk_group": 1, "num_experts_per_tok": 2, "vocab_size": 160, "mask_token_id": 159, "pad_token_id": 158,
               "eos_token_id": 158}


def random_llada2(block_size: int, tiny: bool = False):
    """A randomly initialised LLaDA2 MoE (seed 0) at LLaDA2.0-mini's shape (`LLaDA2MoeConfig`'s defaults: 20 layers
    of 2048, 256 experts of 512, 8 per token, one shared, 32768 positions), or a tiny one, in blocks of
    `block_size`."""
    from dllm_ais.models import LLaDA2MoeConfig, LLaDA2MoeModelLM

    torch.manual_seed(0)
    return LLaDA2MoeModelLM(LLaDA2MoeConfig(block_size=block_size, **(TINY_LLADA2 if tiny else {})))


def peak_resident_bytes() -> int:
    """This process's peak resident set size so far (`ru_maxrss`, kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(module: str, arguments: list[str], env: dict[str, str] | None = None) -> dict:
    """Run `python -m module --child ARGUMENTS` in a fresh process (its peak memory its own) and return the JSON
    object its last output line holds."""
    result = subprocess.run([sys.executable, "-m", module, "--child", *arguments], check=True, capture_output=True,
                            text=True, env={**os.environ, **(env or {})})
    return json.loads(result.stdout.strip().splitlines()[-1])


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
"""The tensor methods that read a value on the host (on a GPU, each waits for the device)."""


@contextlib.contextmanager
def host_reads() -> Iterator[dict[str, int]]:
    """Counts the tensor values read on the host (`HOST_READS`) while the block runs, into the yielded
    ``{"reads": n}``."""
    counter = {"reads": 0}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(original):
        def read(self, *args, **kwargs):
            counter["reads"] += 1
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)

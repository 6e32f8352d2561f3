"""What the CLI prints: our own log lines, progress bars and results; the libraries' notices only with `--verbose`.

The libraries are silenced through their own switches — environment variables each reads when it is imported, so
`configure_console` runs before anything heavy is imported — plus the standard `logging` levels and `warnings`
filters for what they emit through those.
"""

from __future__ import annotations

import logging
import os
import warnings

LIBRARY_SWITCHES = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # also transformers' bars ("Loading weights")
    "DATASETS_VERBOSITY": "error",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}
# Loggers of notices that are not ours: torchao's "Skipping import of cpp extensions", torch's `_pytree` warnings
# about torchao's enums, HTTP clients.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "httpx", "urllib3", "accelerate")
LIBRARIES = r"(transformers|torch|torchao|peft|accelerate|datasets|huggingface_hub|math_verify)(\.|$)"


def configure_console(verbose: bool = False) -> None:
    """INFO-level lines from dllm_ais; library warnings, deprecation notices and progress bars only when `verbose`."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if verbose:
        return
    for name, value in LIBRARY_SWITCHES.items():
        os.environ.setdefault(name, value)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARIES)

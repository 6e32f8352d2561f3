"""What the CLI prints: our own log lines, progress bars and results; the libraries' notices only with `--verbose`.

The libraries are silenced through their own switches — environment variables each reads when it is imported, so
`configure_console` runs before anything heavy is imported — plus the standard `logging` levels and `warnings`
filters for what they emit through those.
"""

from __future__ import annotations

import logging
import os
import re
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
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 and C1 controls but tab and newline
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


def printable(text: str) -> str:
    """`text` safe to print on a terminal: control characters (ESC of escape sequences, carriage returns, ...) are
    shown as Python escapes (`\\x1b`); tabs and newlines are kept."""
    return CONTROL_CHARACTERS.sub(lambda match: match.group().encode("unicode_escape").decode(), text)

"""Publishing a trained model: merge the adapter into its base, write a Hub-layout directory that loads anywhere and
whose card says where it came from, and upload it in one commit.

The card (`huggingface_hub.ModelCard` / `ModelCardData`) names the base model by its portable id (never a local
path), the training recipe (`dllm_ais_config.yaml` beside the source: rollout precision, correction, likelihood
estimator, ...) and, when a `dllm-ais eval` report of this model is found or given, its results table.

An exported masked-diffusion model carries our modeling files (LLaDA: `modeling_llada.py`; Dream: `modeling_dream.py`
with the `llada.py` it shares norms and RoPE with; SDAR: `modeling_sdar.py` with the `dream.py`, `llada.py` and
`families.py` it imports; LLaDA2: `modeling_llada2_moe.py` with the `sdar.py` and those it imports; they import only
torch and transformers) and an `auto_map` in config.json (each family's record, `dllm_ais.models.families`), so
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` loads it without
dllm-ais installed. With `import dllm_ais` the registered native class is used instead, remote code or not:
transformers (5.x) prefers a model type registered outside `transformers.*` over a checkpoint's `auto_map`.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

import importlib

import torch
from dllm_ais.config import EMBEDDED_MODELS, ConfigError, GRPOConfig, canonical_values, recipe_setting
from dllm_ais.run_dir import MARKER, atomic_directory, check_destination, check_not_source
from dllm_ais.loading import adapter_base, load_model, load_tokenizer_as_saved, resolve_model_path
from dllm_ais.models.families import ModelFamily, find_family

def shipped_code(model_type: str | None) -> ModelFamily | None:
    """The family whose modeling files an export of `model_type` ships (its record's `exported_files` and
    `auto_map`); None when transformers loads the model alone (or the family has no files to ship)."""
    family = find_family(model_type)
    return family if family is not None and family.exported_files else None


TRAINING_CONFIG = "dllm_ais_config.yaml"
EVAL_REPORT_DIRECTORY = "eval_results"  # where `dllm-ais eval` writes its reports by default
MAX_REPORT_BYTES = 64 * 2**20
# Settings of the run, not of the recipe: left out of the card.
RUN_ONLY_FIELDS = ("output_dir", "overwrite_output_dir", "resume_from_checkpoint", "report_to", "run_name", "dry_run",
                   "logging_steps", "save_steps", "save_total_limit", "log_completions", "num_completions_to_print")
CARD_SETTINGS = (  # (field, label) shown in the card's summary table when the recipe has them
    ("task", "task"), ("rollout.precision", "rollout precision"), ("correction.method", "correction"),
    ("correction.ais_rule", "AIS rule"), ("correction.clip", "IS clip C"), ("likelihood.estimator", "likelihood estimator"),
    ("num_generations", "generations per prompt"), ("num_iterations", "iterations μ"),
    ("learning_rate", "learning rate"), ("beta", "β (KL)"), ("epsilon", "ε (clip)"), ("loss_type", "loss type"),
    ("max_steps", "optimizer steps"), ("max_completion_length", "completion length"),
    ("rollout.steps", "diffusion steps"), ("rollout.block_length", "block length"), ("temperature", "temperature"),
    ("use_peft", "LoRA"), ("lora_r", "LoRA r"), ("lora_alpha", "LoRA α"), ("seed", "seed"),
)


class PushToHubError(RuntimeError):
    """The export is complete on disk but the upload failed; the message says how to push it later."""


def is_hub_id(name: str) -> bool:
    """Whether `name` is a portable model name: a Hub repo id that is not a local path, or an embedded model."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name in EMBEDDED_MODELS:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not Path(name).expanduser().exists()


def portable_name(name: str | None) -> str | None:
    """`name` when it is portable (see `is_hub_id`); a local path becomes `<local>/<its last part>`."""
    if name is None or is_hub_id(name):
        return name
    return f"<local>/{Path(name).name}"


def training_recipe(source: Path) -> dict[str, Any] | None:
    """The training config saved beside a trained model (`dllm_ais_config.yaml`) without the run-only settings,
    local paths reduced to their last part; None when the source has none."""
    from dllm_ais.validation import read_recipe

    try:
        values = (canonical_values(read_recipe(source / TRAINING_CONFIG), str(source / TRAINING_CONFIG))
                  if (source / TRAINING_CONFIG).is_file() else None)
    except ConfigError:
        return None
    if values is None:
        return None
    paths = {name for name, field in GRPOConfig.__dataclass_fields__.items() if field.metadata.get("path")}
    return {key: portable_name(value) if key in paths and isinstance(value, str) else value
            for key, value in values.items() if key not in RUN_ONLY_FIELDS}


def read_eval_report(path: str | Path) -> dict[str, Any]:
    """A `dllm-ais eval` JSON report, checked to render as its table (ConfigError naming the file otherwise)."""
    from dllm_ais.evaluation import markdown_table

    path = Path(path)
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            raise ValueError(f"larger than {MAX_REPORT_BYTES} bytes")
        report = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(report, dict) or not isinstance(report.get("model"), dict) or not report.get("results"):
            raise ValueError("no model or results")
        markdown_table(report)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
        raise ConfigError(f"--eval_report {path}: not a dllm-ais eval report ({type(error).__name__}: {error})") from None
    return report


def find_eval_report(source: Path) -> Path | None:
    """The newest `dllm-ais eval` report of the model in `source`, in an `eval_results/` directory of the current
    directory, of the source or of its parent; None when there is none."""
    wanted = str(source.resolve())
    found = []
    for directory in dict.fromkeys([Path(EVAL_REPORT_DIRECTORY), source / EVAL_REPORT_DIRECTORY,
                                    source.parent / EVAL_REPORT_DIRECTORY]):
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            try:
                report = read_eval_report(path)
            except ValueError:
                continue
            if report["model"].get("path") == wanted:
                found.append((path.stat().st_mtime, path))
    return max(found)[1] if found else None


def loading_instructions(name: str, remote: ModelFamily | None) -> str:
    """The card's "How to load" section for the model published as `name` (`remote`: the remote code it ships)."""
    if remote is None:
        return ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f'model = AutoModelForCausalLM.from_pretrained("{name}", dtype="auto")\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{name}")\n```\n')
    return (
        "With dllm-ais installed, its registered native implementation loads the model (no remote code):\n\n```python\nimport torch, dllm_ais  # registers {remote.name} with the transformers Auto classes\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{name}", dtype=torch.bfloat16)\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")\n```\n\n'
        f"With transformers alone, the same implementation ships here as `{'` and `'.join(remote.exported_files)}` (it imports "
        "only torch and transformers):\n\n```python\n"
        f'model = AutoModelForCausalLM.from_pretrained("{name}", dtype=torch.bfloat16, trust_remote_code=True)\n```\n\n'
        f"{remote.name} is a masked-diffusion model: sample with dllm-ais' `MaskedDiffusionSampler` (or "
        f"`dllm-ais generate --model {name}`), not with `model.generate`.\n")


def model_card(name: str, base_model: str | None, remote: ModelFamily | None, recipe: dict[str, Any] | None,
               report: dict[str, Any] | None, report_name: str | None, source_name: str):
    """The export's `huggingface_hub.ModelCard`: metadata (base model, library, tags) and a body with the training
    recipe, the evaluation table and how to load the model. Nothing in it is a local absolute path."""
    from huggingface_hub import ModelCard, ModelCardData

    from dllm_ais import __version__
    from dllm_ais.evaluation import markdown_table

    recipe = recipe or {}
    settings = {key: value for key, _ in CARD_SETTINGS if (value := recipe_setting(recipe, key)) is not None}
    tags = ["dllm-ais", "grpo", "reinforcement-learning"]
    tags += [f"rollout-{settings['rollout.precision']}"] if "rollout.precision" in settings else []
    tags += [f"correction-{settings['correction.method']}"] if "correction.method" in settings else []
    tags += [remote.name.lower(), "masked-diffusion", "custom_code"] if remote else []
    data = ModelCardData(base_model=base_model if base_model and is_hub_id(base_model) else None,
                         library_name="transformers", tags=tags, pipeline_tag=None if remote else "text-generation")
    origin = f"`{base_model}`" if base_model else "a local model"
    lines = [f"# {name.rsplit('/', 1)[-1]}", "",
             f"Fine-tuned from {origin} with dllm-ais {__version__}: GRPO with "
             f"{settings.get('rollout.precision', 'low-precision')} rollouts and "
             f"{settings.get('correction.method', 'importance-sampling')} correction of the rollout/trainer mismatch. "
             f"Exported from `{source_name}` on {time.strftime('%Y-%m-%d')}.", ""]
    if recipe:
        lines += ["## Training", "", "| setting | value |", "|---|---|"]
        lines += [f"| {label} | `{settings[key]}` |" for key, label in CARD_SETTINGS if key in settings]
        lines += ["", "<details><summary>The full recipe (dllm-ais GRPOConfig)</summary>", "", "```yaml",
                  _yaml(recipe).rstrip(), "```", "", "</details>", ""]
    else:
        lines += ["## Training", "", f"Unknown: the source had no `{TRAINING_CONFIG}`.", ""]
    if report is not None:
        shown = {**report, "model": {**report["model"], "id": portable_name(str(report["model"].get("id")))}}
        lines += ["## Evaluation", "", markdown_table(shown).rstrip(), "",
                  f"From the `dllm-ais eval` report `{report_name}`, which also records the seed, the library "
                  "versions, the command and every prompt's values.", ""]
    lines += ["## How to load", "", loading_instructions(name, remote)]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _yaml(values: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(values, sort_keys=False)


def export_merged_model(adapter_or_model_dir: str | Path, output_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                        push_to_hub: str | None = None, overwrite: bool = False, *, private: bool = False,
                        eval_report: str | Path | None = None) -> Path:
    """Merge a LoRA adapter into its base model and write a Hub-layout model directory: safetensors, tokenizer,
    config, the model card (`model_card`) and, for a masked-diffusion family, its modeling files with an `auto_map`
    (`shipped_code`).

    `output_dir` must be absent or empty, or — with `overwrite` — an earlier export (checked before anything loads);
    it is never the source, nor a directory holding it, nor a run's checkpoint-N or final/ (`check_destination`).
    `eval_report` is a `dllm-ais eval` JSON report whose table goes into the card (default: the newest report of
    this source found by `find_eval_report`). With `push_to_hub`, the finished directory is uploaded in one commit
    (`HfApi.upload_folder`, the repository created `private` if new); when that fails, PushToHubError says that the
    local copy is complete and how to push it later.
    """
    output_dir, source = Path(output_dir), Path(adapter_or_model_dir)
    check_not_source(output_dir, source)
    check_destination(output_dir, overwrite)
    report_path = Path(eval_report) if eval_report is not None else find_eval_report(source)
    report = read_eval_report(report_path) if report_path is not None else None
    recipe = training_recipe(source)
    model = load_model(str(source), dtype)
    if (base := adapter_base(str(source))) is not None:
        model = model.merge_and_unload()
    else:
        base = recipe.get("model_name_or_path") if recipe else None
    tokenizer_source = source if (source / "tokenizer_config.json").is_file() else resolve_model_path(base)
    tokenizer = load_tokenizer_as_saved(str(tokenizer_source))
    remote = shipped_code(model.config.model_type)
    if remote:
        model.config.auto_map = dict(remote.auto_map)
    with atomic_directory(output_dir, overwrite) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        for exported_name, module in (remote.exported_files.items() if remote else ()):
            shutil.copyfile(importlib.import_module(f"dllm_ais.models.{module}").__file__, staging / exported_name)
        card = model_card(push_to_hub or output_dir.name, portable_name(base), remote, recipe, report,
                          report_path.name if report_path is not None else None, source.name)
        card.save(staging / "README.md")
    if push_to_hub:
        upload(output_dir, push_to_hub, private)
    return output_dir


def upload(directory: Path, repo_id: str, private: bool = False) -> str:
    """Upload the export in one commit (creating the repository, `private` if new); returns the commit URL.
    Any failure (offline, not logged in, no permission, ...) becomes PushToHubError with the commands to push later."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=directory, ignore_patterns=[MARKER],
                                   commit_message=f"Upload {directory.name} (dllm-ais export)")
    except Exception as error:  # noqa: BLE001 - whatever failed, the local copy is complete: say how to finish
        reason = re.sub(r"\s+", " ", (str(error).strip().splitlines() or [""])[0])[:300]
        folder = shlex.quote(str(directory))
        cli = f"hf upload {shlex.quote(repo_id)} {folder} . --exclude {MARKER}" + (" --private" if private else "")
        python = (f"python -c \"from huggingface_hub import HfApi; api = HfApi(); api.create_repo({repo_id!r}, "
                  f"private={private}, exist_ok=True); api.upload_folder(repo_id={repo_id!r}, "
                  f"folder_path={str(directory)!r}, ignore_patterns=[{MARKER!r}])\"")
        raise PushToHubError(
            f"the export in {directory} is complete, but uploading it to {repo_id} failed "
            f"({type(error).__name__}: {reason}). Push it later, once online and logged in "
            f"(`hf auth login`), with:\n  {cli}\nor:\n  {python}") from None
    return str(commit.commit_url) if hasattr(commit, "commit_url") else str(commit)

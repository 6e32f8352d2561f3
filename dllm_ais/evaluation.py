"""Evaluation: score a policy's completions on a task's prompts, per prompt, and report numbers people can compare.

`evaluate_policy` is the stage both the trainer (validation split, before/after training) and `dllm-ais eval`
(test split) call. It keeps every prompt's values in dataset order, so two evaluations of the same prompts can be
compared pairwise.

`dllm-ais eval` runs d1's protocol by default (a block-causal model's family's own, SDAR's or LLaDA2's: its
record's `eval_protocol`): greedy decoding (temperature 0), block length 32, steps = gen_length / 2 at gen lengths
128, 256 and 512, accuracy (the task's correctness check alone, 0/1) on the full test split, with the standard error
of the accuracy and the mean of every reward function. Its report records what is needed to reproduce the number:
protocol, seed, model id and revision (or local path and content
hash), dtype, rollout precision, device, library versions and the command.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dllm_ais.config import D1_ROLLOUT, ConfigError, GRPOConfig, with_d1_protocol
from dllm_ais.decoding_protocols import protocol_family, protocol_rollout, with_family_protocol
from dllm_ais.loading import resolve_model_path
from dllm_ais.policy import sample_prompts
from dllm_ais.rewards import RewardTable, score_rollout_table
from dllm_ais.safe_files import write_file
from dllm_ais.statistics import paired_difference, standard_error
from dllm_ais.tasks import RewardFunction, Task

REPORTED_LIBRARIES = ("dllm-ais", "torch", "transformers", "accelerate", "peft", "torchao", "datasets",
                      "huggingface_hub", "math-verify")
HASHED_SUFFIXES = (".safetensors", ".json")


@dataclass
class EvalResult:
    """Per-prompt results of one evaluation, in dataset order.

    ``per_prompt_reward`` [N]: the weighted sum of the reward functions (as in training);
    ``per_prompt_accuracy`` [N]: 0/1 from the task's accuracy function, None when there is none;
    ``per_function`` maps each reward function's name to its values [N] (NaN where it returned None);
    ``timeouts`` counts, per function, the completions scored 0 because a check ran out of time.
    """

    per_prompt_reward: torch.Tensor
    per_prompt_accuracy: torch.Tensor | None
    per_function: dict[str, torch.Tensor]
    timeouts: dict[str, int] = field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return len(self.per_prompt_reward)

    def summary(self) -> dict[str, float]:
        """``eval/*`` floats: reward mean, std and standard error; accuracy and its standard error; each reward
        function's mean and timeouts; the number of prompts."""
        rewards = self.per_prompt_reward
        metrics = {
            "eval/reward": rewards.mean().item(),
            "eval/reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "eval/reward_se": standard_error(rewards),
        }
        if self.per_prompt_accuracy is not None:
            metrics["eval/accuracy"] = self.per_prompt_accuracy.mean().item()
            metrics["eval/accuracy_se"] = standard_error(self.per_prompt_accuracy)
        for name, values in self.per_function.items():
            metrics[f"eval/rewards/{name}/mean"] = values.nanmean().item()
        for name, count in self.timeouts.items():
            metrics[f"eval/rewards/{name}/timeouts"] = float(count)
        metrics["eval/num_prompts"] = float(self.num_prompts)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only, so a checkpoint can keep a run's held-out baseline."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "EvalResult":
        return cls(**state)


def held_out_metrics(before: EvalResult | None, after: EvalResult, rollout_sampler: EvalResult | None = None,
                     high_precision_base: tuple[EvalResult, EvalResult] | None = None) -> dict[str, float]:
    """`eval/*` after training, the same `_before` (when there is a baseline), the paired change of the reward
    (`eval/reward_delta`, `eval/reward_delta_se`); for a run with fast rollouts, `eval/rollout_sampler/*`: the
    scores of greedy completions decoded by the run's own sampler instead of exactly; for a unified-flow run,
    `eval/high_precision_base/*`: the same metrics with the trained policy on the high-precision base (before,
    after)."""
    metrics = after.summary()
    if rollout_sampler is not None:
        metrics.update({f"eval/rollout_sampler/{key.removeprefix('eval/')}": value
                        for key, value in rollout_sampler.summary().items()})
    if high_precision_base is not None:
        metrics.update({f"eval/high_precision_base/{key.removeprefix('eval/')}": value
                        for key, value in held_out_metrics(*high_precision_base).items()})
    if before is not None:
        metrics.update({f"{key}_before": value for key, value in before.summary().items()})
        delta = paired_difference(before.per_prompt_reward, after.per_prompt_reward)
        metrics.update({"eval/reward_delta": delta.mean, "eval/reward_delta_se": delta.standard_error})
    return metrics


def held_out_line(before: EvalResult | None, after: EvalResult, rollout_sampler: EvalResult | None = None,
                  high_precision_base: tuple[EvalResult, EvalResult] | None = None) -> str:
    """The run's closing line: greedy held-out reward (and accuracy) before → after training, decoded exactly, with
    the paired per-prompt difference and its standard error; just the final value when there is no baseline (a
    resumed run that turned evaluation on); then the reward decoded by a fast rollout sampler, when there is one, and
    the same line for the policy on the high-precision base (unified precision flow)."""
    if high_precision_base is not None:
        return (f"{held_out_line(before, after, rollout_sampler)}\nwith the high-precision base: "
                f"{held_out_line(*high_precision_base)}")
    if rollout_sampler is not None:
        return (f"{held_out_line(before, after)}\nheld-out reward decoded by the rollout sampler (not exact): "
                f"{rollout_sampler.summary()['eval/reward']:.4f}")
    if before is None:
        return f"held-out reward after training: {after.summary()['eval/reward']:.4f} ({after.num_prompts} prompts, greedy)"
    parts = [f"held-out reward: before {before.per_prompt_reward.mean():.4f} → after {after.per_prompt_reward.mean():.4f} "
             f"({paired_difference(before.per_prompt_reward, after.per_prompt_reward)}, greedy)"]
    if before.per_prompt_accuracy is not None and after.per_prompt_accuracy is not None:
        accuracy = paired_difference(before.per_prompt_accuracy, after.per_prompt_accuracy)
        parts.append(f"accuracy {before.per_prompt_accuracy.mean():.4f} → {after.per_prompt_accuracy.mean():.4f} "
                     f"(Δ {accuracy.mean:+.4f} ± {accuracy.standard_error:.4f} SE)")
    return "; ".join(parts)


@torch.no_grad()
def evaluate_policy(model, tokenizer, policy, dataset, reward_funcs: list[RewardFunction],
                    reward_weights: list[float] | None = None, batch_size: int = 16, max_prompt_length: int = 256,
                    accuracy: RewardFunction | None = None, seed: int | None = None) -> EvalResult:
    """Sample one completion per prompt of ``dataset`` with ``policy`` (on ``model``) in batches of ``batch_size``
    and score it with ``reward_funcs`` (weighted by ``reward_weights``) and the task's ``accuracy`` function.

    ``seed`` seeds the sampler's generator (only matters at temperature > 0). Rewards whose float32 statistics
    overflow are a NonFiniteRewardError naming the function (`RewardTable.finite_weighted_sum`).
    """
    if len(dataset) == 0:
        raise ValueError("no prompts to evaluate: the dataset is empty")
    device = next(model.parameters()).device
    generator = None if seed is None else torch.Generator(device).manual_seed(seed)
    functions = [*reward_funcs, *([accuracy] if accuracy is not None else [])]
    tables = []
    for start in tqdm(range(0, len(dataset), batch_size), desc="eval", leave=False):
        rows = dataset.select(range(start, min(start + batch_size, len(dataset))))
        columns = {column: list(rows[column]) for column in rows.column_names}
        rollout = sample_prompts(policy, model, tokenizer, columns["prompt"], max_prompt_length, device, generator)
        tables.append(score_rollout_table(tokenizer, functions, columns, rollout))
    names = tables[0].names
    values = torch.cat([table.values for table in tables])
    timeouts = [sum(table.timeouts[index] for table in tables) for index in range(len(names))]
    rewards = RewardTable(names[:len(reward_funcs)], values[:, :len(reward_funcs)], timeouts[:len(reward_funcs)])
    return EvalResult(
        per_prompt_reward=rewards.finite_weighted_sum(reward_weights),
        per_prompt_accuracy=values[:, -1] if accuracy is not None else None,
        per_function={name: values[:, index] for index, name in enumerate(rewards.names)},
        timeouts=dict(zip(names, timeouts)),
    )


# --------------------------------------------------------------------------------------------- the protocol


@dataclass(frozen=True)
class EvalProtocol:
    """How completions are generated for an evaluation: d1's protocol (greedy, steps = gen_length / 2, one block
    length, LLaDA's own sampler: low-confidence remasking, no KV cache, no parallel decoding, no guidance) at each
    of ``gen_lengths``, whatever the model was trained with; or a family's own decoding (`choices.EVAL_PROTOCOLS`). For
    autoregressive policies gen_length is the number of new tokens and the diffusion settings do not apply."""

    gen_lengths: tuple[int, ...]
    block_length: int
    temperature: float = 0.0
    name: str = "d1"

    @classmethod
    def for_task(cls, task: Task, gen_lengths: tuple[int, ...] | None = None, block_length: int | None = None,
                 temperature: float = 0.0, name: str = "d1", block_size: int | None = None) -> "EvalProtocol":
        """The task's protocol (d1's for the real tasks; with another `name`, that family's own decoder,
        `decoding_protocols.with_family_protocol`: "dream" Dream's, "sdar" SDAR's and "llada2" LLaDA2's in the
        blocks of the model's `block_size`), with any of its settings replaced. ConfigError when a protocol decoding in the model's blocks
        meets a model without blocks or another block length."""
        if name != "d1" and protocol_family(name).protocol_blocks == "block_size":
            if block_size is None:
                raise ConfigError(f"--protocol {name} decodes a block-causal model ({protocol_family(name).name}) in "
                                  "its own blocks; this model has none: use --protocol d1")
            if block_length not in (None, block_size):
                raise ConfigError(f"--block_length {block_length}: the {name} protocol decodes in the model's blocks "
                                  f"of block_size={block_size}; leave --block_length unset")
            block_length = block_size
        return cls(tuple(gen_lengths or task.eval_gen_lengths), block_length or task.eval_block_length, temperature,
                   name)

    def decoding(self, config: GRPOConfig, gen_length: int) -> GRPOConfig:
        """`config` decoding with this protocol at ``gen_length`` (`with_d1_protocol`, or the family's own,
        `with_family_protocol`)."""
        if self.name == "d1":
            return with_d1_protocol(config, gen_length, self.block_length)
        return with_family_protocol(config, protocol_family(self.name), gen_length, self.block_length)

    def to_dict(self) -> dict[str, Any]:
        gen_lengths = list(self.gen_lengths)
        if self.name == "d1":
            return {**asdict(self), **D1_ROLLOUT, "steps": "gen_length / 2", "gen_lengths": gen_lengths}
        family = protocol_family(self.name)
        if family.protocol_blocks == "completion":
            return {**asdict(self), **protocol_rollout(family), "block_length": "gen_length", "steps": "gen_length",
                    "gen_lengths": gen_lengths}
        return {**asdict(self), **protocol_rollout(family), "steps": "gen_length (block_length per block)",
                "gen_lengths": gen_lengths}


# --------------------------------------------------------------------------------------------- provenance


def content_sha256(path: Path, suffixes: tuple[str, ...] | None = None) -> str:
    """SHA-256 over the relative names and bytes of a file, or of a directory's files (those ending in one of
    ``suffixes`` when given), in sorted order."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if suffixes is not None and file.suffix not in suffixes:
            continue
        digest.update(str(file.relative_to(path) if file != path else file.name).encode() + b"\0")
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def hub_commit(repo_id: str, repo_type: str | None = None) -> str | None:
    """The commit of ``repo_id`` that the local Hub cache resolved when it was loaded (no network); None if unknown."""
    from huggingface_hub import resolve_revision

    try:
        return resolve_revision(repo_id, repo_type=repo_type, local_files_only=True).resolved
    except Exception:  # noqa: BLE001 - provenance is best effort: not cached, not a repo id, ...
        return None


def model_source(name_or_path: str) -> dict[str, Any]:
    """Where one model came from: a Hub id with its commit, or a local directory with the content hash of its
    weights, configs and tokenizer (safetensors and JSON files)."""
    path = Path(resolve_model_path(name_or_path))
    if path.is_dir():
        return {"id": name_or_path, "path": str(path.resolve()), "content_sha256": content_sha256(path, HASHED_SUFFIXES)}
    return {"id": name_or_path, "revision": hub_commit(name_or_path)}


def model_provenance(name_or_path: str, model) -> dict[str, Any]:
    """The evaluated model and, for an adapter, its base model (see :func:`model_source`)."""
    if hasattr(model, "peft_config"):
        base = next(iter(model.peft_config.values())).base_model_name_or_path
        return {**model_source(name_or_path), "base_model": model_source(base)}
    return model_source(name_or_path)


def dataset_provenance(task: Task, split: str, path: str | None, dataset,
                       task_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Which rows were evaluated: the source (local path and content hash, Hub id and commit, or generated, with the
    generator's `task_args`) and a SHA-256 of the evaluated rows themselves."""
    if task.generate is not None:
        source: dict[str, Any] = {"generated": task.name, **({"task_args": task_args} if task_args else {})}
    elif path is not None:
        source = {"path": str(Path(path).resolve()), "content_sha256": content_sha256(Path(path))}
    else:
        hub = {"test": task.hub_test, "validation": task.hub_validation}.get(split) or task.hub_train
        source = {"id": hub.dataset, "config": hub.config, "split": hub.split, "carved": hub.split != split,
                  "revision": hub_commit(hub.dataset, repo_type="dataset")}
    return {**source, "num_rows": len(dataset), "rows_sha256": rows_sha256(dataset)}


def rows_sha256(dataset) -> str:
    """SHA-256 over a dataset's rows in order, each as JSON with sorted keys."""
    rows = hashlib.sha256()
    for row in dataset:
        rows.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\n")
    return rows.hexdigest()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in REPORTED_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# --------------------------------------------------------------------------------------------- a run's result


# Fields left out of a run's config hash: they change where a run writes and what it logs, never its numbers —
# output_dir and run_name (the same run written elsewhere), overwrite_output_dir and resume_from_checkpoint (how
# the run takes its directory; a resume continues the same trajectory), save_steps and save_total_limit (checkpoints
# are written beside the run, and a resume from them is exact), logging_steps, log_completions,
# num_completions_to_print and report_to (logging), dry_run (a dry run writes no result).
UNHASHED_FIELDS = frozenset({"output_dir", "run_name", "overwrite_output_dir", "resume_from_checkpoint", "save_steps",
                             "save_total_limit", "logging_steps", "log_completions", "num_completions_to_print",
                             "report_to", "dry_run"})
HELD_OUT_WRITER = "dllm-ais"


def config_sha256(config: GRPOConfig) -> str:
    """SHA-256 of the resolved config (recipe, then overrides) as canonical JSON — sorted keys, settings groups
    nested — without `UNHASHED_FIELDS`."""
    values = {name: value for name, value in config.to_dict().items() if name not in UNHASHED_FIELDS}
    return hashlib.sha256(json.dumps(values, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def package_version() -> str | None:
    """The installed dllm-ais' version (None when it is run from a source tree that is not installed)."""
    try:
        return importlib.metadata.version("dllm-ais")
    except importlib.metadata.PackageNotFoundError:
        return None


def result_identity(config: GRPOConfig, held_out) -> dict[str, Any]:
    """What a run's held-out result was made by: the config's hash (`config_sha256`), the held-out prompts' hash
    (`rows_sha256`; None without held-out prompts) and number, and the dllm-ais version."""
    return {"config_sha256": config_sha256(config),
            "prompts_sha256": None if held_out is None else rows_sha256(held_out),
            "num_prompts": 0 if held_out is None else len(held_out), "dllm_ais_version": package_version()}


def held_out_record(identity: dict[str, Any], before: EvalResult | None, after: EvalResult) -> dict[str, Any]:
    """The content of a finished run's `held_out.json`: who wrote it, its `result_identity`, and the per-prompt
    values (`per_prompt_values`) of the final held-out evaluation (`after`) and of the baseline (`before`; None for
    a resumed run that turned evaluation on)."""
    return {"written_by": HELD_OUT_WRITER, "identity": identity, "after": per_prompt_values(after),
            "before": None if before is None else per_prompt_values(before)}


def held_out_problem(record: Any) -> str | None:
    """Why `record` (a parsed `held_out.json`) is not a whole `held_out_record`, or None: another writer, no
    identity, or per-prompt values that are not numbers, one per prompt its identity counts."""
    identity = record.get("identity") if isinstance(record, dict) else None
    if isinstance(record, dict) and "after" in record and "written_by" not in record:
        return "no record of the config, prompts and version that made it (earlier releases wrote none)"
    if not isinstance(record, dict) or record.get("written_by") != HELD_OUT_WRITER:
        return "not a result record written by dllm-ais"
    if not (isinstance(identity, dict) and type(identity.get("num_prompts")) is int
            and all(isinstance(identity.get(key), str) for key in ("config_sha256", "prompts_sha256"))):
        return "no record of the config, prompts and version that made it"
    count = identity["num_prompts"]
    for name in ("before", "after"):
        values = record.get(name)
        if name == "before" and values is None:
            continue
        if not isinstance(values, dict):
            return f"no {name!r} values"
        for metric in ("reward", "accuracy"):
            numbers = values.get(metric)
            if metric == "accuracy" and numbers is None:
                continue
            if not isinstance(numbers, list) or not all(type(v) in (int, float) for v in numbers):
                return f"its {name} {metric} values are not a list of numbers"
            if len(numbers) != count:
                return f"{len(numbers)} {name} {metric} values for the {count} prompts it records"
    return None


# --------------------------------------------------------------------------------------------- the report


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN


def report_entry(gen_length: int, result: EvalResult, seconds: float) -> dict[str, Any]:
    """One gen length's numbers for the report, with the per-prompt values (dataset order) for paired comparisons."""
    summary = result.summary()
    return {
        "gen_length": gen_length,
        "num_prompts": result.num_prompts,
        "accuracy": _finite_or_none(summary.get("eval/accuracy", math.nan)),
        "accuracy_se": _finite_or_none(summary.get("eval/accuracy_se", math.nan)),
        "reward": _finite_or_none(summary["eval/reward"]),
        "reward_se": _finite_or_none(summary["eval/reward_se"]),
        "rewards": {name: _finite_or_none(values.nanmean().item()) for name, values in result.per_function.items()},
        "timeouts": result.timeouts,
        "seconds": round(seconds, 3),
        "per_prompt": per_prompt_values(result),
    }


def per_prompt_values(result: EvalResult) -> dict[str, list[float] | None]:
    """The evaluation's per-prompt reward and accuracy (None without an accuracy function), in dataset order."""
    return {"accuracy": None if result.per_prompt_accuracy is None else result.per_prompt_accuracy.tolist(),
            "reward": result.per_prompt_reward.tolist()}


def markdown_table(report: dict[str, Any]) -> str:
    """The report as a markdown table: one row per gen length, accuracy ± SE (in %), then each reward's mean."""
    names = list(report["results"][0]["rewards"]) if report["results"] else []

    def number(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
        return "n/a" if value is None else f"{scale * value:.{digits}f}"

    lines = [
        f"**{report['task']}** ({report['split']}, {report['results'][0]['num_prompts']} prompts) · model "
        f"`{report['model']['id']}` · {report['protocol']['name']} protocol (temperature "
        f"{report['protocol']['temperature']}, block {report['protocol']['block_length']}, steps = "
        f"{report['protocol'].get('steps', 'gen_length / 2')}) · "
        f"dtype {report['dtype']}, rollout {report['rollout_precision']}"
        f"{' (unified flow)' if report.get('precision_flow') == 'unified' else ''} · {report['device']}",
        "",
        "| gen length | accuracy (%) | ± SE | reward | " + " | ".join(names) + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(names),
    ]
    for entry in report["results"]:
        lines.append(f"| {entry['gen_length']} | {number(entry['accuracy'], 100, 1)} | "
                     f"{number(entry['accuracy_se'], 100, 1)} | {number(entry['reward'])} | "
                     + " | ".join(number(entry["rewards"][name]) for name in names) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], path: Path) -> tuple[Path, Path]:
    """Write the JSON report to ``path`` and its markdown table beside it (same name, ``.md``), each staged and
    renamed (`safe_files.write_file`); refuses to replace an existing file or link."""
    table_path = path.with_suffix(".md")
    for target in (path, table_path):
        if os.path.lexists(target):
            raise FileExistsError(f"{target} already exists; pass another --output (nothing was overwritten)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(report, indent=2) + "\n")
    write_file(table_path, markdown_table(report))
    return path, table_path

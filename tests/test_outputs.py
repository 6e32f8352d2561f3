"""No command deletes or replaces what it did not create: atomic directories, leftovers, refusals, metrics.jsonl,
portable adapter bases."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from dllm_ais.checkpoint_choice import HELD_OUT_FILE, prepare_output_dir
from dllm_ais.run_dir import (MARKER, OutputExistsError, atomic_directory, begin_staging, check_destination,
                              clean_leftovers, commit_staging, provenance, prune_checkpoints, run_checkpoints)
from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODELS, ConfigError, GRPOConfig
from dllm_ais.export import export_merged_model
from dllm_ais.loading import load_model
from dllm_ais.metrics import MetricsLog
from dllm_ais.run_lock import LOCK_FILE


def user_files(root):
    """A user's own directory next to where dllm-ais writes."""
    (root / "other-model").mkdir(parents=True)
    (root / "other-model" / "weights.bin").write_bytes(b"precious")
    return root / "other-model" / "weights.bin"


def written(directory, text="new"):
    with atomic_directory(directory, overwrite=True) as staging:
        (staging / "file.txt").write_text(text)


def test_atomic_directory_writes_beside_other_directories_and_never_into_a_non_empty_one(tmp_path):
    precious = user_files(tmp_path)
    written(tmp_path / "export")
    assert (tmp_path / "export" / "file.txt").read_text() == "new" and provenance(tmp_path / "export")
    for overwrite in (False, True):  # the parent holds the user's directory: refused, even with overwrite
        with pytest.raises(OutputExistsError, match="--overwrite" if not overwrite else "did not write"):
            with atomic_directory(tmp_path, overwrite=overwrite):
                pytest.fail("the block must not run for a refused destination")
    written(tmp_path / "export", "second")  # overwrite replaces a directory dllm-ais wrote
    assert (tmp_path / "export" / "file.txt").read_text() == "second"
    assert precious.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "other-model"]


def test_a_crash_while_writing_keeps_the_previous_copy_and_leaves_nothing(tmp_path):
    written(tmp_path / "model", "first")
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "model", overwrite=True) as staging:
            (staging / "file.txt").write_text("half")
            raise RuntimeError("killed")
    assert (tmp_path / "model" / "file.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_leftovers_of_a_killed_write_are_recovered_only_when_provably_ours(tmp_path):
    written(tmp_path / "a", "complete copy")
    os.rename(tmp_path / "a", tmp_path / ".old-a")  # killed between the two renames: `a` exists only as `.old-a`
    staging = begin_staging(tmp_path / "a")  # ... and its staging directory was half written
    marker = json.loads((staging / MARKER).read_text())
    (staging / MARKER).write_text(json.dumps({**marker, "pid": dead_pid()}))
    written(tmp_path / "b")
    os.rename(tmp_path / "b", tmp_path / ".old-b")
    written(tmp_path / "b", "newer")  # killed while deleting the displaced copy: `.old-b` is stale
    running = begin_staging(tmp_path / "c")  # another process is writing `c` right now
    (running / MARKER).write_text(json.dumps({**marker, "pid": os.getppid()}))
    for name in (".tmp-a-user", ".old-mine"):  # look like leftovers, but carry no marker: the user's
        (tmp_path / name).mkdir()
    clean_leftovers(tmp_path)
    assert (tmp_path / "a" / "file.txt").read_text() == "complete copy"
    assert (tmp_path / "b" / "file.txt").read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".old-mine", ".tmp-a-user", running.name, "a", "b"])


def test_metrics_jsonl_belongs_to_one_run(tmp_path):
    lines = [{"step": s, "reward": s / 10} for s in (1, 2, 3, 4)] + [{"step": 4, "eval/reward": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "rew')
    log = MetricsLog(tmp_path, resume_step=2)  # resumed at step 2: later lines and the torn one are dropped
    log.write({"step": 3, "reward": 1.0})
    log.close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [lines[0], lines[1], {"step": 3, "reward": 1.0}]
    copy = MetricsLog(tmp_path / "elsewhere", resume_step=1, previous=tmp_path / "metrics.jsonl")
    copy.close()
    assert [json.loads(x) for x in (tmp_path / "elsewhere" / "metrics.jsonl").read_text().splitlines()] == [lines[0]]
    MetricsLog(tmp_path).close()  # a fresh run never appends to another run's file
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_cli_refuses_non_empty_destinations_before_loading_anything(tmp_path, capsys):
    precious = user_files(tmp_path / "models")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    commands = {
        "export": ["export", str(tmp_path / "adapter-that-does-not-exist"), str(tmp_path / "models")],
        "sft": ["sft", "--output_dir", str(tmp_path / "models"), "--steps", "1"],
        "train": ["train", f"--output_dir={tmp_path / 'run'}"],
    }
    for name, argv in commands.items():
        assert main(argv) == 2, name
        error = capsys.readouterr().err
        assert "not empty" in error and ("notes.txt" if name == "train" else "other-model") in error, error
        assert ("--overwrite_output_dir=true" in error) if name == "train" else ("--overwrite" in error)
    assert precious.read_bytes() == b"precious" and (tmp_path / "run" / "notes.txt").read_text() == "mine"
    assert main(["train", f"--output_dir={tmp_path / 'run'}", "--overwrite_output_dir=true",
                 "--resume_from_checkpoint=true"]) == 2
    assert "set one" in capsys.readouterr().err


def test_adapters_and_exports_name_a_portable_base_and_load_back(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model("embedded-qwen3", torch.float32), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "embedded-qwen3"
    assert str(EMBEDDED_MODELS["embedded-qwen3"]) not in (tmp_path / "adapter" / "README.md").read_text()
    export_merged_model(tmp_path / "adapter", tmp_path / "merged", torch.float32)
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "base_model: embedded-qwen3" in card and "assets" not in card
    assert "assets" not in (tmp_path / "merged" / "config.json").read_text()
    with pytest.raises(OutputExistsError, match="--overwrite"):
        export_merged_model(tmp_path / "adapter", tmp_path / "merged", torch.float32)
    export_merged_model(tmp_path / "adapter", tmp_path / "merged", torch.float32, overwrite=True)
    assert load_model(str(tmp_path / "adapter"), torch.float32).peft_config["default"].base_model_name_or_path == \
        "embedded-qwen3"


def checkpoint(output_dir, step, run):
    staging = begin_staging(output_dir / f"checkpoint-{step}", run=run)
    (staging / "custom_checkpoint_0.pkl").write_bytes(b"")
    (staging / "dllm_ais_config.yaml").write_text(f"output_dir: {output_dir}\n")
    commit_staging(staging, output_dir / f"checkpoint-{step}")


def test_save_total_limit_and_overwrite_touch_only_what_dllm_ais_wrote(tmp_path):
    for step, run in ((1, "other-run"), (2, "this-run"), (3, "this-run"), (4, "this-run")):
        checkpoint(tmp_path, step, run)
    prune_checkpoints(tmp_path, "this-run", keep=2)
    assert [p.name for _, p in run_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]

    (tmp_path / "notes.txt").write_text("mine")
    config = GRPOConfig(output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--resume_from_checkpoint=true to continue its run, --overwrite_output_dir"):
        prepare_output_dir(config)
    assert prepare_output_dir(dataclasses.replace(config, resume_from_checkpoint=True)) == tmp_path / "checkpoint-4"
    (tmp_path / "final").mkdir()  # not written by dllm-ais: a fresh run would replace it, so it refuses
    (tmp_path / "final" / "model.bin").write_text("mine")
    with pytest.raises(ConfigError, match="final that dllm-ais did not write"):
        prepare_output_dir(dataclasses.replace(config, overwrite_output_dir=True))
    os.rename(tmp_path / "final", tmp_path / "my-final")
    assert prepare_output_dir(dataclasses.replace(config, overwrite_output_dir=True)) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, LOCK_FILE, "my-final", "notes.txt"]


def test_overwrite_rewrites_a_runs_files_only_in_a_directory_a_run_marked(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("mine")  # a name a run writes, in a directory no run has marked
    config = GRPOConfig(output_dir=str(project), overwrite_output_dir=True)
    with pytest.raises(ConfigError, match="config.yaml that dllm-ais did not write"):
        prepare_output_dir(config)
    os.rename(project / "config.yaml", project / "my-config.yaml")
    assert prepare_output_dir(config) is None and provenance(project)["run_directory"] is True
    (project / "metrics.jsonl").write_text("{}\n")  # the run's own files: a later overwrite may rewrite them
    assert prepare_output_dir(config) is None
    with pytest.raises(OutputExistsError, match="output_dir of a training run"):  # export/sft never replace it
        check_destination(project, overwrite=True)


def test_a_rerun_drops_the_replaced_runs_held_out_record_and_refuses_one_it_did_not_write(tmp_path):
    """held_out.json marks a finished run (what `dllm-ais compare` reuses): a rerun over a run must not keep it."""
    config = GRPOConfig(output_dir=str(tmp_path / "run"), overwrite_output_dir=True)
    assert prepare_output_dir(config) is None
    (tmp_path / "run" / HELD_OUT_FILE).write_text("{}")
    assert prepare_output_dir(config) is None and not (tmp_path / "run" / HELD_OUT_FILE).exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / HELD_OUT_FILE).write_text("{}")
    with pytest.raises(ConfigError, match=f"{HELD_OUT_FILE} that dllm-ais did not write"):
        prepare_output_dir(dataclasses.replace(config, output_dir=str(tmp_path / "mine")))

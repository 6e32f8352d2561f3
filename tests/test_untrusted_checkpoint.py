"""Inference never trusts the checkpoint it loads: a downloaded model directory whose saved config asks for
`trust_remote_code: true` and an importable reward (`evil_module:run`), and whose config.json / tokenizer_config.json
point at its own Python code, runs none of it under `eval`, `generate` or `export`."""
import json
import logging
import shutil
import sys

import pytest
import torch
import yaml

from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODEL_DIR
from dllm_ais.loading import load_model
from dllm_ais.rewards import resolve_reward_functions

PAYLOAD = "from pathlib import Path\nPath({marker!r}).write_text('ran')\n\ndef run(prompts, completions, **kw):\n    return [9.0] * len(completions)\n"


def write_checkpoint(directory, markers, model_type: str):
    """A copy of the embedded model whose configs point at its own code and whose saved training config asks for
    trust_remote_code and an importable reward."""
    shutil.copytree(EMBEDDED_MODEL_DIR, directory)
    (directory / "evil_modeling.py").write_text(PAYLOAD.format(marker=str(markers["remote_code"])))
    (directory / "evil_module.py").write_text(PAYLOAD.format(marker=str(markers["reward"])))
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "evil_modeling.EvilConfig", "AutoModelForCausalLM": "evil_modeling.EvilModel"}
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["evil_modeling.EvilTokenizer", None]}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    saved = yaml.safe_load((directory / "recipe.yaml").read_text())
    saved.update(trust_remote_code=True, reward_funcs=["evil_module:run"], reward_weights=[1.0])
    (directory / "dllm_ais_config.yaml").write_text(yaml.safe_dump(saved))
    return directory


@pytest.fixture
def markers(tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic_modules

    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    # the worst case: the checkpoint directory is importable (it is the working directory, on sys.path)
    monkeypatch.syspath_prepend(str(tmp_path / "downloaded-model"))
    monkeypatch.chdir(tmp_path)
    yield {"remote_code": tmp_path / "remote_code_ran", "reward": tmp_path / "reward_module_ran"}
    sys.modules.pop("evil_module", None)  # each test imports its own copy


def commands(directory, tmp_path) -> list[list[str]]:
    return [["eval", "--model", str(directory), "--limit=2", "--output", str(tmp_path / "eval.json")],
            ["generate", "--model", str(directory), "--prompt", "sort 2 1"],
            ["export", str(directory), str(tmp_path / "exported")]]


def test_eval_generate_and_export_import_no_reward_from_the_checkpoint(tmp_path, markers, caplog):
    directory = write_checkpoint(tmp_path / "downloaded-model", markers, model_type="llada")
    with caplog.at_level(logging.WARNING):
        for command in commands(directory, tmp_path):
            assert main(command) == 0
    assert not markers["remote_code"].exists() and not markers["reward"].exists()
    assert "ignoring trust_remote_code and reward_funcs ['evil_module:run']" in caplog.text
    report = json.loads((tmp_path / "eval.json").read_text())
    assert set(report["results"][0]["rewards"]) == {"digits_reward"}  # the task preset replaced the import
    resolve_reward_functions(["evil_module:run"])  # control: the payload is live
    assert markers["reward"].exists()


def test_trust_remote_code_in_a_saved_config_is_not_honoured(tmp_path, markers, capsys):
    directory = write_checkpoint(tmp_path / "downloaded-model", markers, model_type="evil_architecture")
    for command in commands(directory, tmp_path):
        assert main(command) == 2  # refused: unknown code, in one line naming the directory and the setting
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and str(directory) in error[0], error
        assert "evil_architecture" in error[0] and "trust_remote_code" in error[0]
    assert main(["train", f"--model_name_or_path={directory}", f"--output_dir={tmp_path / 'run'}"]) == 2
    assert "evil_architecture" in capsys.readouterr().err
    assert not markers["remote_code"].exists() and not markers["reward"].exists()
    with pytest.raises(Exception):  # noqa: B017 - control: with the flag the payload runs (it defines no model)
        load_model(str(directory), torch.float32, trust_remote_code=True)
    assert markers["remote_code"].exists()


def test_code_loading_settings_come_from_the_command_line(tmp_path, markers):
    directory = write_checkpoint(tmp_path / "downloaded-model", markers, model_type="llada")
    assert main(["eval", "--model", str(directory), "--limit=2", "--output", str(tmp_path / "eval.json"),
                 "--reward_funcs=[evil_module:run]"]) == 0
    assert markers["reward"].exists()  # the user asked for it explicitly
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["results"][0]["rewards"] == {"run": 9.0}


# ------------------------------------------------------------------------------------------ resuming a checkpoint
class Payload:
    """Unpickling this creates a file: the stand-in for code a tampered checkpoint would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tokenizer):
    """A one-step run with its checkpoint-1, and the RunState it holds."""
    from test_trainer import make_trainer

    output_dir = tmp_path_factory.mktemp("saved") / "run"
    trainer = make_trainer(tokenizer, output_dir, max_steps=1, save_steps=1)
    trainer.train()
    return output_dir / "checkpoint-1", trainer.run_state()


def resume(tokenizer, checkpoint, tmp_path):
    from test_trainer import make_trainer

    return make_trainer(tokenizer, tmp_path / "resumed", max_steps=2, resume_from_checkpoint=str(checkpoint))


def test_a_file_swapped_between_its_check_and_its_load_is_never_loaded(saved_run, tokenizer, tmp_path, monkeypatch):
    """The race: every pickle of the checkpoint is replaced by a payload right after the checkpoint verified. The
    resume loads the bytes it verified (all through weights_only loads of in-memory bytes) and continues exactly."""
    import io

    import dllm_ais.checkpoint as checkpoint_module

    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(saved_run[0], checkpoint)
    marker, verified = tmp_path / "pwned", checkpoint_module.read_verified

    def verify_then_swap(directory):
        files = verified(directory)
        for name in files:
            if name.endswith((".pkl", ".bin")):
                torch.save({"state": Payload(marker)}, checkpoint / name)
        return files

    loads, real_load = [], torch.load
    monkeypatch.setattr(checkpoint_module, "read_verified", verify_then_swap)
    monkeypatch.setattr(torch, "load", lambda file, *a, **kw: loads.append((file, kw)) or real_load(file, *a, **kw))
    trainer = resume(tokenizer, checkpoint, tmp_path)
    assert not marker.exists()
    assert loads and all(isinstance(file, io.BytesIO) and kw.get("weights_only") is True for file, kw in loads)
    expected = saved_run[1]
    assert trainer.global_step == expected.global_step == 1 and trainer.run_id == expected.run_id
    assert torch.equal(trainer.prompt_order, expected.prompt_order)
    torch.load(checkpoint / "optimizer.bin", weights_only=False)  # control: the swapped file holds the live payload
    assert marker.exists()


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                                  "adapter_model.bin"])
def test_a_pickle_holding_code_is_refused_in_one_line_naming_the_file(saved_run, tokenizer, tmp_path, name):
    """The tamperer rewrites the manifest too (the hashes then verify): the weights-only load refuses the payload;
    pickled weights are never loaded at all."""
    from dllm_ais.config import ConfigError
    from dllm_ais.run_dir import record_manifest

    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(saved_run[0], checkpoint)
    if name == "adapter_model.bin":
        (checkpoint / "adapter_model.safetensors").unlink()
    torch.save({"state": Payload(tmp_path / "pwned")}, checkpoint / name)
    record_manifest(checkpoint)
    with pytest.raises(ConfigError) as refused:
        resume(tokenizer, checkpoint, tmp_path)
    message = str(refused.value)
    assert "\n" not in message and str(checkpoint / name) in message, message
    assert not (tmp_path / "pwned").exists()


def test_random_states_that_do_not_load_are_an_error_never_a_silent_fallback(saved_run, tokenizer, tmp_path):
    from dllm_ais.config import ConfigError
    from dllm_ais.run_dir import record_manifest

    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(saved_run[0], checkpoint)
    torch.save({"random_state": "not a state", "step": 1}, checkpoint / "random_states_0.pkl")
    record_manifest(checkpoint)
    with pytest.raises(ConfigError, match=r"random_states_0.pkl: its random states do not load \(ValueError"):
        resume(tokenizer, checkpoint, tmp_path)

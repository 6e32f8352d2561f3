"""No code from a model directory, ever: a downloaded model whose tokenizer_config.json or config.json names a
Python file beside it through `auto_map` is refused in one line naming that file — before transformers could ask
at the terminal — by every command that loads a model, even when a terminal answers "y" to every question; only
the user's own `--trust_remote_code=true` runs it. lm-eval's arguments parse strictly (`trust_remote_code=no` is
false) and a bad one is one line before anything loads; adapters that name each other as base are one line too."""
import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dllm_ais
from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODEL_DIR, ConfigError
from dllm_ais.loading import load_model, load_tokenizer

PAYLOAD = """from pathlib import Path
Path({sentinel!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""
TASK = """task: attack_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""
PROMPT = "Do you wish to run the custom code"


def evil_model(tmp_path: Path, where: str) -> tuple[Path, Path]:
    """A copy of the embedded LLaDA whose `where` file (tokenizer_config.json, or config.json with a model_type no
    library provides) names `evil.py` beside it through auto_map; importing evil.py writes the sentinel file.
    Returns (the model directory, the file its code is named in)."""
    directory, sentinel = tmp_path / "downloaded-model", tmp_path / "code_ran"
    shutil.copytree(EMBEDDED_MODEL_DIR, directory)
    (directory / "evil.py").write_text(PAYLOAD.format(sentinel=str(sentinel)))
    named_in = directory / where
    values = json.loads(named_in.read_text())
    if where == "tokenizer_config.json":
        values.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    else:
        values.update(model_type="evil_architecture",
                      auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    named_in.write_text(json.dumps(values))
    return directory, named_in


def run_cli(arguments: list[str], tmp_path: Path, answer_yes: bool = True) -> subprocess.CompletedProcess:
    """`dllm-ais ARGUMENTS` in a child process whose stdin is a terminal holding "y" answers to any question asked
    (or, without `answer_yes`, no stdin at all), in `tmp_path`."""
    package_root = str(Path(dllm_ais.__file__).parents[1])
    environment = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1",
                   "HF_DATASETS_OFFLINE": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "dllm_ais.cli", *arguments]
    if not answer_yes:
        return subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=environment,
                              cwd=tmp_path, timeout=600)
    controller, terminal = pty.openpty()
    try:
        os.write(controller, b"y\n" * 8)
        return subprocess.run(command, stdin=terminal, capture_output=True, text=True, env=environment,
                              cwd=tmp_path, timeout=600)
    finally:
        os.close(terminal)
        os.close(controller)


def local_task(tmp_path: Path) -> list[str]:
    """lm-eval arguments selecting a two-question multiple-choice task over a local file."""
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": question, "choices": [answer, answer[::-1]]}) + "\n"
                            for question, answer in (("sort 2 1", "1 2"), ("reverse 3 4", "4 3"))))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    return ["--tasks", "attack_task", "--include_path", str(tmp_path), "--limit", "2"]


def commands(directory: Path, tmp_path: Path) -> dict[str, list[str]]:
    """Each command that loads a model, on `directory`."""
    return {
        "eval": ["eval", "--model", str(directory), "--limit=2", "--output", str(tmp_path / "eval.json")],
        "generate": ["generate", "--model", str(directory), "--prompt", "sort 2 1"],
        "export": ["export", str(directory), str(tmp_path / "exported")],
        "train": ["train", f"--model_name_or_path={directory}", f"--output_dir={tmp_path / 'run'}", "--max_steps=1"],
        "sft": ["sft", "--model", str(directory), "--output_dir", str(tmp_path / "sft"), "--steps=1"],
        "lm-eval": ["lm-eval", "--model_args", f"pretrained={directory}", *local_task(tmp_path)],
    }


def assert_refused_in_one_line(result: subprocess.CompletedProcess, named_in: Path) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert PROMPT not in output and "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(named_in) in errors[0] and "--trust_remote_code=true" in errors[0], output


SLOW = pytest.mark.slow  # one child process (a few seconds) each: the first case of each attack runs in the fast tier


@pytest.mark.parametrize("command", ["eval"] + [pytest.param(command, marks=SLOW)
                                                for command in ("generate", "export", "train", "sft", "lm-eval")])
@pytest.mark.slow
def test_a_tokenizer_naming_its_own_code_is_refused_though_the_terminal_says_yes(tmp_path, command):
    directory, named_in = evil_model(tmp_path, "tokenizer_config.json")
    result = run_cli(commands(directory, tmp_path)[command], tmp_path)
    assert not (tmp_path / "code_ran").exists()
    assert_refused_in_one_line(result, named_in)


@pytest.mark.parametrize("command", ["eval", pytest.param("lm-eval", marks=SLOW)])
@pytest.mark.slow
def test_an_unknown_architecture_naming_its_own_code_is_refused_before_anything_runs(tmp_path, command):
    directory, named_in = evil_model(tmp_path, "config.json")
    result = run_cli(commands(directory, tmp_path)[command], tmp_path)
    assert not (tmp_path / "code_ran").exists()
    assert_refused_in_one_line(result, named_in)
    assert "evil_architecture" in result.stderr


@SLOW
def test_lm_eval_trust_remote_code_no_is_false(tmp_path):
    """Non-interactive: `no` used to reach from_pretrained as a true string and run the code without a question."""
    directory, named_in = evil_model(tmp_path, "config.json")
    arguments = ["lm-eval", "--model_args", f"pretrained={directory},trust_remote_code=no", *local_task(tmp_path)]
    result = run_cli(arguments, tmp_path, answer_yes=False)
    assert not (tmp_path / "code_ran").exists()
    assert_refused_in_one_line(result, named_in)


@pytest.mark.slow
def test_the_users_own_flag_runs_the_code(tmp_path):
    """Control: the payload is live, and the user's own --trust_remote_code=true is what runs it."""
    directory, _ = evil_model(tmp_path, "tokenizer_config.json")
    result = run_cli([*commands(directory, tmp_path)["eval"], "--trust_remote_code=true"], tmp_path,
                     answer_yes=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "code_ran").exists()


# ------------------------------------------------------------------------------------------ lm-eval's arguments
@pytest.mark.parametrize("word, value", [("true", True), ("YES", True), ("on", True), ("1", True), (1, True),
                                         ("false", False), ("No", False), ("off", False), ("0", False), (0, False)])
def test_lm_eval_booleans_parse_strictly(word, value):
    from dllm_ais.lm_eval_arguments import ModelArguments

    arguments = ModelArguments.parse({"trust_remote_code": word, "is_check_greedy": word})
    assert arguments.trust_remote_code is value and arguments.is_check_greedy is value


@pytest.mark.parametrize("model_args, named", [
    ("steps=-3", "steps=-3"),
    *[pytest.param(*case, marks=SLOW) for case in (
        ("trust_remote_code=maybe", "trust_remote_code='maybe'"),
        ("seed=abc", "seed='abc'"),
        ("temperature=0.5", "unknown argument 'temperature'"),
        (f"device_map=cuda:{max(3, torch.cuda.device_count())}", "device_map="))],
])
@pytest.mark.slow
def test_a_bad_lm_eval_argument_is_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys, model_args,
                                                                   named):
    pytest.importorskip("lm_eval")
    import dllm_ais.lm_eval_model as harness_model

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(harness_model, "load_model", never)
    monkeypatch.setattr(harness_model, "load_tokenizer", never)
    assert main(["lm-eval", "--model_args", f"pretrained=embedded,{model_args}", *local_task(tmp_path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], errors


# ------------------------------------------------------------------------------------------ adapters
@pytest.fixture
def adapter(tmp_path):
    """A real LoRA adapter on the embedded Qwen3 with its tokenizer (as `dllm-ais train` writes final/), in
    tmp_path/a."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model("embedded-qwen3", torch.float32), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "a", save_embedding_layers=False)
    load_tokenizer("embedded-qwen3").save_pretrained(tmp_path / "a")
    return tmp_path / "a"


def set_base(adapter_dir: Path, base: Path) -> None:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("cycle", ["itself", "a-b-a"])
def test_adapters_naming_each_other_as_base_are_one_line(adapter, tmp_path, capsys, cycle):
    if cycle == "itself":
        set_base(adapter, adapter)
    else:
        shutil.copytree(adapter, tmp_path / "b")
        set_base(adapter, tmp_path / "b")
        set_base(tmp_path / "b", adapter)
    with pytest.raises(ConfigError, match="adapter_config.json: its base_model_name_or_path leads back"):
        load_model(str(adapter), torch.float32)
    assert main(["eval", "--model", str(adapter), "--limit=2", "--output", str(tmp_path / "eval.json")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "adapter_config.json" in error[0], error


def test_an_adapter_on_a_base_naming_its_own_code_is_refused(adapter, tmp_path):
    """The base an adapter names is checked as the model itself is (the adapter loads it first)."""
    directory, named_in = evil_model(tmp_path, "tokenizer_config.json")
    set_base(adapter, directory)
    with pytest.raises(ConfigError) as refused:
        load_model(str(adapter), torch.float32)
    assert str(named_in) in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "code_ran").exists()


def test_every_load_of_a_model_file_goes_through_the_guard():
    """Every from_pretrained call of the package (transformers' Auto classes, peft) is in dllm_ais/loading.py, whose
    loaders run `refuse_remote_code` first and pass trust_remote_code explicitly."""
    import ast

    package = Path(dllm_ais.__file__).parent
    calls = [f"{path.relative_to(package)}:{node.lineno}" for path in sorted(package.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "from_pretrained"]
    assert calls and all(call.startswith("loading.py:") for call in calls), calls

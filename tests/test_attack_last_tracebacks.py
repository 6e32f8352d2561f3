"""The last tracebacks of issue 62 (item 4), each attack run as a user would, each answered by one line naming the
file (or setting) and the fix: pickled model or adapter weights, a chat template Jinja's sandbox refuses, Ctrl-C
while the libraries import, and an SDAR model whose block size does not divide the eval protocol's gen length."""

import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODEL_DIR

SANDBOX_ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
CTRL_C_ON_IMPORT = """\
import sys

class CtrlC:  # the user's Ctrl-C while the libraries import: the first import of torch raises it
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
from dllm_ais.cli import main
sys.exit(main(sys.argv[1:]))
"""


def embedded_copy(tmp_path):
    """A copy of the embedded tiny LLaDA's directory."""
    return shutil.copytree(EMBEDDED_MODEL_DIR, tmp_path / "model")


def pickled(file, name):
    """Replace the safetensors `file` by the same tensors pickled (as torch.save writes them) in the file `name`."""
    from safetensors.torch import load_file

    torch.save(load_file(file), file.with_name(name))
    file.unlink()


def only_line(stderr):
    """The single line a refused command printed on stderr (import notes aside)."""
    lines = [line for line in stderr.splitlines() if line.startswith(("error:", "interrupted"))]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_model_with_only_pytorch_model_bin_is_refused_naming_the_file_and_the_conversion(tmp_path, capsys):
    model = embedded_copy(tmp_path)
    pickled(model / "model.safetensors", "pytorch_model.bin")
    assert main(["generate", "--model", str(model), "--prompt", "sort 3 1 2"]) == 2
    line = only_line(capsys.readouterr().err)
    assert line.startswith(f"error: {model / 'pytorch_model.bin'}: pickled weights, never loaded") and \
        "loads safetensors only" in line
    subprocess.run([sys.executable, *shlex.split(line.split("convert it: ")[1])[1:]], check=True)  # as advised
    assert main(["generate", "--model", str(model), "--prompt", "sort 3 1 2"]) == 0


def test_a_pickled_adapter_is_refused_naming_adapter_model_bin(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    from dllm_ais.loading import load_model, load_tokenizer

    adapter = tmp_path / "adapter"
    model = get_peft_model(load_model("embedded", torch.float32), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(adapter, safe_serialization=False, save_embedding_layers=False)
    load_tokenizer("embedded").save_pretrained(adapter)
    assert main(["generate", "--model", str(adapter), "--prompt", "sort 3 1 2"]) == 2
    assert only_line(capsys.readouterr().err).startswith(f"error: {adapter / 'adapter_model.bin'}: pickled weights")


def test_a_chat_template_the_sandbox_refuses_is_one_line_naming_its_file(tmp_path, capsys):
    model = embedded_copy(tmp_path)
    (model / "chat_template.jinja").write_text(SANDBOX_ESCAPE)
    assert main(["generate", "--model", str(model), "--prompt", "sort 3 1 2"]) == 2
    line = only_line(capsys.readouterr().err)
    assert line.startswith(f"error: {model / 'chat_template.jinja'}: the chat template does not render, the sandbox "
                           "refuses it (SecurityError: ") and line.endswith("replace it with the base model's template")


@pytest.mark.parametrize("command", [["train", "--resume_from_checkpoint"], ["eval", "--limit", "2"]])
def test_ctrl_c_while_the_libraries_import_is_one_line(tmp_path, command):
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_ON_IMPORT)
    process = subprocess.run([sys.executable, str(script), *command, f"--output_dir={tmp_path / 'run'}"],
                             capture_output=True, text=True, cwd=tmp_path)
    line = only_line(process.stderr)
    assert process.returncode == 130
    assert line == ("interrupted while dllm-ais train started, before the run began (its output_dir and checkpoints "
                    "are untouched): run the same command again" if command[0] == "train"
                    else "interrupted: dllm-ais eval stopped")


def test_an_sdar_made_with_block_size_3_then_evaluated_with_its_protocol_names_the_gen_lengths_that_fit(tmp_path,
                                                                                                        capsys):
    model = tmp_path / "sdar3"
    assert main(["sft", "--model", "embedded-qwen3", "--as_block_diffusion", "3", "--steps", "1", "--batch_size", "2",
                 "--output_dir", str(model)]) == 0
    assert main(["eval", "--model", str(model), "--protocol", "sdar", "--limit", "2"]) == 2
    assert only_line(capsys.readouterr().err) == ("error: the sdar protocol decodes in this model's blocks of "
                                                  "block_size=3: gen length 16 is not a multiple of it; pass "
                                                  "--gen_lengths 18")

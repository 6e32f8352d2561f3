"""Exports carry their provenance and load anywhere: the card, plain-transformers loading of LLaDA, one-commit push."""

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
import yaml

from dllm_ais.run_dir import MARKER
from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODELS, GRPOConfig, save_config
from dllm_ais.export import export_merged_model, model_card, portable_name
from dllm_ais.loading import load_model
from dllm_ais.policy import lora_target_modules

PROMPT_IDS = [[5, 17, 42, 9, 6, 6, 6, 6]]  # a prompt followed by mask tokens (id 6), as the sampler's canvas


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An adapter on the embedded LLaDA with non-zero LoRA weights, its training config, and an eval report of it in
    eval_results/ beside it (as `dllm-ais eval --model <adapter>` run from its parent would leave)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("trained")
    torch.manual_seed(0)
    model = get_peft_model(load_model("embedded", torch.float32),
                           LoraConfig(r=2, target_modules=lora_target_modules("llada"), init_lora_weights=False))
    adapter = root / "final"
    model.save_pretrained(adapter, save_embedding_layers=False)
    save_config(GRPOConfig(output_dir=str(root), rollout={"precision": "fp8"}, correction={"method": "ais"}),
                adapter / "dllm_ais_config.yaml")
    report = {"task": "digits", "split": "test", "model": {"id": str(adapter), "path": str(adapter.resolve())},
              "protocol": {"name": "d1", "temperature": 0.0, "block_length": 32}, "dtype": "float32",
              "rollout_precision": "bf16", "device": "cpu", "command": f"dllm-ais eval --model {adapter}",
              "results": [{"gen_length": 16, "num_prompts": 4, "accuracy": 0.25, "accuracy_se": 0.25, "reward": 0.5,
                           "rewards": {"digits_reward": 0.5}}]}
    (root / "eval_results").mkdir()
    (root / "eval_results" / "digits-final.json").write_text(json.dumps(report))
    with torch.no_grad():
        logits = model.merge_and_unload()(torch.tensor(PROMPT_IDS)).logits
    return adapter, logits


LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
path, out = sys.argv[1], sys.argv[2]
results = {}
for trust in (False, True):
    try:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust)
    except ValueError as error:
        results[str(trust)] = {"error": str(error)[:200]}
        continue
    with torch.no_grad():
        torch.save(model(torch.tensor(%r)).logits, f"{out}-{trust}.pt")
    results[str(trust)] = {"module": type(model).__module__}
print(json.dumps(results))
""" % (PROMPT_IDS,)

BLOCK_DLLM_AIS = """
import importlib.abc, sys
class NoDllmAis(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "dllm_ais":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, NoDllmAis())
"""


def fresh_python(code, *args, tmp_path):
    """Run `code` in a new interpreter (offline, its own transformers module cache); return its last stdout line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh Python processes load the export
def test_an_exported_llada_loads_in_fresh_pythons_with_dllm_ais_and_with_transformers_alone(trained, tmp_path):
    adapter, expected = trained
    merged = export_merged_model(adapter, tmp_path / "merged", torch.float32)
    config = json.loads((merged / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_llada.LLaDAModelLM"
    imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(ast.parse((merged / "modeling_llada.py").read_text()))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    assert {name.split(".")[0] for name in imported} == {"__future__", "dataclasses", "torch", "transformers"}

    native = fresh_python("import dllm_ais\n" + LOAD, merged, tmp_path / "native", tmp_path=tmp_path)
    # with dllm_ais imported, its registered class wins even when remote code is trusted
    assert native == {"False": {"module": "dllm_ais.models.llada"}, "True": {"module": "dllm_ais.models.llada"}}
    remote = fresh_python(BLOCK_DLLM_AIS + LOAD, merged, tmp_path / "remote", tmp_path=tmp_path)
    assert "custom code" in remote["False"]["error"]
    assert remote["True"]["module"].startswith("transformers_modules.") and remote["True"]["module"].endswith("modeling_llada")
    logits = {name: torch.load(tmp_path / name, weights_only=True)
              for name in ("native-False.pt", "native-True.pt", "remote-True.pt")}
    assert torch.equal(logits["native-False.pt"], logits["remote-True.pt"])
    assert torch.equal(logits["native-False.pt"], logits["native-True.pt"])
    torch.testing.assert_close(logits["native-False.pt"], expected)


def test_the_card_carries_base_recipe_and_eval_table_and_no_local_path(trained, tmp_path):
    adapter, _ = trained
    merged = export_merged_model(adapter, tmp_path / "merged", torch.float32)
    text = (merged / "README.md").read_text()
    metadata = yaml.safe_load(text.split("---")[1])
    assert metadata["base_model"] == "embedded" and metadata["library_name"] == "transformers"
    assert {"dllm-ais", "grpo", "rollout-fp8", "correction-ais", "llada"} <= set(metadata["tags"])
    assert "| rollout precision | `fp8` |" in text and "| likelihood estimator | `one_step` |" in text
    assert "| 16 | 25.0 | 25.0 | 0.500 | 0.500 |" in text and "digits-final.json" in text  # the report found beside it
    assert "trust_remote_code=True" in text and "import torch, dllm_ais" in text
    assert str(tmp_path) not in text and str(adapter.parent) not in text and "/tmp" not in text
    assert "output_dir" not in text  # run-only settings are not part of the recipe


def test_a_local_base_model_is_named_without_its_path(tmp_path):
    local = tmp_path / "models" / "my-llada"
    local.mkdir(parents=True)
    assert portable_name(str(local)) == "<local>/my-llada"
    assert portable_name("GSAI-ML/LLaDA-8B-Instruct") == "GSAI-ML/LLaDA-8B-Instruct"
    assert portable_name(str(EMBEDDED_MODELS["embedded"])) == "<local>/tiny_llada"
    card = str(model_card("me/model", portable_name(str(local)), remote=None, recipe=None, report=None,
                          report_name=None, source_name="final"))
    assert "base_model" not in card.split("---")[1] and str(tmp_path) not in card and "<local>/my-llada" in card


class RecordingHub:
    """Stands in for `huggingface_hub.HfApi`: records the calls; `fail` makes every call raise as offline."""

    calls: list = []
    fail = False

    def _call(self, name, *args, **kwargs):
        if self.fail:
            raise ConnectionError("Failed to resolve 'huggingface.co'\n(offline)")
        self.calls.append((name, args, kwargs))
        return type("Commit", (), {"commit_url": "https://huggingface.co/me/model/commit/1"})()

    def create_repo(self, *args, **kwargs):
        return self._call("create_repo", *args, **kwargs)

    def upload_folder(self, *args, **kwargs):
        return self._call("upload_folder", *args, **kwargs)


def test_push_to_hub_uploads_once_and_offline_says_the_copy_is_complete_and_how_to_push(trained, tmp_path,
                                                                                         monkeypatch, capsys):
    import huggingface_hub

    adapter, _ = trained
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHub)
    monkeypatch.setattr(RecordingHub, "calls", [])
    monkeypatch.setattr(RecordingHub, "fail", True)
    output = tmp_path / "merged"
    argv = ["export", str(adapter), str(output), "--dtype", "float32", "--push_to_hub", "me/model", "--private"]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error and f"the export in {output} is complete" in error and "ConnectionError" in error
    assert f"hf upload me/model {output} . --exclude {MARKER} --private" in error and "upload_folder(" in error
    assert (output / "model.safetensors").is_file() and (output / "README.md").is_file()

    monkeypatch.setattr(RecordingHub, "fail", False)
    assert main([*argv, "--overwrite"]) == 0
    assert "pushed to me/model" in capsys.readouterr().out
    assert [name for name, _, _ in RecordingHub.calls] == ["create_repo", "upload_folder"]  # one upload, one commit
    (_, args, kwargs), (_, _, upload) = RecordingHub.calls
    assert args == ("me/model",) and kwargs["private"] is True
    assert upload["folder_path"] == output and upload["repo_id"] == "me/model" and MARKER in upload["ignore_patterns"]
    assert 'from_pretrained("me/model"' in (output / "README.md").read_text()


@pytest.mark.slow  # a fresh Python process loads the export
def test_an_exported_dream_loads_with_transformers_alone(tmp_path):
    from transformers import AutoTokenizer

    from dllm_ais.models import DreamConfig, DreamModel

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODELS["embedded"])
    torch.manual_seed(0)
    model = DreamModel(DreamConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   mask_token_id=tokenizer.mask_token_id, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(tmp_path / "dream")
    tokenizer.save_pretrained(tmp_path / "dream")
    merged = export_merged_model(tmp_path / "dream", tmp_path / "merged", torch.float32)
    config = json.loads((merged / "config.json").read_text())
    assert config["model_type"] == "Dream" and config["auto_map"]["AutoModelForCausalLM"] == "modeling_dream.DreamModel"
    assert "masked-diffusion" in (merged / "README.md").read_text() and (merged / "llada.py").is_file()
    remote = fresh_python(BLOCK_DLLM_AIS + LOAD, merged, tmp_path / "remote", tmp_path=tmp_path)
    assert "custom code" in remote["False"]["error"]
    assert remote["True"]["module"].endswith("modeling_dream")
    with torch.no_grad():
        expected = model(torch.tensor(PROMPT_IDS)).logits
    torch.testing.assert_close(torch.load(tmp_path / "remote-True.pt", weights_only=True), expected)


@pytest.mark.slow  # two fresh Python processes load the export
def test_an_exported_sdar_loads_with_transformers_alone_and_natively(official_sdar_dir, tmp_path):
    """The official fixture (written by JetLM's code, its auto_map naming their configuration_sdar/modeling_sdar)
    exported: our modeling_sdar.py and the modules it imports ship with an auto_map naming them, so transformers alone
    loads it with trust_remote_code=True, and with dllm_ais imported the native class loads it, remote code or not;
    the logits are the fixture's."""
    source = official_sdar_dir
    merged = export_merged_model(source, tmp_path / "merged", torch.float32)
    config = json.loads((merged / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["auto_map"] == {
        "AutoConfig": "modeling_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}
    assert config["block_size"] == 4 and config["mask_token_id"] == 271
    assert {path.name for path in merged.glob("*.py")} == {"modeling_sdar.py", "dream.py", "llada.py", "families.py"}

    native = fresh_python("import dllm_ais\n" + LOAD, merged, tmp_path / "native", tmp_path=tmp_path)
    assert native == {"False": {"module": "dllm_ais.models.sdar"}, "True": {"module": "dllm_ais.models.sdar"}}
    remote = fresh_python(BLOCK_DLLM_AIS + LOAD, merged, tmp_path / "remote", tmp_path=tmp_path)
    assert "custom code" in remote["False"]["error"]
    assert remote["True"]["module"].startswith("transformers_modules.")
    assert remote["True"]["module"].endswith("modeling_sdar")
    with torch.no_grad():
        expected = load_model(str(source), torch.float32).eval()(torch.tensor(PROMPT_IDS)).logits
    for name in ("native-False.pt", "native-True.pt", "remote-True.pt"):
        assert torch.equal(torch.load(tmp_path / name, weights_only=True), expected), name


@pytest.mark.slow  # two fresh Python processes load the export
def test_an_exported_llada2_loads_with_transformers_alone_and_natively(official_llada2_dir, tmp_path):
    """The official LLaDA2 fixture (inclusionAI's code wrote it: per-expert keys) exported: our modeling_llada2_moe.py
    and the modules it imports ship with an auto_map naming them, and the checkpoint keeps the official per-expert
    keys, so transformers alone loads it with trust_remote_code=True — the remote module itself registers the expert
    conversion — and with dllm_ais imported the native class does; the logits are the fixture's."""
    merged = export_merged_model(official_llada2_dir, tmp_path / "merged", torch.float32)
    config = json.loads((merged / "config.json").read_text())
    assert config["model_type"] == "llada2_moe" and config["auto_map"] == {
        "AutoConfig": "modeling_llada2_moe.LLaDA2MoeConfig", "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}
    assert {path.name for path in merged.glob("*.py")} == {"modeling_llada2_moe.py", "sdar.py", "dream.py",
                                                           "llada.py", "families.py"}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in load_file(merged / "model.safetensors")

    native = fresh_python("import dllm_ais\n" + LOAD, merged, tmp_path / "native", tmp_path=tmp_path)
    assert native == {"False": {"module": "dllm_ais.models.llada2"}, "True": {"module": "dllm_ais.models.llada2"}}
    remote = fresh_python(BLOCK_DLLM_AIS + LOAD, merged, tmp_path / "remote", tmp_path=tmp_path)
    assert "custom code" in remote["False"]["error"]
    assert remote["True"]["module"].endswith("modeling_llada2_moe")
    with torch.no_grad():
        expected = load_model(str(official_llada2_dir), torch.float32).eval()(torch.tensor(PROMPT_IDS)).logits
    for name in ("native-False.pt", "native-True.pt", "remote-True.pt"):
        assert torch.equal(torch.load(tmp_path / name, weights_only=True), expected), name


def test_an_exported_sdar_generates_in_its_own_blocks_as_eval_decodes_it(tmp_path, capsys):
    """The export ships no recipe: generate takes SDAR's decoding from the model (its 4-token blocks), not the
    embedded LLaDA recipe's 16-token blocks, as eval does; rollout settings on the command line still apply."""
    merged = tmp_path / "sdar"
    assert main(["export", str(EMBEDDED_MODELS["embedded-sdar"]), str(merged)]) == 0
    assert main(["generate", "--model", str(merged), "--prompt", "sort 3 9 1 4"]) == 0
    assert main(["generate", "--model", str(merged), "--prompt", "sort 3 9 1 4", "--rollout.block_length", "8"]) == 2
    assert "block_length=8 differs from the model's block_size=4" in capsys.readouterr().err

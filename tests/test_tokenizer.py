"""Tests for the tiny character-level LLaDA tokenizer shipped in dllm_ais/assets/tiny_llada."""
import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import dllm_ais
from dllm_ais.tasks.digits import make_digits_dataset

ASSET_DIR = Path(dllm_ais.__file__).parent / "assets" / "tiny_llada"
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "build_tokenizer.py"
PRINTABLE_ASCII = "".join(chr(code) for code in range(32, 127))
LLADA_SPECIAL_TOKENS = [
    "<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|mdm_mask|>",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSET_DIR)


def load_build_script():
    spec = importlib.util.spec_from_file_location("build_tokenizer", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loads_offline_with_llada_special_tokens(tokenizer):
    assert len(tokenizer) <= 128
    assert tokenizer.bos_token == "<|startoftext|>"
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.mask_token == "<|mdm_mask|>"
    assert tokenizer.unk_token == "<|unk|>"
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in LLADA_SPECIAL_TOKENS + ["<|unk|>"]}
    assert len(set(ids.values())) == len(ids) and all(0 <= i < len(tokenizer) for i in ids.values())
    assert tokenizer.mask_token_id == ids["<|mdm_mask|>"]
    assert tokenizer.bos_token_id == ids["<|startoftext|>"]
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == ids["<|endoftext|>"]
    assert set(ids.values()) <= set(tokenizer.all_special_ids)
    for token, token_id in ids.items():
        assert tokenizer.encode(token) == [token_id]


def test_chat_template_is_llama3_style(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 3 9 1 4"}]
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    expected = (
        "<|startoftext|>"
        + header.format("system") + "be brief<|eot_id|>"
        + header.format("user") + "sort 3 9 1 4<|eot_id|>"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        expected + header.format("assistant")
    )


def test_round_trips_task_text_one_token_per_character(tokenizer):
    texts = [message[0]["content"] for message in make_digits_dataset(50, seed=0)["prompt"]]
    texts += ["1 3 4 9", "system user assistant\n\n", PRINTABLE_ASCII + "\n\t"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert len(ids) == len(text), "one token per character, no BOS added"
        assert tokenizer.decode(ids) == text
        assert tokenizer.unk_token_id not in ids


def test_chat_prompt_round_trips_and_completion_decodes_without_specials(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "reverse 3 9 1 4"}], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(tokenizer.encode(prompt)) == prompt
    completion_ids = tokenizer.encode("1 3 4 9<|eot_id|><|endoftext|><|endoftext|>")
    end_of_turn_id = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert completion_ids[-3:] == [end_of_turn_id, tokenizer.eos_token_id, tokenizer.eos_token_id]
    assert tokenizer.decode(completion_ids, skip_special_tokens=True) == "1 3 4 9"


def test_unknown_characters_map_to_unk(tokenizer):
    assert tokenizer.encode("é") == [tokenizer.unk_token_id]
    assert tokenizer.decode(tokenizer.encode("1é2"), skip_special_tokens=True) == "12"


def test_build_script_reproduces_the_shipped_files(tmp_path):
    load_build_script().build_hf_tokenizer().save_pretrained(tmp_path)
    built = sorted(path.name for path in tmp_path.iterdir())
    assert built and all((ASSET_DIR / name).is_file() for name in built)
    for name in built:
        assert (tmp_path / name).read_bytes() == (ASSET_DIR / name).read_bytes(), f"{name} is stale: rerun the script"

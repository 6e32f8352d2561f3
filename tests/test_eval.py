"""The evaluation stage and `dllm-ais eval`: per-prompt results in dataset order, d1's protocol, the JSON report
and markdown table, on the embedded digits task and on local files in each hub dataset's schema."""
import dataclasses
import json
import math
import platform
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODELS, GRPOConfig, load_config
from dllm_ais.data import load_task_dataset
from dllm_ais.evaluation import EvalProtocol, evaluate_policy
from dllm_ais.statistics import standard_error
from dllm_ais.loading import MALLOC_VARIABLES, keep_freed_host_memory, load_tokenizer
from dllm_ais.policy import build_policy
from dllm_ais.sampling.rollout import Rollout
from dllm_ais.tasks import get_task
from dllm_ais.trainer import GRPOTrainer

ROOT = Path(__file__).parents[1]

DATA = Path(__file__).parent / "data"
HUB_SCHEMA_FILES = {task: task for task in ("gsm8k", "math500", "countdown", "sudoku")}  # directories: test.<ext>


class ScriptedPolicy:
    """A policy whose completions are given texts, handed out in order (one per prompt)."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts = tokenizer, list(texts)

    def sample(self, model, input_ids, attention_mask, generator, forwards=None):
        texts, self.texts = self.texts[:len(input_ids)], self.texts[len(input_ids):]
        ids = [self.tokenizer(text, add_special_tokens=False).input_ids for text in texts]
        length = max(len(row) for row in ids)
        completion = torch.tensor([row + [self.tokenizer.pad_token_id] * (length - len(row)) for row in ids])
        mask = torch.tensor([[i < len(row) for i in range(length)] for row in ids])
        return Rollout(torch.cat([input_ids, completion], 1), torch.cat([attention_mask, torch.ones_like(mask)], 1),
                       mask, torch.zeros(mask.shape), torch.zeros_like(completion), input_ids.shape[1])


def test_evaluate_policy_keeps_every_prompts_values_in_dataset_order():
    tokenizer = load_tokenizer("embedded")
    dataset = load_task_dataset("digits", "validation", size=10, seed=0)
    answers = dataset["answer"]
    texts = [answer if index % 2 == 0 else "0" for index, answer in enumerate(answers)]
    task = get_task("digits")
    result = evaluate_policy(torch.nn.Linear(1, 1), tokenizer, ScriptedPolicy(tokenizer, texts), dataset,
                             list(task.reward_funcs), reward_weights=[2.0], batch_size=3, accuracy=task.accuracy)
    expected_accuracy = torch.tensor([1.0, 0.0] * 5)
    assert torch.equal(result.per_prompt_accuracy, expected_accuracy)
    digits = result.per_function["digits_reward"]
    assert digits.shape == (10,) and digits[::2].eq(1.0).all() and digits[1::2].lt(1.0).all()
    assert torch.allclose(result.per_prompt_reward, 2.0 * digits)
    summary = result.summary()
    assert summary["eval/accuracy"] == 0.5 and summary["eval/num_prompts"] == 10.0
    assert summary["eval/accuracy_se"] == pytest.approx(math.sqrt(0.5 * 0.5 / 9))  # sample SE of a 0/1 mean
    assert summary["eval/rewards/digits_reward/mean"] == pytest.approx(digits.mean().item())
    assert summary["eval/reward"] == pytest.approx(2.0 * digits.mean().item())
    assert summary["eval/rewards/digits_accuracy/timeouts"] == 0.0
    assert math.isnan(standard_error(torch.tensor([1.0])))


def test_the_protocol_is_d1s_for_real_tasks_and_the_embedded_recipes_for_digits():
    gsm8k, digits = EvalProtocol.for_task(get_task("gsm8k")), EvalProtocol.for_task(get_task("digits"))
    assert gsm8k == EvalProtocol((128, 256, 512), 32, 0.0)
    d1_sampler = {"remasking": "low_confidence", "schedule": "even", "cache": "none", "cache_dtype": "none",
                  "threshold": None, "cache_refresh_interval": None, "cfg_scale": 0.0, "editing_threshold": None}
    # a model trained with fast rollouts (AR order, cache, threshold, factor) or Dream's decoding is still scored by
    # LLaDA's own sampler
    trained_fast = GRPOConfig(max_completion_length=32, top_p=0.9,
                              experimental={"rollout_factor": 1.0, "rollout_position_temperature": 0.5},
                              rollout={"remasking": "left_to_right", "cache": "prefix", "cache_dtype": "fp8",
                                       "cfg_scale": 1.0, "schedule": "time_linear"})
    for protocol, config, gen_length, block_length in ((gsm8k, GRPOConfig(), 256, 32), (digits, trained_fast, 16, 16)):
        decoding = protocol.decoding(config, gen_length)
        assert decoding.max_completion_length == gen_length and decoding.experimental.rollout_factor is None
        assert dataclasses.asdict(decoding.rollout) == {"precision": config.rollout.precision,
                                                        "precision_flow": config.rollout.precision_flow,
                                                        "steps": gen_length // 2,
                                                        "block_length": block_length, **d1_sampler,
                                                        "compile": config.rollout.compile,  # how, not what, it decodes
                                                        "batch_size": config.rollout.batch_size,
                                                        "max_post_steps": config.rollout.max_post_steps}
    llada = AutoConfig.from_pretrained(EMBEDDED_MODELS["embedded"])
    sampler = build_policy(digits.decoding(trained_fast, 16), llada,
                           load_tokenizer("embedded"), temperature=0.0).sampler.config
    assert (sampler.remasking, sampler.cache, sampler.threshold, sampler.cfg_scale, sampler.steps) == (
        "low_confidence", "none", None, 0.0, 8)
    assert (sampler.schedule, sampler.position_temperature, sampler.top_p, sampler.top_k) == ("even", 0.0, 1.0, 0)
    custom = EvalProtocol.for_task(get_task("gsm8k"), gen_lengths=(64,), block_length=16)
    assert custom.gen_lengths == (64,) and custom.block_length == 16
    # for an autoregressive model the gen length is the number of new tokens
    qwen = AutoConfig.from_pretrained(EMBEDDED_MODELS["embedded-qwen3"])
    config = gsm8k.decoding(GRPOConfig(policy="autoregressive"), 512)
    policy = build_policy(config, qwen, load_tokenizer("embedded-qwen3"), temperature=0.0)
    assert policy.sampler.config.max_new_tokens == 512 and policy.sampler.config.temperature == 0.0


def test_eval_on_the_embedded_digits_task_writes_the_report_and_table(tmp_path, capsys):
    output = tmp_path / "digits.json"
    assert main(["eval", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(output.read_text())
    assert report["task"] == "digits" and report["split"] == "test" and report["full_split"] is True
    assert report["protocol"] == {"name": "d1", "gen_lengths": [16], "block_length": 16, "temperature": 0.0,
                                  "remasking": "low_confidence", "schedule": "even", "cache": "none", "cache_dtype": "none",
                                  "threshold": None, "cache_refresh_interval": None, "cfg_scale": 0.0,
                                  "editing_threshold": None, "steps": "gen_length / 2", "batch_size": 128}
    (entry,) = report["results"]
    assert entry["num_prompts"] == len(load_task_dataset("digits", "test")) == 500
    accuracy = torch.tensor(entry["per_prompt"]["accuracy"])
    assert entry["accuracy"] == pytest.approx(accuracy.mean().item())
    assert entry["accuracy_se"] == pytest.approx(standard_error(accuracy))
    assert 0 < entry["accuracy"] < 1 and set(entry["rewards"]) == {"digits_reward"}
    rewards = torch.tensor(entry["per_prompt"]["reward"])
    assert rewards[accuracy == 1].eq(1.0).all()  # an exact answer gets full credit
    assert report["model"]["id"] == "embedded" and len(report["model"]["content_sha256"]) == 64
    assert report["dataset"]["generated"] == "digits" and report["dataset"]["num_rows"] == 500
    assert report["seed"] == 0 and report["dtype"] == "float32" and report["rollout_precision"] == "bf16"
    assert report["device"].startswith("cpu") and report["versions"]["torch"] == torch.__version__
    assert report["command"] == f"dllm-ais eval --output {output}"
    table = output.with_suffix(".md").read_text()
    assert table in printed and f"| 16 | {100 * entry['accuracy']:.1f} | {100 * entry['accuracy_se']:.1f} |" in table
    with pytest.raises(SystemExit, match="already exists"):  # never overwrites, and says so before loading a model
        main(["eval", "--output", str(output)])


def test_freed_host_memory_is_kept_on_cpu_under_glibc_unless_the_environment_sets_it(monkeypatch):
    for name in MALLOC_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not keep_freed_host_memory("meta")
    assert keep_freed_host_memory("cpu") == (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert not keep_freed_host_memory("cpu")


def test_eval_through_the_fp8_rollout_engine(tmp_path):
    output = tmp_path / "fp8.json"
    assert main(["eval", "--precision", "fp8", "--limit=4", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["rollout_precision"] == "fp8" and report["full_split"] is False
    assert report["results"][0]["num_prompts"] == 4


@pytest.mark.parametrize("task", sorted(HUB_SCHEMA_FILES))
def test_eval_on_local_rows_of_each_hub_schema(task, tmp_path):
    path, output = DATA / HUB_SCHEMA_FILES[task], tmp_path / f"{task}.json"
    assert main(["eval", f"--task={task}", f"--dataset_path={path}", "--gen_lengths=16", "--block_length=16",
                 "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    (entry,) = report["results"]
    rows = len(load_task_dataset(task, "test", path=path))
    assert entry["num_prompts"] == rows and len(entry["per_prompt"]["accuracy"]) == rows
    assert set(entry["rewards"]) == {fn.__name__ for fn in get_task(task).reward_funcs}
    assert 0.0 <= entry["accuracy"] <= 1.0 and report["protocol"]["name"] == "custom"
    assert report["dataset"]["path"] == str(path.resolve()) and report["dataset"]["num_rows"] == rows


REFERENCE_COMPLETIONS = {
    "gsm8k": lambda row: f"<reasoning>\n...\n</reasoning>\n<answer>\n{row['answer'].rsplit('####', 1)[1].strip()}\n</answer>",
    "math500": lambda row: f"so the answer is \\boxed{{{row['answer']}}}",
    "countdown": lambda row: "<answer>" + {44: "(25-3)*2", 5: "2*4-3", 24: "6*4*1"}[row["target"]] + "</answer>",
    "sudoku": lambda row: f"<answer>{row['solution']}</answer>",
}


@pytest.mark.parametrize("task", sorted(HUB_SCHEMA_FILES))
def test_the_shipped_rows_grade_reference_answers_as_correct(task):
    dataset = load_task_dataset(task, "test", path=DATA / HUB_SCHEMA_FILES[task])
    accuracy = get_task(task).accuracy
    rows = list(dataset)
    columns = {name: dataset[name] for name in dataset.column_names if name != "prompt"}
    assert accuracy(dataset["prompt"], [REFERENCE_COMPLETIONS[task](row) for row in rows], **columns) == [1.0] * len(rows)
    assert accuracy(dataset["prompt"], ["<answer>0</answer>"] * len(rows), **columns) == [0.0] * len(rows)


def test_the_trainer_scores_the_validation_split(tmp_path):
    config = GRPOConfig(eval_size=4, max_steps=1, num_generations=2, per_device_train_batch_size=2,
                        max_completion_length=16, max_prompt_length=64, dtype="float32", output_dir=str(tmp_path),
                        seed=3, rollout={"block_length": 16, "steps": 8})
    trainer = GRPOTrainer(config)
    expected = load_task_dataset("digits", "validation", size=4, seed=3)
    assert trainer.eval_dataset["prompt"] == expected["prompt"]
    result = trainer.evaluate()
    assert result.per_prompt_reward.shape == (4,) and result.per_prompt_accuracy.shape == (4,)


def test_the_dream_protocol_decodes_the_whole_completion_with_dreams_rule():
    from dllm_ais.decoding_protocols import with_dream_protocol

    config = load_config(ROOT / "recipes" / "dream7b_gsm8k_lora_fp8_ais.yaml")
    decoding = EvalProtocol.for_task(get_task("gsm8k"), (256,), name="dream").decoding(config, 256)
    assert decoding == with_dream_protocol(config, 256)
    rollout = decoding.rollout
    assert (rollout.block_length, rollout.steps, rollout.remasking, rollout.schedule, rollout.cache,
            decoding.top_p, decoding.max_completion_length) == (256, 256, "entropy", "time_linear", "none", 1.0, 256)
    assert EvalProtocol.for_task(get_task("gsm8k"), name="dream").to_dict()["steps"] == "gen_length"


def test_the_sdar_protocol_decodes_in_the_models_blocks_with_sdars_dynamic_rule():
    """SDAR's own generation: blocks of the model's block_size, as many steps per block as it has positions,
    low_confidence_dynamic (the drawn token's probability, maskgit_plus, above 0.9) with the exact cache; a model
    without blocks, or another block length, is refused in one line."""
    from dllm_ais.config import ConfigError
    from dllm_ais.decoding_protocols import with_sdar_protocol

    config = load_config(ROOT / "recipes" / "dream7b_gsm8k_lora_fp8_ais.yaml")
    protocol = EvalProtocol.for_task(get_task("gsm8k"), (256,), name="sdar", block_size=4)
    decoding = protocol.decoding(config, 256)
    assert decoding == with_sdar_protocol(config, 256, 4)
    rollout = decoding.rollout
    assert (rollout.block_length, rollout.steps, rollout.remasking, rollout.threshold, rollout.cache,
            decoding.top_p, decoding.top_k, decoding.max_completion_length) == (4, 256, "maskgit_plus", 0.9, "dual",
                                                                              1.0, 0, 256)
    assert protocol.to_dict()["steps"] == "gen_length (block_length per block)"
    with pytest.raises(ConfigError, match="--protocol sdar .* use --protocol d1"):
        EvalProtocol.for_task(get_task("gsm8k"), name="sdar")
    with pytest.raises(ConfigError, match="--block_length 32: .* block_size=4"):
        EvalProtocol.for_task(get_task("gsm8k"), block_length=32, name="sdar", block_size=4)


def test_eval_of_an_sdar_model_runs_sdars_own_protocol_by_default(official_sdar_dir, tmp_path,
                                                                 capsys):
    """`dllm-ais eval` of an SDAR checkpoint decodes as SDAR's generate (d1's blocks of 16 would not fit its blocks of
    4), and the greedy decoder it builds gives the official generation of the fixture token for token."""
    from safetensors.torch import load_file

    from dllm_ais.loading import load_model

    output = tmp_path / "eval.json"
    assert main(["eval", "--model", str(official_sdar_dir), "--limit=2", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    protocol = report["protocol"]
    assert (protocol["name"], protocol["block_length"], protocol["remasking"], protocol["threshold"],
            protocol["cache"], protocol["temperature"]) == ("sdar", 4, "maskgit_plus", 0.9, "dual", 0.0)
    assert "sdar protocol" in capsys.readouterr().out and report["results"][0]["num_prompts"] == 2

    model = load_model(str(official_sdar_dir), torch.float32).eval()
    tokenizer = load_tokenizer(str(official_sdar_dir))
    config = EvalProtocol.for_task(get_task("digits"), name="sdar", block_size=4).decoding(GRPOConfig(), 12)
    policy = build_policy(config, model.config, tokenizer, temperature=0.0)
    official = load_file(DATA / "sdar_official" / "official_outputs.safetensors")
    prompt, generated = official["prompt_ids"], official["generated_ids"]
    rollout = policy.sample(model, prompt, torch.ones_like(prompt), None)
    # the fixture's proposals never pass 0.9, so the dynamic rule commits as the static one it was generated with
    assert rollout.step_logprobs.exp().max() < 0.9
    assert torch.equal(rollout.sequences[:, :generated.shape[1]], generated)


def test_eval_of_a_llada2_model_runs_llada2s_own_protocol_by_default(official_llada2_dir, tmp_path, capsys):
    """`dllm-ais eval` of a LLaDA2 checkpoint decodes as LLaDA2's generate by default: its blocks of 4, a step per
    position, the dynamic rule at its threshold 0.95 (not SDAR's 0.9), the exact cache; `--protocol sdar` still
    applies SDAR's."""
    output = tmp_path / "eval.json"
    assert main(["eval", "--model", str(official_llada2_dir), "--limit=2", "--output", str(output)]) == 0
    protocol = json.loads(output.read_text())["protocol"]
    assert (protocol["name"], protocol["block_length"], protocol["remasking"], protocol["threshold"],
            protocol["cache"], protocol["temperature"]) == ("llada2", 4, "maskgit_plus", 0.95, "dual", 0.0)
    assert "llada2 protocol" in capsys.readouterr().out
    config = EvalProtocol.for_task(get_task("gsm8k"), (256,), name="llada2", block_size=32).decoding(GRPOConfig(), 256)
    assert (config.rollout.block_length, config.rollout.steps, config.rollout.threshold) == (32, 256, 0.95)
    sdar = tmp_path / "sdar.json"
    assert main(["eval", "--model", str(official_llada2_dir), "--limit=2", "--protocol", "sdar", "--output",
                 str(sdar)]) == 0
    assert json.loads(sdar.read_text())["protocol"]["threshold"] == 0.9

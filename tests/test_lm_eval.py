"""The lm-evaluation-harness model `dllm_ais`: LLaDA's likelihood estimate against an independent reference of its
harness class, the causal path against the harness's own `hf` model, and the harness end to end on local tasks."""
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math
from pathlib import Path
import warnings

import pytest
import torch
import torch.nn.functional as F

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from dllm_ais.cli import main  # noqa: E402
from dllm_ais.config import EMBEDDED_MODELS  # noqa: E402
from dllm_ais.likelihood import mask_generator  # noqa: E402
from dllm_ais.lm_eval_model import DllmAisLM  # noqa: E402
from dllm_ais.lm_eval_requests import d1_sampler_config, diffusion_loglikelihood, llada_mask_draw  # noqa: E402
from dllm_ais.sampling.diffusion import MaskedDiffusionSampler  # noqa: E402

QUESTIONS = [("reverse 4 5 1", "1 5 4"), ("sort 3 9 1 4", "1 3 4 9"), ("reverse 7 2 8 1", "1 8 2 7"),
             ("sort 6 2 5", "2 5 6")]


def llada_reference_loglikelihood(model, prefix, target, mask_id, mc_num, batch_size, generator, cfg=0.0):
    """LLaDA's `get_loglikelihood` (eval_llada.py), written out independently, its global RNG replaced by
    `generator`: per batch k ~ randint(1, L), x = round(linspace(k, k + (b - 1) L / b, b)) wrapped to 1..L, copy i
    masks its first x_i positions permuted by randperm(L); loss = Σ CE / (x / L) / b; result −mean(loss)."""
    seq = torch.cat([prefix, target])[None, :].repeat(batch_size, 1)
    prompt_index = torch.arange(seq.shape[1]) < len(prefix)
    length = len(target)
    losses = []
    for _ in range(mc_num // batch_size):
        k = torch.randint(1, length + 1, (), generator=generator)
        x = torch.round(torch.linspace(float(k), k + (batch_size - 1) * (length / batch_size), steps=batch_size)).long()
        x = ((x - 1) % length) + 1
        is_mask = torch.arange(length).repeat(batch_size, 1) < x.unsqueeze(1)
        for i in range(batch_size):
            is_mask[i] = is_mask[i][torch.randperm(length, generator=generator)]
        is_mask = torch.cat([torch.zeros(batch_size, len(prefix), dtype=torch.bool), is_mask], dim=1)
        noisy = torch.where(is_mask, mask_id, seq)
        p_mask = (x / length).unsqueeze(1).repeat(1, seq.shape[1])
        batch = noisy
        if cfg > 0:
            unconditional = noisy.clone()
            unconditional[prompt_index.unsqueeze(0).repeat(batch_size, 1)] = mask_id
            batch = torch.cat([noisy, unconditional])
        with torch.no_grad():
            logits = model(batch).logits
        if cfg > 0:
            conditional, unconditional = torch.chunk(logits, 2, dim=0)
            logits = unconditional + (cfg + 1) * (conditional - unconditional)
        loss = F.cross_entropy(logits[is_mask], seq[is_mask], reduction="none") / p_mask[is_mask]
        losses.append((loss.sum() / batch_size).item())
    return -sum(losses) / len(losses)


@pytest.fixture(scope="module")
def llada():
    return DllmAisLM(pretrained="embedded", batch_size=4, mc_num=16, mc_batch_size=4)


@pytest.fixture(scope="module")
def qwen3():
    return DllmAisLM(pretrained="embedded-qwen3", batch_size=2)


def chat(lm, question: str) -> str:
    """The chat-templated question without the template's trailing newlines (so that the harness keeps the
    continuation's tokens as they are)."""
    return lm.apply_chat_template([{"role": "user", "content": question}]).rstrip()


def loglikelihood_requests(lm) -> list[Instance]:
    pairs = [(chat(lm, question), "\n\n" + answer) for question, answer in QUESTIONS]
    pairs += [(chat(lm, QUESTIONS[0][0]), "\n\n" + QUESTIONS[1][1]), ("", "sort 1 2"), ("reverse 3 4 ", "4 3")]
    return [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]


def test_llada_mask_draw_is_stratified():
    draw = llada_mask_draw(gen_length=10, batch=5, generator=mask_generator(3))
    counts = draw.masked.sum(dim=1)
    assert torch.equal(counts.float() / 10, draw.rate)
    assert counts.min() >= 1 and counts.max() <= 10
    assert sorted(((counts - counts[0]) % 10).tolist()) == [0, 2, 4, 6, 8]  # spaced L / b apart, wrapped


@pytest.mark.parametrize("cfg", [0.0, 0.5])
def test_diffusion_likelihood_equals_llada_reference(llada, cfg):
    """Same estimator, same random masks (one seeded generator, LLaDA's draw order) -> same values."""
    context, continuation = llada._encode_pair(chat(llada, "reverse 4 5 1"), "\n\n1 5 4")
    prefix, target = torch.tensor(context), torch.tensor(continuation)
    guided = MaskedDiffusionSampler(d1_sampler_config(len(target), len(target), llada.tokens, 0.0, cfg_scale=cfg))
    ours = diffusion_loglikelihood(llada.model, prefix, target, llada.tokens.mask_token_id, 16, 4, mask_generator(7),
                                   guided.scoring_logits)
    reference = llada_reference_loglikelihood(llada.model, prefix, target, llada.tokens.mask_token_id, 16, 4,
                                              mask_generator(7), cfg)
    assert ours.value == pytest.approx(reference, abs=1e-4)
    assert ours.num_samples == 16 and ours.standard_error > 0
    other = diffusion_loglikelihood(llada.model, prefix, target, llada.tokens.mask_token_id, 16, 4, mask_generator(8))
    assert other.value != pytest.approx(reference, abs=1e-4)  # the masks matter: the comparison can fail


def test_harness_loglikelihood_of_llada_is_the_reference_estimate(llada):
    requests = loglikelihood_requests(llada)
    results = llada.loglikelihood(requests, disable_tqdm=True)
    for request, (value, _) in zip(requests, results):
        context, continuation = (llada._encode_pair(*request.args) if request.args[0]
                                 else ([llada.prefix_token_id], llada.tok_encode(request.args[1])))
        reference = llada_reference_loglikelihood(llada.model, torch.tensor(context), torch.tensor(continuation),
                                                  llada.tokens.mask_token_id, 16, 4, mask_generator(llada.seed))
        assert value == pytest.approx(reference, abs=1e-4)
    correct, wrong = results[0][0], results[len(QUESTIONS)][0]
    assert correct > wrong  # the embedded LLaDA reverses digits: the right answer is likelier


def test_llada_greedy_check(llada):
    """A continuation is greedy iff decoding one token per step, most confident first, reproduces it."""
    context = chat(llada, "sort 3 9 1 4")
    continuation = llada.tokenizer.decode(llada._scorer(9).sample(
        llada.model, torch.tensor([llada.tok_encode(context)])).completion_ids[0])
    wrong = ("1" if continuation[0] != "1" else "2") + continuation[1:]
    flags = [flag for _, flag in llada.loglikelihood([Instance("loglikelihood", {}, (context, text), 0)
                                                      for text in (continuation, wrong)],
                                                     disable_tqdm=True)]
    assert flags == [True, False]


def test_llada_generation_honours_max_gen_toks_and_until(llada):
    """One sampler (gen_length 32, d1's protocol) for 3 and 8 tokens: the shorter text is the longer one cut."""
    context = chat(llada, "sort 3 9 1 4") + "\n\n"
    texts = llada.generate_until([Instance("generate_until", {}, (context, kwargs), 0) for kwargs in (
        {"until": [], "max_gen_toks": 8}, {"until": [], "max_gen_toks": 3}, {"until": [" "], "max_gen_toks": 8})],
        disable_tqdm=True)
    assert texts == ["1 3 4 9", "1 3", "1"]
    with pytest.raises(ValueError, match="top_p"):
        llada.generate_until([Instance("generate_until", {}, (context, {"until": [], "top_p": 0.9}), 0)])


def test_rolling_loglikelihood_refused_for_diffusion(llada):
    with pytest.raises(NotImplementedError, match="masked-diffusion"):
        llada.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("some text",), 0)])


def test_causal_path_equals_harness_hf_model(qwen3):
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(EMBEDDED_MODELS["embedded-qwen3"]), batch_size=3, device="cpu", dtype="float32")
    context = chat(qwen3, "sort 6 2 5")
    greedy = qwen3.generate_until([Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 3}), 0)],
                                  disable_tqdm=True)[0]
    requests = [*loglikelihood_requests(qwen3), Instance("loglikelihood", {}, (context, greedy), 0)]
    ours, theirs = qwen3.loglikelihood(requests, disable_tqdm=True), hf.loglikelihood(requests, disable_tqdm=True)
    difference = max(abs(a - b) for (a, _), (b, _) in zip(ours, theirs))
    assert difference < 1e-4, difference
    assert [flag for _, flag in ours] == [flag for _, flag in theirs] and ours[-1][1]

    texts = [Instance("loglikelihood_rolling", {}, (text,), 0) for text in ("reverse 4 5 1\n\n1 5 4", "sort 9 8")]
    rolling = qwen3.loglikelihood_rolling(texts, disable_tqdm=True)
    assert rolling == pytest.approx(hf.loglikelihood_rolling(texts, disable_tqdm=True), abs=1e-4)

    generations = [Instance("generate_until", {}, (chat(qwen3, question) + "\n\n", kwargs), 0)
                   for question, _ in QUESTIONS for kwargs in ({"until": ["\n"], "max_gen_toks": 8},
                                                                {"until": [" "], "max_gen_toks": 3})]
    ours = qwen3.generate_until(generations, disable_tqdm=True)
    assert ours == hf.generate_until(generations, disable_tqdm=True)
    assert ours[0] == "1 5 4" and ours[1] == "1"


def test_causal_windows_equal_harness_hf_model_when_requests_are_long():
    """Requests longer than max_length lose the start of their context as the `hf` model cuts it."""
    from lm_eval.models.huggingface import HFLM

    ours = DllmAisLM(pretrained="embedded-qwen3", batch_size=2, max_length=12)
    hf = HFLM(pretrained=str(EMBEDDED_MODELS["embedded-qwen3"]), batch_size=2, device="cpu", dtype="float32",
              max_length=12)
    requests = loglikelihood_requests(ours)
    values = [value for value, _ in ours.loglikelihood(requests, disable_tqdm=True)]
    assert values == pytest.approx([value for value, _ in hf.loglikelihood(requests, disable_tqdm=True)], abs=1e-4)
    kwargs = {"until": ["\n"], "max_gen_toks": 4}
    generations = [Instance("generate_until", {}, (chat(ours, question) + "\n\n", kwargs), 0)
                   for question, _ in QUESTIONS]
    assert ours.generate_until(generations, disable_tqdm=True) == hf.generate_until(generations, disable_tqdm=True)


def test_adapter_directory_and_merged_export_score_alike(tmp_path, qwen3):
    """A LoRA adapter directory (without tokenizer files: its base's tokenizer) and its merged export load and score
    the same, and differently from the base model."""
    from peft import LoraConfig, get_peft_model

    from dllm_ais.export import export_merged_model
    from dllm_ais.loading import load_model

    torch.manual_seed(0)
    adapter = get_peft_model(load_model("embedded-qwen3", torch.float32),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter.save_pretrained(tmp_path / "adapter")
    export_merged_model(tmp_path / "adapter", tmp_path / "merged", dtype=torch.float32)
    requests = loglikelihood_requests(qwen3)[:3]
    scores = [[value for value, _ in DllmAisLM(pretrained=str(path), dtype="float32").loglikelihood(
        requests, disable_tqdm=True)] for path in (tmp_path / "adapter", tmp_path / "merged")]
    base = [value for value, _ in qwen3.loglikelihood(requests, disable_tqdm=True)]
    assert scores[0] == pytest.approx(scores[1], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(scores[0], base)) > 1e-2


TASKS = {
    "dllm_ais_mc": """task: dllm_ais_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""",
    "dllm_ais_gen": """task: dllm_ais_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Two harness tasks over one local JSONL: multiple choice (the right answer or its reverse) and generation."""
    import json

    directory = tmp_path_factory.mktemp("tasks")
    rows = [{"question": question, "answer": answer, "choices": [" " + answer, " " + answer[::-1]], "label": 0}
            for question, answer in QUESTIONS]
    data = directory / "digits.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, text in TASKS.items():
        (directory / f"{name}.yaml").write_text(text.format(data=data))
    return directory


@pytest.mark.parametrize("pretrained", ["embedded", "embedded-dream", "embedded-qwen3"])
def test_harness_end_to_end_on_local_tasks(task_dir, pretrained):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    results = simple_evaluate(model="dllm_ais", model_args=f"pretrained={pretrained},mc_num=8", batch_size=4,
                              tasks=["dllm_ais_mc", "dllm_ais_gen"], task_manager=tasks,
                              apply_chat_template=True, log_samples=True, limit=4)
    samples = results["samples"]
    lm = DllmAisLM(pretrained=pretrained, batch_size=4, mc_num=8)
    generated = lm.generate_until([Instance("generate_until", {}, sample["arguments"][0], 0)
                                   for sample in samples["dllm_ais_gen"]], disable_tqdm=True)
    assert generated == [sample["filtered_resps"][0] for sample in samples["dllm_ais_gen"]]
    expected = sum(text == sample["target"] for text, sample in zip(generated, samples["dllm_ais_gen"])) / 4
    assert results["results"]["dllm_ais_gen"]["exact_match,none"] == pytest.approx(expected)
    assert expected >= 0.5  # the embedded models answer the digits prompts
    scores = [[value for value, _ in lm.loglikelihood([Instance("loglikelihood", {}, args, 0)
                                                     for args in sample["arguments"]], disable_tqdm=True)]
              for sample in samples["dllm_ais_mc"]]
    harness_scores = [response[0][0] for sample in samples["dllm_ais_mc"] for response in sample["resps"]]
    assert harness_scores == pytest.approx([value for row in scores for value in row], abs=1e-4)  # batches differ
    accuracy = sum(max(range(2), key=row.__getitem__) == 0 for row in scores) / 4
    assert results["results"]["dllm_ais_mc"]["acc,none"] == pytest.approx(accuracy)


DATA_PARALLEL_SCRIPT = """
import json, sys
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from dllm_ais.lm_eval_model import DllmAisLM

model = DllmAisLM(pretrained="embedded", mc_num=8, batch_size=4)
torch.distributed.barrier()  # the two processes are connected
open(sys.argv[2] + f".rank{model.rank}", "w").close()
results = simple_evaluate(model=model, tasks=["dllm_ais_mc", "dllm_ais_gen"], apply_chat_template=True,
                          task_manager=TaskManager(include_path=sys.argv[1], include_defaults=False))
if model.rank == 0:
    print(json.dumps([model.world_size, {task: values[metric] for task, metric in
                      (("dllm_ais_mc", "acc,none"), ("dllm_ais_gen", "exact_match,none"))
                      for values in [results["results"][task]]}]))
"""


@pytest.mark.slow
def test_data_parallel_processes_share_the_requests(task_dir, tmp_path):
    """Two processes (torchrun; gloo on a CPU-only machine, as `accelerate launch` on GPUs) split the requests and
    report what one process reports."""
    import json
    import shutil
    import subprocess
    import sys

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    script = tmp_path / "data_parallel.py"
    script.write_text(DATA_PARALLEL_SCRIPT)
    import dllm_ais

    package_root = str(Path(dllm_ais.__file__).parents[1])  # the processes import this checkout's dllm_ais
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    # --standalone: a free port of its own, so no other run on the machine (or one that left the default port
    # waiting) meets these processes' rendezvous. In the whole suite on 2 cores a worker has been seen to abort, or gloo
    # to be refused a connection between the two, before both processes joined the group (the cause is outside this
    # code: the fault handler prints the stack). torchrun's own restart, on the same store, has been refused the same
    # way; so a launch that failed before both joined is started afresh, at most twice more, with a warning. A failure
    # after both joined fails the test.
    failures = []
    for attempt in range(3):
        joined = tmp_path / f"joined{attempt}"
        command = [shutil.which("torchrun") or "torchrun", "--standalone", "--nproc_per_node", "2",
                   str(script), str(task_dir), str(joined)]
        run = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
        if run.returncode == 0:
            break
        failures.append(f"attempt {attempt}: " + "\n".join(
            [line for line in run.stderr.splitlines() if "rror" in line or "File" in line][:30] + [run.stderr[-1500:]]))
        both_joined = all((tmp_path / f"joined{attempt}.rank{rank}").exists() for rank in range(2))
        assert not both_joined, failures[-1]
        warnings.warn(f"the two processes did not both join the group; launching again:\n{failures[-1]}")
    assert run.returncode == 0, "\n\n".join(failures)
    world_size, metrics = json.loads(run.stdout.strip().splitlines()[-1])
    single = simple_evaluate(model=DllmAisLM(pretrained="embedded", mc_num=8, batch_size=4),
                             tasks=["dllm_ais_mc", "dllm_ais_gen"], apply_chat_template=True,
                             task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))["results"]
    assert world_size == 2
    assert metrics == {"dllm_ais_mc": single["dllm_ais_mc"]["acc,none"],
                       "dllm_ais_gen": single["dllm_ais_gen"]["exact_match,none"]}


@pytest.mark.slow
def test_cli_forwards_to_the_harness(task_dir, capsys):
    assert main(["lm-eval", "--model_args", "pretrained=embedded-qwen3", "--tasks", "dllm_ais_mc",
                 "--include_path", str(task_dir), "--limit", "2", "--batch_size", "2"]) == 0
    output = capsys.readouterr().out
    assert "dllm_ais_mc" in output and "acc" in output


@pytest.mark.slow
def test_device_and_batch_size_in_model_args_win_over_the_harness_defaults(task_dir, capsys):
    """The harness passes its own --device and --batch_size (defaults included) beside --model_args: naming them
    there too was a TypeError (multiple values for keyword argument 'device')."""
    assert main(["lm-eval", "--model_args", "pretrained=embedded-qwen3,device=cpu,batch_size=2", "--tasks",
                 "dllm_ais_mc", "--include_path", str(task_dir), "--limit", "2"]) == 0
    assert "dllm_ais_mc" in capsys.readouterr().out


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="mc_batch_size"):
        DllmAisLM(pretrained="embedded", mc_num=10, mc_batch_size=4)
    with pytest.raises(ValueError, match="policy='masked': choose one of"):
        DllmAisLM(pretrained="embedded", policy="masked")
    with pytest.raises(ValueError, match="batch_size='auto'"):
        DllmAisLM(pretrained="embedded", batch_size="auto")
    assert math.isnan(diffusion_loglikelihood(
        DllmAisLM(pretrained="embedded").model, torch.tensor([9, 10]), torch.tensor([11]), 6, 4, 4,
        mask_generator(0)).standard_error)  # one batch: no spread to measure


def test_the_package_and_its_cli_do_not_import_the_harness():
    import subprocess
    import sys

    code = "import sys, dllm_ais, dllm_ais.cli; dllm_ais.cli.build_parser(); print('lm_eval' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.fixture(scope="module")
def sdar(official_sdar_dir):
    """The official SDAR fixture (blocks of 4, 64 positions) under the harness model."""
    return DllmAisLM(pretrained=str(official_sdar_dir), batch_size=2, mc_num=8, mc_batch_size=4)


def sdar_reference_loglikelihood(model, prefix, target, mask_id, mc_num, batch_size, generator, block):
    """The block-diffusion ELBO written out with plain forwards: LLaDA's draws (`llada_mask_draw`), and each masked
    token scored by a forward of the sequence cut after its block, its block noisy and the blocks before it clean
    (an unpadded row's blocks count from position 0); per copy (1 / t) Σ log p, averaged over the copies."""
    sequence, start = torch.cat([prefix, target]), len(prefix)
    values = []
    for _ in range(mc_num // batch_size):
        draw = llada_mask_draw(len(target), batch_size, generator)
        for masked, rate in zip(draw.masked, draw.rate):
            noisy = sequence.clone()
            noisy[start:][masked] = mask_id
            total = 0.0
            for position in (start + masked.nonzero().flatten()).tolist():
                begin, end = position // block * block, (position // block + 1) * block
                canvas = torch.cat([sequence[:begin], noisy[begin:end]])
                with torch.no_grad():
                    logits = model(canvas[None]).logits[0, position].float()
                total += torch.log_softmax(logits, dim=-1)[sequence[position]].item()
            values.append(total / rate.item())
    return sum(values) / len(values)


def test_sdar_loglikelihood_is_its_block_diffusion_elbo(sdar):
    """SDAR's score is its own training objective, not LLaDA's whole-canvas forward: every masked token against the
    clean blocks before its own, with the same draws as LLaDA's estimate."""
    for context, continuation in (("sort 3 9 1 4", " 1 3 4 9"), ("reverse 4 5", " 5 4")):
        context_ids, continuation_ids = sdar._encode_pair(context, continuation)
        (value, _), = sdar.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)], disable_tqdm=True)
        reference = sdar_reference_loglikelihood(sdar.model, torch.tensor(context_ids), torch.tensor(continuation_ids),
                                                 sdar.tokens.mask_token_id, 8, 4, mask_generator(sdar.seed), 4)
        assert value == pytest.approx(reference, abs=1e-4)


def test_sdar_greedy_check_decodes_in_its_blocks(sdar):
    """The greedy flag of a 6-token continuation (not whole blocks): SDAR's decoder, one token per step in blocks of
    4, reproduces it; a continuation differing in one token is not greedy."""
    context = "sort 3 9 1 4"
    decoded = sdar._scorer(6).sample(sdar.model, torch.tensor([sdar.tok_encode(context)])).completion_ids[0, :6]
    assert sdar._scorer(6).config.block_length == 4 and sdar._scorer(6).config.gen_length == 8
    wrong = decoded.clone()
    wrong[0] = (wrong[0] + 1) % 100
    flags = [sdar.greedy_reproduces(sdar.tok_encode(context), ids.tolist()) for ids in (decoded, wrong)]
    assert flags == [True, False]


def test_sdar_generation_decodes_with_sdars_own_protocol(sdar, official_sdar_dir):
    """generate_until on an SDAR model: its blocks of 4, a step per block position, the dynamic rule at 0.9, the
    exact cache (d1's blocks of 32 would not fit its blocks); a block_length other than its block_size is refused."""
    from dllm_ais.config import ConfigError

    sampler, gen_length = sdar._generation_sampler(6, {})
    config = sampler.config
    assert (gen_length, config.block_length, config.steps, config.remasking, config.threshold, config.cache,
            config.temperature) == (8, 4, 8, "maskgit_plus", 0.9, "dual", 0.0)
    context = "sort 3 9 1 4"
    text, = sdar.generate_until([Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 6}), 0)],
                                disable_tqdm=True)
    rollout = sampler.sample(sdar.model, torch.tensor([sdar.tok_encode(context)]))
    tokens = rollout.completion_ids[0][rollout.completion_mask[0].bool()][:6]
    assert text == sdar.tokenizer.decode(tokens, skip_special_tokens=True)
    with pytest.raises(ConfigError, match="block_length=32: .* block_size=4"):
        DllmAisLM(pretrained=str(official_sdar_dir), block_length=32)


def test_llada2_scores_its_block_diffusion_elbo_and_generates_with_its_own_protocol(official_llada2_dir):
    """LLaDA2 under the harness model (the official fixture: MoE, blocks of 4): the same block-diffusion ELBO as SDAR's
    (every masked token against the clean blocks before its own), and generate_until with LLaDA2's protocol (its
    blocks, a step per position, the dynamic rule at its threshold 0.95, the exact cache)."""
    llada2 = DllmAisLM(pretrained=str(official_llada2_dir), batch_size=2, mc_num=8, mc_batch_size=4)
    context, continuation = "sort 3 9 1 4", " 1 3 4 9"
    context_ids, continuation_ids = llada2._encode_pair(context, continuation)
    (value, _), = llada2.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)], disable_tqdm=True)
    reference = sdar_reference_loglikelihood(llada2.model, torch.tensor(context_ids), torch.tensor(continuation_ids),
                                             llada2.tokens.mask_token_id, 8, 4, mask_generator(llada2.seed), 4)
    assert value == pytest.approx(reference, abs=1e-4)
    sampler, gen_length = llada2._generation_sampler(6, {})
    config = sampler.config
    assert (gen_length, config.block_length, config.steps, config.remasking, config.threshold, config.cache,
            config.temperature) == (8, 4, 8, "maskgit_plus", 0.95, "dual", 0.0)

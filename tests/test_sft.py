"""The SFT warm-start stage (dllm_ais.sft): its canvas, the LLaDA masked-diffusion loss against the hand formula, the
leak-free prefix masks, and the answer lengths a step pads to."""

import math
from types import SimpleNamespace

import datasets
import pytest
import torch

from dllm_ais.loading import load_tokenizer
from dllm_ais.sft import SFTConfig, build_sft_batch, masked_diffusion_sft_loss, prefix_masked_sft_loss, run_sft


class UniformLM(torch.nn.Module):
    """logits = a learnable bias shared by every position (starts at 0: the uniform distribution); records the
    canvas widths it is called on."""

    def __init__(self, vocab: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(vocab))
        self.widths: list[int] = []
        self.inputs: list[torch.Tensor] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        self.widths.append(input_ids.shape[1])
        self.inputs.append(input_ids)
        return SimpleNamespace(logits=self.bias.expand(*input_ids.shape, -1))


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_canvas_is_left_padded_prompt_then_answer_eot_and_eos():
    tokenizer = load_tokenizer("embedded")
    input_ids, attention_mask, answer_mask = build_sft_batch(tokenizer, [chat("ab"), chat("abcd")], ["x", "yz"], 6)
    assert input_ids.shape[1] - answer_mask[0].nonzero()[0].item() == 6
    eot, eos = tokenizer.convert_tokens_to_ids("<|eot_id|>"), tokenizer.eos_token_id
    answers = input_ids[answer_mask].view(2, 6).tolist()
    assert answers[0] == [*tokenizer("x", add_special_tokens=False).input_ids, eot, *[eos] * 4]
    assert answers[1] == [*tokenizer("yz", add_special_tokens=False).input_ids, eot, *[eos] * 3]
    assert attention_mask[0, 0] == 0 and attention_mask[1].all()  # the shorter prompt is left padded


def test_masked_diffusion_loss_is_the_hand_formula_on_a_uniform_model():
    vocab, batch, prompt, answer = 11, 3, 4, 5
    input_ids = torch.randint(vocab - 1, (batch, prompt + answer))
    answer_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    answer_mask[:, prompt:] = True
    loss = masked_diffusion_sft_loss(UniformLM(vocab), input_ids, torch.ones_like(input_ids), answer_mask,
                                     mask_token_id=vocab - 1, generator=torch.Generator().manual_seed(0))
    draws = torch.Generator().manual_seed(0)  # the loss's own draws: t per row, then one uniform per position
    p_mask = (1 - 1e-3) * torch.rand(batch, generator=draws) + 1e-3
    masked = (torch.rand(input_ids.shape, generator=draws) < p_mask[:, None]) & answer_mask
    expected = sum(masked[row].sum().item() * math.log(vocab) / (p_mask[row].item() * answer) for row in range(batch))
    assert masked.any() and not masked[:, :prompt].any()
    assert math.isclose(loss.item(), expected / batch, rel_tol=1e-5)


def test_each_step_pads_to_a_drawn_length_between_gen_length_and_max_gen_length():
    assert SFTConfig(gen_length=16).canvas_lengths() == [16]
    assert SFTConfig(gen_length=128, max_gen_length=256).canvas_lengths() == [128, 160, 192, 224, 256]
    tokenizer = load_tokenizer("embedded")
    rows = datasets.Dataset.from_dict({"prompt": [chat("12"), chat("34")], "answer": ["1", "22"]})
    widths = {}
    for max_gen_length in (None, 96):
        model = UniformLM(len(tokenizer))
        run_sft(model, tokenizer, rows, SFTConfig(steps=12, batch_size=2, gen_length=32, max_gen_length=max_gen_length,
                                                  warmup_steps=0), mask_token_id=tokenizer.mask_token_id)
        widths[max_gen_length] = {width - min(model.widths) for width in model.widths}
    assert widths[None] == {0}
    assert widths[96] >= {0, 32} and widths[96] <= {0, 32, 64}


class SpyLM(torch.nn.Module):
    """Predicts every position's token from what it is given there: the logit of the visible token is 20, so a
    visible target costs almost nothing and a masked one log(vocab)-ish."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.scale = torch.nn.Parameter(torch.tensor(20.0))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return SimpleNamespace(logits=self.scale * torch.nn.functional.one_hot(input_ids, self.vocab).float())


def test_prefix_masks_hide_everything_from_a_cut_inside_the_answer_and_score_the_window_after_it():
    vocab, mask_id, prompt, answer, window = 13, 12, 3, 10, 4
    input_ids = torch.randint(mask_id, (64, prompt + answer))
    answer_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    answer_mask[:, prompt:] = True
    answer_lengths = torch.randint(1, answer + 1, (64,))
    model = UniformLM(vocab)
    loss = prefix_masked_sft_loss(model, input_ids, torch.ones_like(input_ids), answer_mask, answer_lengths, mask_id,
                                  window, torch.Generator().manual_seed(0))
    assert math.isclose(loss.item(), math.log(vocab), rel_tol=1e-5)  # every scored token costs log(vocab)
    cuts = []
    for row, noisy in enumerate(model.inputs[0]):
        masked = (noisy == mask_id).nonzero().flatten()
        cut = masked[0].item()
        assert masked.tolist() == list(range(cut, prompt + answer))  # a suffix: nothing after the cut is visible
        assert torch.equal(noisy[:cut], input_ids[row, :cut])
        assert prompt <= cut < prompt + answer_lengths[row]
        cuts.append(cut - prompt)
    assert len(set(cuts)) > 5
    # a model that can only copy what it sees gets no scored token for free: every scored token is masked
    spy = prefix_masked_sft_loss(SpyLM(vocab), input_ids, torch.ones_like(input_ids), answer_mask, answer_lengths,
                                 mask_id, window, torch.Generator().manual_seed(0))
    assert spy.item() > 10


def test_prefix_masking_keeps_a_share_of_random_steps_and_rejects_an_unknown_masking():
    tokenizer = load_tokenizer("embedded")
    rows = datasets.Dataset.from_dict({"prompt": [chat("12"), chat("34")], "answer": ["1 2 3 4 5 6", "2 2 4 4 6 6"]})
    suffix_steps = {}
    for share in (0.0, 0.5):
        model = UniformLM(len(tokenizer))
        run_sft(model, tokenizer, rows, SFTConfig(steps=40, batch_size=2, gen_length=32, warmup_steps=0,
                                                  masking="prefix", random_masking_share=share),
                mask_token_id=tokenizer.mask_token_id)
        suffix_steps[share] = 0
        for noisy in model.inputs:
            masked = noisy == tokenizer.mask_token_id
            suffix = all(masked[row, masked[row].nonzero()[0]:].all() for row in range(2) if masked[row].any())
            suffix_steps[share] += suffix and masked.any(1).all().item()
    assert suffix_steps[0.0] == 40
    assert 5 < suffix_steps[0.5] < 35
    with pytest.raises(ValueError, match="masking='blocks'"):
        SFTConfig(masking="blocks")


def tiny_sdar(tokenizer):
    from dllm_ais.dry_run import stand_in_model

    return stand_in_model(True, tokenizer, "sdar", block_size=4)


def test_block_diffusion_loss_scores_each_noisy_block_against_the_clean_blocks_before_it():
    """The SDAR loss is the LLaDA formula on the training-mode forward ([x_t | x_0]): recomputed by hand from
    `block_diffusion_logits` it agrees; a plain forward of the noisy canvas (each block seeing the noise of the
    blocks before it) does not."""
    from dllm_ais.models.families import position_logits
    from dllm_ais.models.sdar import block_diffusion_logits

    tokenizer = load_tokenizer("embedded")
    model = tiny_sdar(tokenizer)
    input_ids, attention_mask, answer_mask = build_sft_batch(tokenizer, [chat("12"), chat("3456")], ["1 2", "3 4 5"],
                                                             12)
    mask_id = tokenizer.mask_token_id
    loss = masked_diffusion_sft_loss(model, input_ids, attention_mask, answer_mask, mask_id,
                                     generator=torch.Generator().manual_seed(0))
    draws = torch.Generator().manual_seed(0)
    p_mask = (1 - 1e-3) * torch.rand(2, generator=draws) + 1e-3
    masked = (torch.rand(input_ids.shape, generator=draws) < p_mask[:, None]) & answer_mask
    noisy = input_ids.masked_fill(masked, mask_id)
    assert masked.any() and not (masked & ~answer_mask).any()

    def formula(logits):
        token_loss = torch.nn.functional.cross_entropy(logits[masked], input_ids[masked], reduction="none")
        rows = masked.nonzero()[:, 0]
        return (token_loss / (p_mask[rows] * answer_mask.sum(1)[rows])).sum() / 2

    with torch.no_grad():
        expected = formula(block_diffusion_logits(model, noisy, input_ids, attention_mask))
        plain = formula(position_logits(model, noisy, attention_mask))
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.isclose(loss.detach(), plain, rtol=1e-3)


def test_a_causal_qwen3_becomes_an_sdar_with_its_weights_and_a_mask_token():
    """Block size 1 makes the block-causal mask the causal one: the converted model's logits are the Qwen3's. A
    tokenizer without a mask token gets SDAR's, with an embedding row grown for it."""
    from dllm_ais.loading import load_model
    from dllm_ais.sft import ADDED_MASK_TOKEN, block_diffusion_from_causal

    tokenizer = load_tokenizer("embedded-qwen3")
    qwen3 = load_model("embedded-qwen3", torch.float32).eval()
    ids = torch.randint(0, tokenizer.mask_token_id, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        causal = qwen3(ids).logits
        sdar = block_diffusion_from_causal(qwen3, tokenizer, 1).eval()
        torch.testing.assert_close(sdar(ids).logits, causal, rtol=0, atol=1e-6)
    assert (sdar.config.model_type, sdar.config.mask_token_id) == ("sdar", tokenizer.mask_token_id)

    tokenizer.mask_token = None
    vocab = len(tokenizer)
    sdar = block_diffusion_from_causal(load_model("embedded-qwen3", torch.float32), tokenizer, 4)
    assert tokenizer.mask_token == ADDED_MASK_TOKEN and sdar.config.mask_token_id == vocab == len(tokenizer) - 1
    assert sdar.get_input_embeddings().weight.shape[0] == sdar.lm_head.weight.shape[0] == vocab + 1
    with pytest.raises(ValueError, match="model_type 'llada': pass a Qwen3 checkpoint"):
        block_diffusion_from_causal(load_model("embedded", torch.float32), load_tokenizer("embedded"), 4)


def test_sft_cli_makes_and_trains_an_sdar_from_the_tiny_qwen3(tmp_path, capsys):
    from dllm_ais.cli import main
    from dllm_ais.loading import load_model

    out = tmp_path / "sdar"
    assert main(["sft", "--model", "embedded-qwen3", "--as_block_diffusion", "4", "--steps", "2", "--batch_size", "4",
                 "--output_dir", str(out), "--dtype", "float32"]) == 0
    model = load_model(str(out), torch.float32)
    assert (model.config.model_type, model.config.block_size, model.config.mask_token_id) == ("sdar", 4, 6)
    assert "SFT loss" in capsys.readouterr().out
    with pytest.raises(ValueError, match="masking='prefix'.*SDAR"):
        run_sft(model, load_tokenizer(str(out)), datasets.Dataset.from_dict({"prompt": [chat("1")], "answer": ["1"]}),
                SFTConfig(steps=1, batch_size=1, masking="prefix"), mask_token_id=6)

"""lm-evaluation-harness model `dllm_ais`: any benchmark of the harness on any model this library trains.

Importing this module registers the model (it needs the `lm-eval` extra: ``pip install "dllm-ais[lm-eval]"``)::

    dllm-ais lm-eval --model_args pretrained=outputs/dllm-ais/final --tasks arc_easy,gsm8k --batch_size 8
    accelerate launch -m dllm_ais.cli lm-eval --model_args pretrained=GSAI-ML/LLaDA-8B-Instruct --tasks mmlu

Masked-diffusion models (LLaDA):

- `loglikelihood` is LLaDA's evaluation estimate (the `get_loglikelihood` of its harness class, eval_llada.py): the
  Monte-Carlo lower bound on log p(continuation | context) over `mc_num` masked copies of the sequence, scored
  `mc_batch_size` at a time; in each batch of b copies the numbers of masked continuation tokens are stratified,
  n_i = ((k + i·L/b rounded − 1) mod L) + 1 with k ~ U{1, …, L}, each at positions drawn uniformly, and a copy
  contributes (L / n_i) Σ_{masked j} log p_θ(x_j | x̃) (`llada_mask_draw`, `diffusion_loglikelihood`). Its greedy
  flag is LLaDA's check: our exact sampler, one token per step by confidence, reproduces the continuation.
- `generate_until` decodes with `MaskedDiffusionSampler`: d1's protocol by default (greedy, low-confidence remasking,
  blocks of 32, gen_length / 2 steps, no cache), gen_length = `max_gen_toks` rounded up to a whole block, the text cut
  at `max_gen_toks` tokens, its first EOS and the first `until` string.
- `loglikelihood_rolling` (perplexity tasks) is refused: there is no left-to-right factorisation to roll.

Block-diffusion models (SDAR, LLaDA2: `families.is_block_causal`) take the same paths in their own blocks:

- `loglikelihood` is the same Monte-Carlo estimate with the same draws, each masked token scored with its own block
  noisy and the blocks before it clean (`likelihood.noisy_canvas_logits`, the training-mode forward): with the 1/t
  weight, SDAR's block-diffusion ELBO, its own training loss — not an autoregressive score, which SDAR (bidirectional
  inside a block) does not define. The greedy flag: SDAR's decoder, one token per step by confidence in blocks of
  ``block_size`` (the continuation's length rounded up to whole blocks), reproduces the continuation.
- `generate_until` decodes with the family's default protocol (its record's `eval_protocol`, SDAR's for SDAR,
  LLaDA2's for LLaDA2.x, `decoding_protocols.with_family_protocol`: blocks of the model's ``block_size``, a step per
  block position, low_confidence_dynamic at 0.9 (LLaDA2: 0.95), the exact cache), any sampler setting
  given in --model_args replacing its value; a block_length other than ``block_size`` is refused.

Causal LMs (Qwen3, ...): teacher-forced log-probs and greedy flags as the harness's `hf` model computes them, and
generation with `AutoregressiveSampler` (model.generation_config's EOS ids, as `generate` uses).

Differences from LLaDA's class: every request draws its masks from a generator seeded with `seed` (LLaDA's class draws
from one global stream), so a request scores the same whatever its rank, batch or order, and the choices of a question
share their masks where their lengths agree; log-probs are float32 log-softmax (LLaDA's `cross_entropy` runs in the
logits' dtype), and so are the greedy check's confidences (LLaDA's: float32); the prompt of a long request is cut from
the left to fit `max_length` instead of failing.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, resolve_max_length
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from torch import Tensor, nn
from tqdm.auto import tqdm

from dllm_ais.data import apply_chat_template
from dllm_ais.likelihood import mask_generator, plain_logits
from dllm_ais.lm_eval_arguments import ModelArguments, available_device, tokenizer_source
from dllm_ais.lm_eval_requests import (LikelihoodEstimate, batches, causal_continuation_scores, check_monte_carlo_sizes,
                                       completion_text, d1_sampler_config, diffusion_loglikelihood, grouped_by_kwargs,
                                       left_padded, block_protocol_sampler_config)
from dllm_ais.loading import load_model, load_tokenizer, refuse_remote_code, resolve_dtype, special_tokens
from dllm_ais.models.families import family_of, is_block_causal
from dllm_ais.policy import is_diffusion
from dllm_ais.sampling.autoregressive import AutoregressiveSampler, AutoregressiveSamplerConfig
from dllm_ais.sampling.diffusion import MaskedDiffusionSampler
from dllm_ais.validation import ConfigError

MODEL_NAME = "dllm_ais"
DEFAULT_MAX_LENGTH = 2048  # the harness's `hf` default when the config names no context length


@register_model(MODEL_NAME)
class DllmAisLM(TemplateLM):
    """The harness model: a local path, Hub id, `embedded*` name, LoRA adapter directory or merged export
    (`pretrained`), scored and sampled by this library's estimators and samplers (see the module docstring).

    Arguments (``--model_args key=value,...``): dtype (auto = bf16 on CUDA, fp32 on CPU), batch_size (requests per
    forward; also the Monte-Carlo batch unless mc_batch_size), device, device_map ("auto" spreads the model over the
    visible GPUs), policy (auto | diffusion | autoregressive), trust_remote_code, max_length, seed. Diffusion only:
    mc_num (Monte-Carlo copies, LLaDA's default 128), mc_batch_size, is_check_greedy, cfg_scale, gen_length (default:
    max_gen_toks rounded up to a block), block_length (32), steps (gen_length / 2), remasking, cache, threshold,
    factor. Each is checked before anything loads (`ModelArguments`); trust_remote_code=true alone lets a model's own
    code run (`dllm_ais.loading.refuse_remote_code`). Under ``accelerate launch`` each process takes its share of the
    requests on its own device.
    """

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None) -> "DllmAisLM":
        """The model of the --model_args `arg_dict` and the harness's own settings `additional_config` (batch_size,
        device, max_batch_size: passed with the harness's defaults even when not typed); an argument in --model_args
        wins over the harness's (the harness would pass it twice, a TypeError)."""
        harness = {name: value for name, value in (additional_config or {}).items()
                   if value is not None and name not in arg_dict}
        return cls(**arg_dict, **harness)

    @classmethod
    def create_from_arg_string(cls, arg_string: str,
                               additional_config: dict[str, Any] | None = None) -> "DllmAisLM":
        """`create_from_arg_obj` of the --model_args string `key=value,...`."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        from accelerate import PartialState

        arguments = ModelArguments.parse(model_args)  # every argument checked before anything loads
        state = PartialState(cpu=not torch.cuda.is_available())  # several processes: GPUs, else gloo on CPUs
        self._rank, self._world_size = state.process_index, state.num_processes
        self._device = state.device if self._world_size > 1 else available_device(arguments.device)
        pretrained, trust_remote_code = arguments.pretrained, arguments.trust_remote_code
        refuse_remote_code(pretrained, trust_remote_code)
        self.tokenizer = load_tokenizer(tokenizer_source(pretrained), trust_remote_code)
        model = load_model(pretrained, resolve_dtype(arguments.dtype), trust_remote_code).eval()
        self.model = self._placed(model, arguments.device_map)
        self.diffusion = is_diffusion(arguments.policy, self.model.config.model_type)
        self.tokens = special_tokens(self.tokenizer, self.model.config, self.diffusion)
        config = self.model.config
        self._max_length = arguments.max_length or getattr(config, "max_sequence_length", None) or resolve_max_length(
            config, self.tokenizer, default=DEFAULT_MAX_LENGTH)
        self.batch_size, self.seed = arguments.batch_size, arguments.seed
        self.mc_num, self.mc_batch_size = arguments.mc_num, arguments.monte_carlo_batch
        self.is_check_greedy = arguments.is_check_greedy
        self.gen_length, self.block_length = arguments.gen_length, arguments.block_length
        self.sampler_settings = arguments.sampler_settings
        self.block_size = config.block_size if self.diffusion and is_block_causal(self.model) else None
        if self.block_size is not None:  # its family's protocol, each setting given in model_args replacing its own
            if "block_length" in model_args and arguments.block_length != self.block_size:
                raise ConfigError(f"--model_args block_length={arguments.block_length}: this block-diffusion model "
                                  f"decodes in its blocks of block_size={self.block_size}; leave block_length unset")
            self.block_length = self.block_size
            self.sampler_settings = {name: value for name, value in arguments.sampler_settings.items()
                                     if name in model_args}
        if self.diffusion:
            check_monte_carlo_sizes(self.mc_num, self.mc_batch_size)

    def _placed(self, model: nn.Module, device_map: str | None) -> nn.Module:
        """The model on this process's device, or spread over the visible GPUs by accelerate (`device_map="auto"`)."""
        if device_map is None or self._world_size > 1:
            return model.to(self._device)
        if device_map != "auto":
            self._device = torch.device(device_map)
            return model.to(self._device)
        from accelerate import dispatch_model, infer_auto_device_map

        placement = infer_auto_device_map(model, no_split_module_classes=getattr(model, "_no_split_modules", None))
        self._device = torch.device(next(iter(placement.values())) if placement else "cpu")
        return dispatch_model(model, placement) if len(set(placement.values())) > 1 else model.to(self._device)

    # ---------------------------------------------------------------- what the harness asks of a model

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The context of a request without one: BOS, else EOS (as the `hf` model)."""
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return apply_chat_template(self.tokenizer, chat_history, add_generation_prompt)

    def all_gather(self, tensor: Tensor) -> Tensor:
        from accelerate.utils import gather

        return gather(tensor) if self._world_size > 1 else tensor

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        gathered = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self._world_size > 1:
            torch.distributed.barrier()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string`, special tokens as the tokenizer adds them unless told (none when the text already
        starts with the prefix token's text), as the `hf` model encodes."""
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **options)

    # ---------------------------------------------------------------- likelihoods

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy) per ((context, continuation), context ids, continuation ids)."""
        score = self._diffusion_scores if self.diffusion else self._causal_scores
        results = score(requests, disable_tqdm or self._rank != 0)
        for (request, _, _), result in zip(requests, results):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, result)
        return results

    def _causal_scores(self, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Causal scores in batches of `batch_size`, longest first, each row cut from the left to its last
        max_length + 1 tokens (the `hf` model's window: max_length inputs)."""
        rows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in requests]
        lengths = [len(continuation) for _, _, continuation in requests]
        order = sorted(range(len(rows)), key=lambda index: -len(rows[index]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        for batch in tqdm(batches(order, self.batch_size), desc="loglikelihood", disable=disable_tqdm):
            scores = causal_continuation_scores(self.model, [rows[i] for i in batch], [lengths[i] for i in batch],
                                                self.tokens.pad_token_id)
            for index, result in zip(batch, scores):
                results[index] = result
        return results

    def _diffusion_scores(self, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """`diffusion_loglikelihood` and LLaDA's greedy check per request; the context is cut from the left so that
        the sequence fits `max_length`."""
        results = []
        for _, context, continuation in tqdm(requests, desc="loglikelihood", disable=disable_tqdm):
            if len(continuation) >= self.max_length:
                raise ConfigError(f"a continuation of {len(continuation)} tokens does not fit max_length="
                                  f"{self.max_length}; raise max_length (model_args) if the model allows it")
            context = context[-(self.max_length - len(continuation)):]
            estimate = self.estimate_loglikelihood(context, continuation)
            results.append((estimate.value, self.is_check_greedy and self.greedy_reproduces(context, continuation)))
        return results

    def _scorer(self, continuation_length: int) -> MaskedDiffusionSampler:
        """The exact greedy sampler over a continuation of this length, one token per step (LLaDA's greedy check);
        its `scoring_logits` are the logits the estimate scores (with guidance when cfg_scale > 0). A block-diffusion
        model's: SDAR's decoder without the dynamic rule, over the length rounded up to whole blocks."""
        if self.block_size is not None:
            gen_length = -(-continuation_length // self.block_size) * self.block_size
            return MaskedDiffusionSampler(block_protocol_sampler_config(family_of(self.model), gen_length,
                                                                        self.block_size, self.tokens, 0.0).exact())
        settings = {**self.sampler_settings, "steps": continuation_length, "remasking": "low_confidence",
                    "cache": "none", "threshold": None, "factor": None}
        return MaskedDiffusionSampler(d1_sampler_config(continuation_length, continuation_length, self.tokens, 0.0,
                                                        **settings))

    def estimate_loglikelihood(self, context: list[int], continuation: list[int]) -> LikelihoodEstimate:
        """`diffusion_loglikelihood` of one request with `mc_num` copies in batches of `mc_batch_size`, its masks drawn
        from `mask_generator(seed)` (a block-diffusion model scores through its training-mode forward, which takes no
        sampler logits)."""
        logits_fn = plain_logits if self.block_size is not None else self._scorer(len(continuation)).scoring_logits
        return diffusion_loglikelihood(self.model, torch.tensor(context, device=self._device),
                                       torch.tensor(continuation, device=self._device), self.tokens.mask_token_id,
                                       self.mc_num, self.mc_batch_size, mask_generator(self.seed), logits_fn)

    def greedy_reproduces(self, context: list[int], continuation: list[int]) -> bool:
        """Whether greedy decoding from the context, one token per step at the most confident masked position,
        yields exactly the continuation (LLaDA's `suffix_greedy_prediction`) as its first tokens."""
        prompt = torch.tensor([context], device=self._device)
        rollout = self._scorer(len(continuation)).sample(self.model, prompt)
        return rollout.completion_ids[0, :len(continuation)].tolist() == list(continuation)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) of whole texts (perplexity tasks), causal LMs only: the `hf` model's disjoint rolling windows
        of max_length tokens, each scored given the tokens before it."""
        if self.diffusion:
            raise NotImplementedError("loglikelihood_rolling (perplexity tasks such as wikitext) needs a left-to-right "
                                      "factorisation that a masked-diffusion model does not have; run loglikelihood or "
                                      "generation tasks with this model, or an autoregressive model")
        totals = []
        for (text,) in tqdm([request.args for request in requests], desc="loglikelihood_rolling",
                            disable=disable_tqdm or self._rank != 0):
            windows = [(None, *make_disjoint_window(window)) for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            total = sum(value for value, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    # ---------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Completions of each request's context: batches of `batch_size` requests sharing generation kwargs, each
        decoded by this model's sampler and cut at `max_gen_toks` tokens, the first EOS and the first `until` string
        (the decoded EOS among them)."""
        outputs: list[str | None] = [None] * len(requests)
        generator = torch.Generator(self._device).manual_seed(self.seed)
        eos_text = self.tokenizer.decode(self.eot_token_id)
        progress = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm or self._rank != 0)
        for indices in grouped_by_kwargs(requests).values():
            kwargs = dict(normalize_gen_kwargs(requests[indices[0]].args[1], 256))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_tokens = kwargs.pop("max_gen_toks")
            sampler, gen_length = self._generation_sampler(max_tokens, kwargs)
            for batch in batches(indices, self.batch_size):
                input_ids, attention_mask = self._encode_prompts([requests[i].args[0] for i in batch], gen_length)
                rollout = sampler.sample(self.model, input_ids, attention_mask, generator)
                for row, index in enumerate(batch):
                    outputs[index] = completion_text(self.tokenizer, rollout.completion_ids[row],
                                                     rollout.completion_mask[row], max_tokens, until)
                    self.cache_hook.add_partial("generate_until", requests[index].args, outputs[index])
                progress.update(len(batch))
        progress.close()
        return outputs

    def _generation_sampler(self, max_tokens: int, kwargs: dict[str, Any]):
        """(sampler, completion length) for requests of these normalised generation kwargs (`do_sample`,
        `temperature`, and for causal LMs `top_k` / `top_p`)."""
        if not self.diffusion:
            config = AutoregressiveSamplerConfig.from_generation_kwargs(
                max_new_tokens=max_tokens, pad_token_id=self.tokens.pad_token_id, **kwargs)
            return AutoregressiveSampler(config), max_tokens
        do_sample, temperature = kwargs.pop("do_sample", False), float(kwargs.pop("temperature", 0.0))
        if kwargs:
            raise ConfigError(f"generation kwargs {sorted(kwargs)} have no meaning for the masked-diffusion sampler; "
                              "set its settings (block_length, steps, remasking, ...) in --model_args instead")
        block, temperature = self.block_length, temperature if do_sample else 0.0
        gen_length = self.gen_length or -(-max_tokens // block) * block
        if self.block_size is not None:
            config = block_protocol_sampler_config(family_of(self.model), gen_length, block, self.tokens, temperature,
                                                   **self.sampler_settings)
            return MaskedDiffusionSampler(config), gen_length
        steps = self.sampler_settings["steps"] or max(gen_length // 2, 1)
        settings = {**self.sampler_settings, "steps": steps}
        config = d1_sampler_config(gen_length, block, self.tokens, temperature, **settings)
        return MaskedDiffusionSampler(config), gen_length

    def _encode_prompts(self, contexts: list[str], gen_length: int) -> tuple[Tensor, Tensor]:
        """Left-padded token ids and attention mask of `contexts`, each cut from the left to leave `gen_length`
        positions within max_length."""
        budget = self.max_length - gen_length
        if budget < 1:
            raise ConfigError(f"{gen_length} generated tokens leave no room for a prompt within max_length="
                              f"{self.max_length}; lower max_gen_toks (--gen_kwargs) or gen_length")
        return left_padded([self.tok_encode(context)[-budget:] for context in contexts], self.tokens.pad_token_id,
                           self._device)


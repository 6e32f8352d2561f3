"""Routing record and replay (dllm_ais.models.routing) on a tiny random LLaDA2: the router's pure functions with a
forced selection, a recording that changes nothing, a replay that uses the record, the refusals, the engine's
routing replayed by the trainer (`EngineRouting`), `bench routing`'s disagreement at a low notch, and the
`experimental.routing_replay` rule."""

import copy

import pytest
import torch

from dllm_ais.bench.routing import denoised_tokens, measure_routing, random_llada2
from dllm_ais.bench.mismatch import validation_prompts, with_trajectory_estimator
from dllm_ais.config import ConfigError, GRPOConfig, load_config
from dllm_ais.engine import RolloutEngine
from dllm_ais.loading import load_tokenizer
from dllm_ais.models.llada2 import expert_weights, route, router_scores, select_experts
from dllm_ais.models.routing import EngineRouting, RoutingTape, routing_tape, selection_differs
from dllm_ais.policy import build_policy

TOP_K, GROUPS, TOP_GROUPS, SCALE = 4, 4, 2, 2.5


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded-sdar")


@pytest.fixture()
def model(tokenizer):
    return random_llada2(tokenizer, seed=0)


def canvas(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(7, 100, (batch, length), generator=torch.Generator().manual_seed(1))


def perturbed(model):
    """A copy of `model` whose attention output projections are scaled: its hidden states, so its routing, move."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for layer in other.model.layers:
            layer.attention.dense.weight.mul_(1.5)
    return other


def test_route_with_forced_experts_uses_them_weighted_by_its_own_scores():
    hidden, weight = torch.randn(5, 8), torch.randn(16, 8)
    bias = torch.randn(16) * 0.1
    own, own_weights = route(hidden, weight, bias, TOP_K, GROUPS, TOP_GROUPS, SCALE)
    assert torch.equal(own, select_experts(router_scores(hidden, weight), bias, TOP_K, GROUPS, TOP_GROUPS))
    forced = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:TOP_K] for i in range(5)])
    experts, weights = route(hidden, weight, bias, TOP_K, GROUPS, TOP_GROUPS, SCALE, experts=forced)
    assert torch.equal(experts, forced)
    scores = torch.sigmoid(hidden @ weight.T).gather(1, forced)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True) * SCALE)
    assert torch.equal(expert_weights(router_scores(hidden, weight), own, SCALE), own_weights)


def test_selection_differs_compares_sets():
    first = torch.tensor([[0, 1, 2], [3, 4, 5]])
    assert selection_differs(first, torch.tensor([[2, 0, 1], [3, 4, 6]])).tolist() == [False, True]


def test_recording_changes_no_logit_and_replaying_the_record_gives_the_same_logits(model):
    ids = canvas()
    with torch.no_grad():
        plain = model(ids).logits
        with routing_tape(model, RoutingTape()) as tape:
            recorded = model(ids).logits
        with routing_tape(model, RoutingTape(tape.used)) as replayed_tape:
            replayed = model(ids).logits
    assert len(tape.own) == 2 and tape.own[0].shape == (ids.numel(), TOP_K)
    assert torch.equal(plain, recorded) and torch.equal(plain, replayed)
    assert all(torch.equal(a, b) for a, b in zip(tape.used, replayed_tape.used))
    assert all(layer.routing_tape is None for layer in model.model.layers[1:] for layer in [layer.mlp])


def test_a_replay_forces_the_recorded_experts_on_another_model_and_keeps_the_router_gradient(model):
    ids = canvas()
    other = perturbed(model)
    with torch.no_grad(), routing_tape(model, RoutingTape()) as record:
        model(ids)
    with routing_tape(other, RoutingTape(record.used)) as tape:
        replayed = other(ids).logits
    assert any(selection_differs(a, b).any() for a, b in zip(record.used, tape.own))  # its own routing differs
    assert all(torch.equal(a, b) for a, b in zip(record.used, tape.used))  # and the record's was used
    with torch.no_grad():
        own = other(ids).logits
    assert not torch.equal(replayed, own)
    replayed.logsumexp(-1).sum().backward()
    assert other.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_replay_refuses_a_record_of_other_inputs_a_dense_model_gradient_checkpointing_and_nesting(model):
    with torch.no_grad(), routing_tape(model, RoutingTape()) as record:
        model(canvas(length=12))
    with pytest.raises(ValueError, match="routes .* but the record holds"), torch.no_grad():
        with routing_tape(model, RoutingTape(record.used)):
            model(canvas(length=8))
    with pytest.raises(ValueError, match="2 recorded selections, 0 used"):
        with routing_tape(model, RoutingTape(record.used)):
            pass
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        with routing_tape(torch.nn.Linear(2, 2), RoutingTape()):
            pass
    with pytest.raises(ValueError, match="one routing tape at a time"):
        with routing_tape(model, RoutingTape()), routing_tape(model, RoutingTape()):
            pass
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing=false"):
        with routing_tape(model, RoutingTape(record.used)):
            pass


def test_engine_routing_replays_the_engines_selection_on_every_forward(model):
    engine = perturbed(model)
    ids = canvas()
    for replay in (False, True):
        with torch.no_grad(), EngineRouting(model, engine, replay) as routing:
            model(ids)
            model(ids)
        assert len(routing.forwards) == 2
        forward = routing.forwards[0]
        assert forward.own_differs.shape == (*ids.shape, 2) and forward.own_differs.any()
        assert forward.used_differs.any() != replay
    assert all(layer.mlp.routing_tape is None for layer in model.model.layers[1:])
    with pytest.raises(ValueError, match="cache-less"), torch.no_grad(), EngineRouting(model, engine):
        model(ids, use_cache=True)


def test_denoised_tokens_are_the_completion_positions_of_blocks_with_a_mask():
    ids = torch.tensor([[9, 9, 9, 9, 6, 8, 8, 8, 8, 8, 8, 8] + [9] * 12])  # prompt 4, blocks of 4; block 1 masked
    positions = torch.arange(12).repeat(2)[None]
    assert denoised_tokens(ids, positions, 2, 4, 6).long().tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]]


def test_bench_split_routing_disagrees_at_a_low_notch_and_replay_removes_it(model, tokenizer):
    config = load_config("recipes/tiny_sdar_digits.yaml", ["--output_dir=/tmp/unused", "--rollout.cache=none"])
    policy = with_trajectory_estimator(build_policy(config, model.config, tokenizer, temperature=1.0))
    input_ids, attention_mask = validation_prompts(config, tokenizer, 4, 0)
    arms, self_check = measure_routing(config, model, policy, "mxfp4", input_ids, attention_mask, seed=0)
    assert self_check.routing_share == 0  # the engine's replay routes the sampled canvases as sampling did
    for canvas_kind in ("one-step canvas", "trajectory"):
        split, replayed, unified = (arms[arm][canvas_kind] for arm in ("split", "replayed", "unified"))
        assert split.pair_share > 0 and split.ratio["k3"] > 0
        assert replayed.pair_share == 0 and replayed.token_share == 0
        assert unified.pair_share == 0
        assert replayed.ratio["k3"] < split.ratio["k3"]


def test_engine_routing_through_the_unified_flows_one_model_agrees_with_itself(model, tokenizer):
    RolloutEngine(model, precision="mxfp8", precision_flow="unified")
    with torch.no_grad(), EngineRouting(model, model, replay=False) as routing:
        model(canvas())
    assert not routing.forwards[0].own_differs.any()


def config_with(*overrides: str) -> GRPOConfig:
    return load_config("recipes/tiny_sdar_digits.yaml", ["--output_dir=/tmp/unused", "--experimental.routing_replay=true",
                                                         *overrides])


@pytest.mark.parametrize("overrides, needed", [
    ((), "likelihood.estimator=trajectory"),  # the recipe's one-step estimator
    (("--likelihood.estimator=trajectory",), "experimental.likelihood_decoder=exact"),  # its prefix cache, replayed
    (("--likelihood.estimator=trajectory", "--rollout.cache=none", "--rollout.precision_flow=unified"),
     "rollout.precision_flow=split"),
    (("--likelihood.estimator=trajectory", "--rollout.cache=none", "--gradient_checkpointing=true"),
     "gradient_checkpointing=false"),
    (("--likelihood.estimator=trajectory", "--rollout.cache=none", "--rollout.precision=nvfp4"),
     "not rollout.precision=nvfp4"),
])
def test_routing_replay_is_refused_where_the_engine_never_routed_the_scored_canvas(overrides, needed):
    with pytest.raises(ConfigError) as error:
        config_with(*overrides)
    assert needed in str(error.value) and "routing_replay=false" in str(error.value)


def test_routing_replay_is_accepted_with_the_cacheless_trajectory_replay():
    assert config_with("--likelihood.estimator=trajectory", "--rollout.cache=none").experimental.routing_replay


@pytest.mark.parametrize("lora", [False, True])
def test_a_training_step_replays_the_engines_routing_in_its_likelihood_passes(tokenizer, tmp_path, lora):
    """`experimental.routing_replay` on a GRPO step of the tiny random LLaDA2 at MXFP4, fully fine-tuned or with
    LoRA on the attention: ℓ_old's and ℓ_θ's forwards all use the engine's experts, where the trainer's own router
    would have chosen others."""
    from dllm_ais.tasks.digits import make_digits_dataset
    from dllm_ais.trainer import GRPOTrainer

    config = GRPOConfig(task="digits", eval_size=0, num_generations=2, per_device_train_batch_size=2,
                        max_completion_length=8, num_iterations=1, use_peft=lora, beta=0.0, max_prompt_length=64,
                        lora_r=2, lora_alpha=4, lora_target_modules=["query_key_value", "dense"],
                        lora_target_parameters=[], dtype="float32", output_dir=str(tmp_path),
                        rollout={"block_length": 4, "steps": 4, "precision": "mxfp4", "cache": "none"},
                        likelihood={"estimator": "trajectory"}, experimental={"routing_replay": True})
    config.validate()
    trainer = GRPOTrainer(config, model=random_llada2(tokenizer, seed=0), tokenizer=tokenizer,
                          train_dataset=make_digits_dataset(4, seed=1))
    contexts = []
    replay = trainer.parts.routing_replay
    trainer.parts.routing_replay = lambda: contexts.append(replay()) or contexts[-1]
    metrics = trainer.optimisation_pass(trainer.make_generation_batch(), 0)
    assert 0 < metrics["routing/trainer_engine_differs"] < 1
    forwards = [forward for context in contexts for forward in context.forwards]
    assert len(contexts) == 2 and forwards  # ℓ_old's pass, then the one micro-batch of ℓ_θ
    assert any(forward.own_differs.any() for forward in forwards)
    assert not any(forward.used_differs.any() for forward in forwards)


def test_bench_routing_prints_one_row_per_arm_and_zero_for_bf16(capsys):
    from dllm_ais.bench.routing import main

    main(["--precisions", "bf16", "--prompts", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| random-llada2 | bf16")]
    assert [row.split(" | ")[2] for row in rows] == ["split", "replayed", "unified"]
    cells = [row.removesuffix(" |").split(" | ") for row in rows]
    assert all(cell in ("0.0000", "0.00e+00", "0.000") for row in cells for cell in row[3:-2] + row[-1:])
    assert all(float(row[-2]) < 1e-4 for row in cells)  # the engine's replay of its own trajectory, to rounding


# --- The engine's routing recorded while sampling, forced by the decoder replay (experimental.routing_record) ---

RECORDED = ["--likelihood.estimator=trajectory", "--experimental.likelihood_decoder=rollout", "--rollout.cache=prefix",
            "--rollout.compile=false", "--experimental.routing_record=true"]


@pytest.fixture(scope="module")
def recorded_rollouts(tokenizer):
    """(model, sampler, {precision: (engine, rollout)}): 8 prompts sampled by the engine with the routing record and
    LLaDA2's exact block cache, at nvfp4 (activation scales over the batch) and bf16 (the model itself)."""
    model = random_llada2(tokenizer, seed=0)
    config = load_config("recipes/tiny_sdar_digits.yaml", ["--output_dir=/tmp/unused", *RECORDED])
    sampler = build_policy(config, model.config, tokenizer, temperature=1.0).sampler
    input_ids, attention_mask = validation_prompts(config, tokenizer, 8, 0)
    sampled = {}
    for precision in ("nvfp4", "bf16"):
        engine = RolloutEngine(model, precision=precision).model
        sampled[precision] = engine, sampler.sample(engine, input_ids, attention_mask, torch.Generator().manual_seed(0))
    return model, sampler, sampled


def replayed_routing(sampler, model, rollout, grad: bool):
    """(log-probs [B, L] of the written tokens along `decoder_logits`, the `RecordedRouting` that forced the record,
    its tapes kept)."""
    from dllm_ais.sampling.diffusion.routing_record import ROUTING, RecordedRouting

    routing = RecordedRouting(model, rollout.records[ROUTING], keep_tapes=True)
    replaying = copy.copy(sampler)
    replaying.routing_replay = lambda replayed_model, replayed: routing
    batch, length = rollout.completion_ids.shape
    logprobs = torch.zeros(batch, length + 1)  # the last column takes a block's positions off the completion
    with torch.set_grad_enabled(grad):
        for step in replaying.decoder_logits(model, rollout):
            scored = torch.where(step.written, replaying.token_logprobs(step.logits, step.tokens).detach(), 0.0)
            window = step.window
            if isinstance(window, slice):
                window = torch.arange(window.start, window.stop).expand(batch, -1)
            logprobs.scatter_add_(1, torch.where(window >= 0, window, length), scored)
    return logprobs[:, :length], routing


def tape_selections(tape):
    """(own, used) [B, n, layers, top_k] of one replay forward's tape."""
    rows = len(tape.steps)
    return tuple(torch.stack(calls, dim=1).view(rows, len(tape.positions), len(calls), -1)
                 for calls in (tape.own, tape.used))


def assert_record_used(routing, record):
    """Every replay forward used, at each (row, position, layer), the record's experts for that position at the
    row's step: a position of the forward's block its step's sampling selection, an earlier one its final
    selection; no token unrecorded."""
    assert routing.unrecorded.item() == 0 and routing.tapes
    for tape in routing.tapes:
        _, used = tape_selections(tape)
        for row, step in enumerate(tape.steps.tolist()):
            for index, position in enumerate(tape.positions.tolist()):
                expected = (record.step_selection[row, step, position - tape.block.start]
                            if position >= tape.block.start else record.final_selection[row, position])
                assert (expected >= 0).all() and torch.equal(used[row, index], expected.long())


def test_the_record_keys_the_engines_own_replay_of_its_forwards(recorded_rollouts):
    """The engine's no-grad replay of its full batch runs sampling's forwards one for one: forced by the record
    (the keying of every token of every forward), its own router agrees everywhere and its log-probs are the
    recorded ones bit for bit, at nvfp4 too."""
    from dllm_ais.sampling.diffusion.routing_record import ROUTING

    _, sampler, sampled = recorded_rollouts
    engine, rollout = sampled["nvfp4"]
    record = rollout.records[ROUTING]
    assert record.step_selection.dtype == torch.int16 and record.step_selection.shape[:3] == (
        8, int(rollout.commit_step.max()) + 1, sampler.config.block_length)
    logprobs, routing = replayed_routing(sampler, engine, rollout, grad=False)
    assert_record_used(routing, record)
    assert all(torch.equal(*tape_selections(tape)) for tape in routing.tapes)
    assert torch.equal(logprobs[rollout.completion_mask], rollout.step_logprobs[rollout.completion_mask])


def test_the_rebuild_under_grad_routes_finished_blocks_as_their_final_forward(recorded_rollouts):
    """Under grad the replay rebuilds the cache at each block's first step with one forward of [0, block.stop),
    which sampling never ran: at bf16 (no batch-scaled activations) the engine's own router, on every token of
    those forwards, agrees with the record (prompt and finished blocks: their final forward's selection) and the
    log-probs are the recorded ones to rounding; at nvfp4 its own router differs somewhere, the record is used."""
    from dllm_ais.sampling.diffusion.routing_record import ROUTING

    _, sampler, sampled = recorded_rollouts
    engine, rollout = sampled["bf16"]
    logprobs, routing = replayed_routing(sampler, engine, rollout, grad=True)
    assert_record_used(routing, rollout.records[ROUTING])
    assert any(tape.positions[0] == 0 and tape.block.start > 0 for tape in routing.tapes[1:])  # a rebuild
    assert all(torch.equal(*tape_selections(tape)) for tape in routing.tapes)
    torch.testing.assert_close(logprobs[rollout.completion_mask], rollout.step_logprobs[rollout.completion_mask],
                               atol=1e-5, rtol=0)
    engine, rollout = sampled["nvfp4"]
    forced, routing = replayed_routing(sampler, engine, rollout, grad=True)
    assert_record_used(routing, rollout.records[ROUTING])
    assert not all(torch.equal(*tape_selections(tape)) for tape in routing.tapes)


@pytest.mark.parametrize("grad", [False, True])
def test_the_trainers_decoder_replay_uses_the_recorded_selection_at_every_token(recorded_rollouts, grad):
    """ℓ_old (no grad: the cache written as sampled) and ℓ_θ (grad: the rebuild at each block's first step) of the
    float32 trainer on the nvfp4 engine's rollout: every (position, step, layer) routed to the recorded experts,
    where the trainer's own router chose others at some."""
    from dllm_ais.sampling.diffusion.routing_record import ROUTING

    model, sampler, sampled = recorded_rollouts
    _, rollout = sampled["nvfp4"]
    _, routing = replayed_routing(sampler, model, rollout, grad=grad)
    assert_record_used(routing, rollout.records[ROUTING])
    assert not all(torch.equal(*tape_selections(tape)) for tape in routing.tapes)


def test_routing_records_survive_select_and_concatenate(recorded_rollouts):
    from dllm_ais.rollout import Rollout
    from dllm_ais.sampling.diffusion.routing_record import ROUTING, RoutingRecord

    _, _, sampled = recorded_rollouts
    _, rollout = sampled["nvfp4"]
    record = rollout.records[ROUTING]
    shorter = rollout.select(slice(2, 4))
    cut = RoutingRecord(shorter.records[ROUTING].step_selection[:, :-1], shorter.records[ROUTING].final_selection,
                        shorter.records[ROUTING].block_first_step)  # a call with a step fewer
    shorter.records[ROUTING] = cut
    joined = Rollout.concatenate([rollout.select(slice(0, 2)), shorter]).records[ROUTING]
    assert torch.equal(joined.step_selection[:2], record.step_selection[:2])
    assert torch.equal(joined.step_selection[2:, :-1], record.step_selection[2:4, :-1])
    assert (joined.step_selection[2:, -1] == -1).all()
    assert torch.equal(joined.final_selection, record.final_selection[:4])
    assert torch.equal(joined.block_first_step, record.block_first_step[:4])


def test_a_sampler_refuses_to_record_without_the_block_cache(recorded_rollouts):
    import dataclasses

    _, sampler, sampled = recorded_rollouts
    engine, rollout = sampled["bf16"]
    uncached = sampler.with_config(dataclasses.replace(sampler.config, cache="none"))
    with pytest.raises(ValueError, match="exact block cache"):
        uncached.sample(engine, rollout.prompt_ids[:1])


@pytest.mark.parametrize("overrides, needed", [
    (("--experimental.likelihood_decoder=exact",), "experimental.likelihood_decoder=rollout"),
    (("--rollout.cache=none",), "a rollout.cache"),
    (("--likelihood.estimator=one_step",), "likelihood.estimator=trajectory"),
    (("--rollout.compile=true",), "rollout.compile=false"),
    (("--experimental.routing_replay=true",), "experimental.routing_replay=false"),
    (("--gradient_checkpointing=true",), "gradient_checkpointing=false"),
])
def test_routing_record_is_refused_outside_the_eager_engine_and_the_decoder_replay(overrides, needed):
    with pytest.raises(ConfigError) as error:
        load_config("recipes/tiny_sdar_digits.yaml", ["--output_dir=/tmp/unused", *RECORDED, *overrides])
    assert needed in str(error.value) and "routing_record=false" in str(error.value)


def test_routing_record_is_accepted_with_the_block_cache_at_a_batch_scaled_notch():
    config = load_config("recipes/tiny_sdar_digits.yaml", ["--output_dir=/tmp/unused", *RECORDED,
                                                           "--rollout.precision=nvfp4"])
    assert config.experimental.routing_record and config.replays_decoder
    assert not config.decoding(exact=False).experimental.routing_record


def test_a_training_step_forces_the_recorded_routing_in_its_decoder_replays(tokenizer, tmp_path):
    """`experimental.routing_record` on a GRPO step of the tiny random LLaDA2 at nvfp4 with the block cache: the
    rollout carries the record, and ℓ_old's and ℓ_θ's decoder replays route every token to it."""
    from dllm_ais.sampling.diffusion.routing_record import ROUTING, RecordedRouting
    from dllm_ais.tasks.digits import make_digits_dataset
    from dllm_ais.trainer import GRPOTrainer

    config = GRPOConfig(task="digits", eval_size=0, num_generations=2, per_device_train_batch_size=2,
                        max_completion_length=8, num_iterations=1, use_peft=False, beta=0.0, max_prompt_length=64,
                        dtype="float32",
                        output_dir=str(tmp_path),
                        rollout={"block_length": 4, "steps": 4, "precision": "nvfp4", "cache": "prefix",
                                 "compile": False},
                        likelihood={"estimator": "trajectory"}, experimental={"routing_record": True})
    config.validate()
    trainer = GRPOTrainer(config, model=random_llada2(tokenizer, seed=0), tokenizer=tokenizer,
                          train_dataset=make_digits_dataset(4, seed=1))
    sampler, replays = trainer.parts.policy.sampler, []
    sampler.routing_replay = lambda model, rollout: replays.append(
        RecordedRouting(model, rollout.records[ROUTING], keep_tapes=True)) or replays[-1]
    batch = trainer.make_generation_batch()
    assert ROUTING in batch.rollout.records
    trainer.optimisation_pass(batch, 0)
    assert len(replays) >= 2 and all(replay.tapes and replay.unrecorded.item() == 0 for replay in replays)
    assert any(not torch.equal(*tape_selections(tape)) for replay in replays for tape in replay.tapes)

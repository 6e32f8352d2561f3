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

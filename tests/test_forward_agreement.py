"""Sharded sampling forwards agree on how many forwards run (`dllm_ais.sampling.forwards.EagerForwards.agreed`).

Under FSDP2 every forward of the sharded model gathers its weights on every process at once, so the samplers' host
reads that decide how many forwards run (parallel decoding's masked positions left, a block-causal model's masked
positions per block and per step, token editing's end, the autoregressive stop, the decoder replay's steps per block)
are made the same on every process: counts their maximum, "finished" flags their AND.

The unit tests fake the other process (`dist.all_reduce` patched); the slow ones spawn 2 gloo processes that shard
the embedded models with `fully_shard` and sample prompts that need different numbers of steps on each process.
"""

import os
import socket
from contextlib import closing

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dllm_ais.models.sharding import agreed_across_processes, is_sharded
from dllm_ais.sampling.forwards import EagerForwards


def other_process_holds(values: list[int]):
    """A stand-in for `dist.all_reduce(op=MAX)` in a 2-process group whose other process holds `values` (as
    `agreed_across_processes` encodes them: a "min" element negated)."""
    def all_reduce(tensor, op=None, group=None):
        assert op == dist.ReduceOp.MAX
        tensor.copy_(torch.maximum(tensor, torch.tensor(values, dtype=tensor.dtype)))
    return all_reduce


def test_agreed_counts_are_the_maximum_and_flags_the_and_over_the_processes(monkeypatch):
    # this process: 3 masked positions left, 5 steps needed, its rows finished; the other: 7, 2, not finished
    monkeypatch.setattr(dist, "all_reduce", other_process_holds([7, 2, -0]))
    agreed = agreed_across_processes(torch.tensor([3, 5, 1]), ("max", "max", "min"))
    assert agreed.tolist() == [7, 5, 0] and agreed.dtype == torch.long
    monkeypatch.setattr(dist, "all_reduce", other_process_holds([-1, -1]))  # the other's rows have all finished
    assert agreed_across_processes(torch.tensor([True, False]), "min").tolist() == [True, False]
    monkeypatch.setattr(dist, "all_reduce", other_process_holds([0, 4]))
    assert agreed_across_processes(torch.tensor([[2], [1]]), "max").tolist() == [[2], [4]]  # shape kept
    with pytest.raises(ValueError, match="op 'max' or 'min'"):
        agreed_across_processes(torch.tensor([1, 2]), ("max",))


def test_unsharded_forwards_agree_with_themselves_without_a_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("an unsharded model's forwards ran a collective")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    model = nn.Linear(2, 2)
    assert not is_sharded(model)  # no process group
    values = torch.tensor([3, 0])
    assert EagerForwards(model).agreed(values, ("max", "min")) is values
    monkeypatch.setattr(dist, "all_reduce", other_process_holds([9, 9]))
    assert EagerForwards(model, shared=True).agreed(values).tolist() == [9, 9]  # handed in: shared


# --- two gloo processes, the embedded models sharded by fully_shard ------------------------------------------------

def free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def forward_counter(model: nn.Module) -> list[int]:
    count = [0]
    model.register_forward_pre_hook(lambda *args: count.__setitem__(0, count[0] + 1))
    return count


def sharded(name: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from dllm_ais.loading import load_model

    torch.manual_seed(0)
    model = load_model(name, torch.float32).eval().requires_grad_(False)
    fully_shard(model)
    return model


def sample(policy, model: nn.Module, prompts, seed: int) -> tuple[dict, object]:
    """`policy` sampling `prompts` with `model`: its forwards and the rollout."""
    count = forward_counter(model)
    rollout = policy.sampler.sample(model, prompts.input_ids, prompts.attention_mask,
                                    generator=torch.Generator().manual_seed(seed))
    return {"forwards": count[0], "sequences": rollout.sequences.tolist()}, rollout


def diffusion_case(rank: int, name: str, rollout: dict, temperature: float = 0.0, replay: bool = False) -> dict:
    """2 prompts of process-specific lengths sampled by the embedded `name`, sharded and alone (unsharded, no
    agreement): the forwards each ran and the completions; with `replay`, the forwards of the sharded decoder
    replay."""
    from conftest import config_of
    from dllm_ais.loading import load_tokenizer
    from dllm_ais.policy import build_policy

    tokenizer = load_tokenizer(name)
    model = sharded(name)
    policy = build_policy(config_of(model_name_or_path=name, max_completion_length=16, rollout=rollout,
                                    temperature=temperature), model.config, tokenizer)
    texts = ["1 2 3", "4 5"] if rank == 0 else ["9 8 7 6 5 4 3 2 1 0 1 2 3 4 5", "0"]
    prompts = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    result, rollout_ = sample(policy, model, prompts, rank)
    result["alone"], _ = sample(policy, model_alone(name), prompts, rank)
    if replay:
        count = forward_counter(model)
        with torch.no_grad():
            steps = list(policy.sampler.decoder_logits(model, rollout_))
        result["replay_forwards"] = count[0]
        result["replay_steps"] = len(steps)
    return result


def model_alone(name: str) -> nn.Module:
    from dllm_ais.loading import load_model

    return load_model(name, torch.float32).eval().requires_grad_(False)


def autoregressive_case(rank: int) -> dict:
    from conftest import config_of
    from dllm_ais.loading import load_tokenizer
    from dllm_ais.policy import build_policy

    name = "embedded-qwen3"
    tokenizer = load_tokenizer(name)
    model = sharded(name)
    policy = build_policy(config_of(model_name_or_path=name, policy="autoregressive", max_completion_length=24,
                                    temperature=1.0), model.config, tokenizer)
    prompts = tokenizer(["1 2", "3"] if rank == 0 else ["sort 3 1 2", "7 7"], return_tensors="pt", padding=True,
                        padding_side="left")
    result, _ = sample(policy, model, prompts, 100 + rank)
    result["alone"], _ = sample(policy, model_alone(name), prompts, 100 + rank)
    return result


CASES = {  # temperature 0 where the draws after a process's rows are done would differ from its draws alone
    "llada-threshold": lambda rank: diffusion_case(rank, "embedded", {"threshold": 0.5, "block_length": 8}),
    "llada-threshold-dual-cache": lambda rank: diffusion_case(
        rank, "embedded", {"threshold": 0.5, "block_length": 8, "cache": "dual"}, replay=True),
    "sdar-schedule": lambda rank: diffusion_case(
        rank, "embedded-sdar", {"block_length": 4, "steps": 8, "cache": "prefix", "remasking": "maskgit_plus",
                                "threshold": None}, temperature=1.0, replay=True),
    "sdar-threshold": lambda rank: diffusion_case(
        rank, "embedded-sdar", {"block_length": 4, "steps": 8, "cache": "prefix", "threshold": 0.5}),
    "qwen3-autoregressive": autoregressive_case,
}


def worker(rank: int, port: int, case: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = {**CASES, **BACKWARD_CASES}[case](rank)
    finally:
        dist.destroy_process_group()


def on_two_processes(case: str) -> tuple[dict, dict]:
    """What `case` returns on each of 2 gloo processes."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(free_port(), case, results), nprocs=2, join=True)
        return dict(results[0]), dict(results[1])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_processes_run_the_same_forwards_whatever_their_prompts_need(case):
    """Each process alone would run a different number of forwards; sharded, both run the same (the most either
    needs), and each process's completions are those it samples alone."""
    first, second = on_two_processes(case)
    print(case, {rank: {key: value for key, value in result.items() if key != "sequences"}
                 for rank, result in enumerate((first, second))})
    assert first["alone"]["forwards"] != second["alone"]["forwards"]  # the prompts need different numbers of steps
    assert first["forwards"] == second["forwards"] >= max(first["alone"]["forwards"], second["alone"]["forwards"])
    for result in (first, second):
        assert result["sequences"] == result["alone"]["sequences"]
    if "replay_forwards" in first:
        assert first["replay_forwards"] == second["replay_forwards"] > 0


# --- the backward: a sharded trainer's likelihood pieces, whatever each process's commit steps ----------------------

def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, whole (a sharded one gathered from its shards)."""
    return {name: (parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad).clone()
            for name, parameter in model.named_parameters() if parameter.grad is not None}


def backpropagate_pieces(policy, model: nn.Module, rollout) -> int:
    """Σ log-probs of the policy's likelihood pieces, backpropagated piece by piece as the trainer does; the number
    of forwards that took."""
    count = forward_counter(model)
    for piece in policy.logprob_pieces(model, rollout, seed=0):
        piece.logprobs.sum().backward()
    return count[0]


def backward_case(rank: int, name: str, rollout: dict) -> dict:
    """The trajectory estimator's pieces of 2 prompts of process-specific lengths, backpropagated through the sharded
    model and, on the same rollout, through an unsharded copy alone: the forwards each took and the gradients."""
    from conftest import config_of
    from torch.distributed.fsdp import fully_shard
    from dllm_ais.loading import load_tokenizer
    from dllm_ais.policy import build_policy

    tokenizer = load_tokenizer(name)
    model, alone = model_alone(name).requires_grad_(True), model_alone(name).requires_grad_(True)
    fully_shard(model)
    policy = build_policy(config_of(model_name_or_path=name, max_completion_length=16, rollout=rollout,
                                    likelihood={"estimator": "trajectory"}, temperature=1.0), model.config, tokenizer)
    texts = ["1 2 3", "4 5"] if rank == 0 else ["9 8 7 6 5 4 3 2 1 0 1 2 3 4 5", "0"]
    prompts = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        rollout_ = policy.sample(model, prompts.input_ids, prompts.attention_mask, torch.Generator().manual_seed(rank))
    return {"forwards": backpropagate_pieces(policy, model, rollout_), "gradients": gradients(model),
            "alone": {"forwards": backpropagate_pieces(policy, alone, rollout_), "gradients": gradients(alone)}}


BACKWARD_CASES = {
    "llada-threshold-exact-replay": lambda rank: backward_case(
        rank, "embedded", {"threshold": 0.5, "block_length": 8, "cache": "none"}),
    "llada-threshold-dual-cache-decoder-replay": lambda rank: backward_case(
        rank, "embedded", {"threshold": 0.5, "block_length": 8, "cache": "dual"}),
    "sdar-threshold-exact-replay": lambda rank: backward_case(
        rank, "embedded-sdar", {"block_length": 4, "steps": 16, "cache": "none", "threshold": 0.2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_a_sharded_trainers_pieces_run_in_step_and_their_gradient_is_the_processes_mean(case):
    """Alone, each process's trajectory replay takes a different number of forwards (its own commit steps); sharded,
    both take the same — a process's extra forwards score nothing but are backpropagated, so every gathering of the
    weights in the backward has its partner — and the reduced gradient is the mean of the two processes' gradients
    alone."""
    first, second = on_two_processes(case)
    print(case, {rank: (result["forwards"], result["alone"]["forwards"]) for rank, result in enumerate((first, second))})
    assert first["alone"]["forwards"] != second["alone"]["forwards"]
    assert first["forwards"] == second["forwards"] == max(first["alone"]["forwards"], second["alone"]["forwards"])
    assert first["gradients"].keys() == first["alone"]["gradients"].keys()
    for name, gradient in first["gradients"].items():
        mean_alone = (first["alone"]["gradients"][name] + second["alone"]["gradients"][name]) / 2
        torch.testing.assert_close(gradient, second["gradients"][name])
        torch.testing.assert_close(gradient, mean_alone, rtol=1e-4, atol=1e-5)

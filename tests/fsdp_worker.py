"""Run by test_fsdp.py in each of 2 CPU processes: `accelerate launch --config_file recipes/accelerate/fsdp.yaml
--cpu --num_processes 2 --mixed_precision no tests/fsdp_worker.py OUTPUT_DIR --field=value ...`.

1. A LoRA run into OUTPUT_DIR/lora (the reference the test compares an interrupted and resumed CLI run with), then
   one more step with a NaN gradient on process 1 only, which every process must skip.
2. A fully fine-tuned run into OUTPUT_DIR/full, then its resumption from `checkpoint-1` into OUTPUT_DIR/full-resumed,
   whose metrics must equal the uninterrupted run's.

After each run every process syncs its rollout engine from the sharded (DTensor) weights; the engine must equal, bit
for bit, an engine built from the model the run saved in `final/` (loaded unsharded, its adapter merged).
"""

import math
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.engine import RolloutEngine
from dllm_ais.launch import end_process_group, relaunch_as_cpu_processes, requested_cpu_launch
from dllm_ais.loading import load_model
from dllm_ais.trainer import GRPOTrainer
from test_resume import comparable  # this script's directory, tests/, is on sys.path


def train(output_dir: Path, *overrides: str):
    trainer = GRPOTrainer(load_config(EMBEDDED_RECIPE, [*sys.argv[2:], f"--output_dir={output_dir}", *overrides]))
    assert trainer.accelerator.is_fsdp2 and all(isinstance(p, DTensor) for p in trainer.model.parameters())
    history = trainer.train().history
    trainer.engine.sync_from(trainer.unwrapped_model)
    expected = RolloutEngine(load_model(str(output_dir / "final"), torch.float32),
                             precision=trainer.config.rollout.precision).model.state_dict()
    engine = trainer.engine.model.state_dict()
    assert engine.keys() == expected.keys()
    differing = [name for name in engine if not torch.equal(engine[name], expected[name])]
    assert not differing, f"engine differs from {output_dir / 'final'} in {differing[:5]}"
    print(f"process {trainer.accelerator.process_index}: engine synced from DTensors == {output_dir.name}/final "
          f"({len(engine)} tensors)", flush=True)
    return trainer, history


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def check_a_nan_gradient_on_one_process_skips_the_batch_on_all(trainer):
    """The NaN reaches every process through the gradient reduce-scatter; the gradient norm FSDP2 returns is a
    DTensor, NaN on every process, so all skip the batch before the optimizer moves weights or AdamW moments."""
    pieces = trainer.policy.logprob_pieces

    def poisoned(model, rollout, seed, compute_entropy=False, advantages=None):
        for piece in pieces(model, rollout, seed, compute_entropy, advantages):
            if torch.is_grad_enabled() and trainer.accelerator.process_index == 1:
                piece.logprobs.register_hook(lambda grad: torch.full_like(grad, math.nan))
            yield piece

    def snapshot():
        moments = [local(value).clone() for state in trainer.optimizer.state.values() for value in state.values()]
        return [local(p).detach().clone() for p in trainer.trainable_parameters] + moments

    before = snapshot()
    trainer.policy.logprob_pieces = poisoned
    assert trainer.training_step() is None and trainer.skipped_batches == 1
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))
    print(f"process {trainer.accelerator.process_index}: NaN gradient skipped, weights and optimizer untouched",
          flush=True)


if __name__ == "__main__":
    if launch := requested_cpu_launch():
        sys.exit(relaunch_as_cpu_processes(launch))
    root = Path(sys.argv[1])
    check_a_nan_gradient_on_one_process_skips_the_batch_on_all(train(root / "lora")[0])
    trainer, uninterrupted = train(root / "full", "--use_peft=false", "--max_steps=2", "--save_steps=1")
    resumed = train(root / "full-resumed", "--use_peft=false", "--max_steps=2",
                    f"--resume_from_checkpoint={root / 'full' / 'checkpoint-1'}")[1]
    if trainer.accelerator.is_main_process:
        assert len(uninterrupted) == 2 and comparable(resumed) == comparable(uninterrupted), (resumed, uninterrupted)
        print("full fine-tuning resumed exactly", flush=True)
    del trainer  # the trainers' DDP/FSDP wrappers go with the process group (end_process_group's collection)
    end_process_group()

"""The embedded tiny LLaDA2 (`embedded-llada2`, `tools/build_tiny_model.py --family llada2`) and its recipe
(`recipes/tiny_llada2_digits.yaml`, shipped as the asset's `recipe.yaml`): it loads through the Auto classes as a
LLaDA2 MoE, greedy rollouts with the recipe's decoder settings answer the digits task, the recipe's FP8 engine
quantizes its experts, and the recipe's dry run passes."""

import tempfile
from pathlib import Path

from conftest import embedded_block_model_answers
import dllm_ais  # noqa: F401  (registers "llada2_moe")
from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODELS
from dllm_ais.engine import RolloutEngine
from dllm_ais.models import LLaDA2MoeModelLM

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny_llada2_digits.yaml"


def test_the_asset_ships_the_recipe():
    assert (EMBEDDED_MODELS["embedded-llada2"] / "recipe.yaml").read_text() == RECIPE.read_text()


def test_embedded_llada2_loads_as_llada2_and_a_greedy_rollout_with_the_recipes_settings_answers():
    model, config = embedded_block_model_answers("embedded-llada2", RECIPE, LLaDA2MoeModelLM)
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (8, 2)
    assert sum(param.numel() for param in model.parameters()) * 4 < 4 * 2**20  # a few MB, as the other tiny models
    engine = RolloutEngine(model, config.rollout.precision)
    assert sum(name.endswith("mlp.experts") for name in engine.quantized_modules) == 3  # every MoE layer's experts


def test_the_recipes_dry_run_passes(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["train", str(RECIPE), "--dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "dry run OK" in out and "policy=diffusion" in out
    assert list(tmp_path.iterdir()) == []

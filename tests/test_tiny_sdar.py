"""The embedded tiny SDAR (`embedded-sdar`, `tools/build_tiny_model.py --family sdar`) and its recipe
(`recipes/tiny_sdar_digits.yaml`, shipped as the asset's `recipe.yaml`): it loads through the Auto classes as an
SDAR, greedy rollouts with the recipe's decoder settings answer the digits task, and the recipe's dry run passes."""

import tempfile
from pathlib import Path

from conftest import embedded_block_model_answers
import dllm_ais  # noqa: F401  (registers "sdar")
from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODELS
from dllm_ais.models import SDARForCausalLM

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny_sdar_digits.yaml"


def test_the_asset_ships_the_recipe():
    assert (EMBEDDED_MODELS["embedded-sdar"] / "recipe.yaml").read_text() == RECIPE.read_text()


def test_embedded_sdar_loads_as_sdar_and_a_greedy_rollout_with_the_recipes_settings_answers():
    embedded_block_model_answers("embedded-sdar", RECIPE, SDARForCausalLM)


def test_the_recipes_dry_run_passes(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["train", str(RECIPE), "--dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "dry run OK" in out and "policy=diffusion" in out
    assert list(tmp_path.iterdir()) == []


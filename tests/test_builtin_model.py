"""The built-in default model: deterministic build, cache reuse, and that warm-up worked."""

from __future__ import annotations

import json

import pytest

from mileage.models.tiny import WARMUP_RECIPE, builtin_model_dir, ensure_builtin_model


@pytest.mark.slow
def test_building_twice_gives_identical_weights(mileage_home, tmp_path, monkeypatch):
    first = ensure_builtin_model("addition", log=lambda *_: None)
    assert first == builtin_model_dir("addition") and first.is_relative_to(mileage_home)
    assert ensure_builtin_model("addition", log=lambda *_: None) == first  # cached: no rebuild
    monkeypatch.setenv("MILEAGE_HOME", str(tmp_path))
    second = ensure_builtin_model("addition", log=lambda *_: None)
    assert second != first
    assert (second / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    info = json.loads((second / "mileage_builtin.json").read_text())
    assert (
        info["accuracy"] >= WARMUP_RECIPE["target_accuracy"]
        and info["steps"] < WARMUP_RECIPE["max_steps"]
    )

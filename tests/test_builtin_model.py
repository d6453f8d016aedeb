"""The built-in default model: deterministic build, cache reuse, and that warm-up worked."""

from __future__ import annotations

import json

from mileage.models.tiny import WARMUP_RECIPE, builtin_model_dir, ensure_builtin_model


def test_the_built_model_is_cached_and_reached_its_target(builtin_model, mileage_home):
    first = ensure_builtin_model("addition", log=lambda *_: None)
    assert first == builtin_model == builtin_model_dir("addition")
    assert first.is_relative_to(mileage_home)
    info = json.loads((first / "mileage_builtin.json").read_text())
    assert (
        info["accuracy"] >= WARMUP_RECIPE["target_accuracy"]
        and info["steps"] < WARMUP_RECIPE["max_steps"]
    )


def test_building_twice_gives_identical_weights(tmp_path, monkeypatch):
    """The same build code twice, on a 20-step recipe (the full one takes a minute; the
    session's model above is the full build): byte-identical weights."""
    monkeypatch.setitem(WARMUP_RECIPE, "max_steps", 20)
    monkeypatch.setitem(WARMUP_RECIPE, "target_accuracy", 2.0)  # never reached: all 20 steps
    monkeypatch.setitem(WARMUP_RECIPE, "check_size", 32)
    builds = []
    for name in ("one", "two"):
        monkeypatch.setenv("MILEAGE_HOME", str(tmp_path / name))
        built = ensure_builtin_model("addition", log=lambda *_: None)
        assert json.loads((built / "mileage_builtin.json").read_text())["steps"] == 20
        builds.append((built / "model.safetensors").read_bytes())
    assert builds[0] == builds[1]

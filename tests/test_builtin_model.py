"""The built-in default model: the shipped weights (pinned, verified, unpacked into the cache
without training) and the deterministic warm-up that builds them."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from mileage.errors import UserError
from mileage.models.hf import load_causal_lm, load_tokenizer
from mileage.rollout import builtin_model as tiny
from mileage.rollout.builtin_model import (
    SHIPPED_DIR,
    SHIPPED_WEIGHTS,
    WARMUP_RECIPE,
    build_builtin_weights,
    builtin_model_dir,
    builtin_tokenizer,
    ensure_builtin_model,
    file_sha256,
    greedy_accuracy,
)
from mileage.rollout.tasks import builtin_task


def _no_training(*_args, **_kwargs):
    raise AssertionError("a shipped built-in model must not be trained on this machine")


SHORT_STEPS = 10


@pytest.fixture
def short_recipe(monkeypatch):
    """A 10-step recipe with one accuracy check for the builds below (the full one takes
    minutes; the shipped model above is the full one)."""
    monkeypatch.setitem(WARMUP_RECIPE, "max_steps", SHORT_STEPS)
    monkeypatch.setitem(WARMUP_RECIPE, "target_accuracy", 2.0)  # never reached: every step runs
    monkeypatch.setitem(WARMUP_RECIPE, "batch_size", 32)
    monkeypatch.setitem(WARMUP_RECIPE, "warmup_steps", 4)
    monkeypatch.setitem(WARMUP_RECIPE, "check_every", SHORT_STEPS)
    monkeypatch.setitem(WARMUP_RECIPE, "check_size", 16)


def test_the_shipped_model_is_the_warmed_up_one_pinned_and_cached(builtin_model, mileage_home):
    first = ensure_builtin_model("addition", log=lambda *_: None)
    assert first == builtin_model == builtin_model_dir("addition")
    assert first.is_relative_to(mileage_home)
    pinned = SHIPPED_WEIGHTS["addition"]
    assert file_sha256(SHIPPED_DIR / "addition.safetensors") == pinned
    assert file_sha256(first / "model.safetensors") == pinned
    info = json.loads((first / "mileage_builtin.json").read_text())
    assert info["source"] == "shipped" and info["sha256"] == pinned
    assert (
        info["accuracy"] >= WARMUP_RECIPE["target_accuracy"]
        and info["steps"] < WARMUP_RECIPE["max_steps"]
        and {k: info[k] for k in WARMUP_RECIPE} == json.loads(json.dumps(WARMUP_RECIPE))
    )
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    with safe_open(first / "model.safetensors", "pt") as f:  # full fp32, not a cast copy
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert {str(t.dtype) for t in tensors.values()} == {"torch.float32"}
    assert sum(t.numel() for t in tensors.values()) > 3_000_000
    # the warm-up's result, not an initialisation (which answers nothing right)
    model, tokenizer = load_causal_lm(first), load_tokenizer(first)
    check = builtin_task("addition")[0][: WARMUP_RECIPE["check_size"]]
    assert greedy_accuracy(model, tokenizer, check) >= WARMUP_RECIPE["target_accuracy"]


def test_a_fresh_home_unpacks_it_without_training_and_repairs_a_damaged_cache(
    builtin_model, tmp_path, monkeypatch
):
    monkeypatch.setenv("MILEAGE_HOME", str(tmp_path))
    monkeypatch.setattr(tiny, "sft_warm_up", _no_training)
    logs: list[str] = []
    target = ensure_builtin_model("addition", log=logs.append)
    assert logs == [] and target == builtin_model_dir("addition")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (target / name).read_bytes() == (builtin_model / name).read_bytes(), name
    data = bytearray((target / "model.safetensors").read_bytes())
    data[-1] ^= 1  # one flipped bit of the last weight
    (target / "model.safetensors").write_bytes(data)
    assert ensure_builtin_model("addition", log=logs.append) == target
    assert logs == [f"{target / 'model.safetensors'} is not the shipped built-in addition model; "
                    "unpacking it again"]  # fmt: skip
    assert file_sha256(target / "model.safetensors") == SHIPPED_WEIGHTS["addition"]
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # nothing left over


@pytest.mark.parametrize("damage", ["flipped", "lfs-pointer", "truncated", "missing"])
def test_damaged_shipped_weights_are_refused_in_one_line(damage, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR, shipped)
    weights = shipped / "addition.safetensors"
    data = weights.read_bytes()
    if damage == "flipped":
        weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "lfs-pointer":
        weights.write_text(
            "version https://git-lfs.github.com/spec/v1\n"
            f"oid sha256:{SHIPPED_WEIGHTS['addition']}\nsize {len(data)}\n"
        )
    elif damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.unlink()
    monkeypatch.setattr(tiny, "SHIPPED_DIR", shipped)
    monkeypatch.setenv("MILEAGE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tiny, "sft_warm_up", _no_training)
    expected = "missing from this install" if damage == "missing" else "is damaged"
    with pytest.raises(UserError, match=expected) as caught:
        ensure_builtin_model("addition", log=lambda *_: None)
    assert "\n" not in str(caught.value) and str(weights) in str(caught.value)
    assert list((tmp_path / "home" / "builtin").iterdir()) == []  # nothing half-made is cached


def test_a_build_is_the_same_however_often_checked_and_ships_as_built(
    short_recipe, tmp_path, monkeypatch
):
    """A task that is not shipped, built twice: by scripts/build_builtin_model.py's function with
    one accuracy check, and on first use in a home with a check every 5 steps, where the warm-up
    runs `mileage sft` twice (5 rollouts, then raised to 10). The same bytes: the checks resume
    the run, they do not change it. Then pinned and shipped, it unpacks as built."""
    assert "reversal" not in SHIPPED_WEIGHTS
    maintainer = build_builtin_weights("reversal", tmp_path / "a", log=lambda *_: None)
    sha = file_sha256(maintainer)
    info = json.loads((tmp_path / "a" / "reversal.json").read_text())
    assert info["sha256"] == sha and info["steps"] == SHORT_STEPS and info["built_on"]["cpu"]
    assert sorted(p.name for p in maintainer.parent.iterdir()) == ["reversal.json",
                                                                    maintainer.name]  # fmt: skip
    # a run killed at a fault point builds the model on first use: the point aims at that run,
    # not at the warm-up's `mileage sft` (which would die there at its first step)
    monkeypatch.setenv("MILEAGE_KILL_AT", "after_train")
    every = SHORT_STEPS // 2
    monkeypatch.setitem(WARMUP_RECIPE, "check_every", every)
    monkeypatch.setenv("MILEAGE_HOME", str(tmp_path / "home"))
    logs: list[str] = []
    built = ensure_builtin_model("reversal", log=logs.append)
    info = json.loads((built / "mileage_builtin.json").read_text())
    assert info["steps"] == SHORT_STEPS and info["source"] == "built here"
    checks = [line.split()[2] for line in logs if line.startswith("  warm-up step")]
    assert checks == [str(s) for s in range(every, SHORT_STEPS + 1, every)], logs
    assert (built / "model.safetensors").read_bytes() == maintainer.read_bytes()
    assert "not across CPU instruction sets" in logs[0]
    model, tokenizer = load_causal_lm(built), load_tokenizer(built)
    assert tokenizer("ab=")["input_ids"] == builtin_tokenizer("reversal")("ab=")["input_ids"]
    assert not getattr(tokenizer, "chat_template", None)  # only the tool task's SFT data needs one
    assert sum(p.numel() for p in model.parameters()) > 3_000_000
    monkeypatch.setattr(tiny, "sft_warm_up", _no_training)  # the second call finds it cached
    assert ensure_builtin_model("reversal", log=logs.append) == built
    # shipped: a fresh home unpacks the maintainer's file, verified, without training
    monkeypatch.setattr(tiny, "SHIPPED_DIR", tmp_path / "a")
    monkeypatch.setitem(SHIPPED_WEIGHTS, "reversal", sha)
    monkeypatch.setenv("MILEAGE_HOME", str(tmp_path / "shipped-home"))
    target = ensure_builtin_model("reversal", log=lambda *_: None)
    assert target.name == f"tiny-reversal-{sha[:12]}"
    assert (target / "model.safetensors").read_bytes() == maintainer.read_bytes()


def test_a_warm_up_that_fails_says_so_in_one_line(short_recipe, tmp_path, monkeypatch):
    monkeypatch.setitem(WARMUP_RECIPE, "batch_size", 0)
    monkeypatch.setenv("MILEAGE_HOME", str(tmp_path))
    with pytest.raises(UserError) as caught:
        ensure_builtin_model("reversal", log=lambda *_: None)
    said = str(caught.value)
    assert (
        said.startswith("the built-in model's warm-up: mileage sft failed: ") and "\n" not in said
    )
    assert "--rollout-batch-size" in said, said
    assert list((tmp_path / "builtin").iterdir()) == []  # nothing half-made is cached

"""ckpt ls/verify digests, convert -> raw mode, export-hf, --save-hf, retention, async save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import fast_train_args
from transformers import AutoModelForCausalLM

from mileage.checkpoint.layout import read_tracker
from mileage.checkpoint.tensors import load_tensors, tensor_digest


def ls(cli, save) -> list[dict]:
    out = cli("ckpt", "ls", save, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_retention_digests_and_hf_export(cli, tiny_hf, tmp_path, async_save):
    save = tmp_path / "run"
    hf_template = str(tmp_path / "hf" / "rollout_{rollout_id}")
    extra = ["--async-save"] if async_save else []
    done = cli(
        "train",
        *fast_train_args(tiny_hf),
        "--num-rollout",
        4,
        "--save-interval",
        1,
        "--save-keep-last",
        2,
        "--save-hf",
        hf_template,
        "--save",
        save,
        "--load",
        save,
        *extra,
    )
    assert done.returncode == 0, done.stderr
    rows = ls(cli, save)
    assert [r["name"] for r in rows] == ["iter_0000002", "iter_0000003"]  # keep-last 2
    assert [r["tracked"] for r in rows] == [False, True] and all(r["complete"] for r in rows)
    model = load_tensors(save / "iter_0000003" / "model")
    assert rows[-1]["model_digest"] == tensor_digest(model)
    assert rows[-1]["optimizer_digest"] == tensor_digest(
        load_tensors(save / "iter_0000003" / "optimizer")
    )
    assert cli("ckpt", "verify", save).returncode == 0
    for rollout_id in range(4):  # --save-hf survives retention: they are exports, not checkpoints
        exported = AutoModelForCausalLM.from_pretrained(hf_template.format(rollout_id=rollout_id))
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in model.items())


def test_same_flags_same_digests(cli, builtin_model, tmp_path):
    from conftest import assert_learned, builtin_train_args

    digests = []
    for name in ("a", "b"):
        save = tmp_path / name
        done = cli("train", *builtin_train_args(), "--num-rollout", 2, "--save", save)
        assert done.returncode == 0, done.stderr
        assert_learned(save, builtin_model)  # equal digests of untouched weights prove nothing
        digests.append([(r["model_digest"], r["optimizer_digest"]) for r in ls(cli, save)])
    assert digests[0] == digests[1]


def test_convert_then_raw_mode_and_export(cli, tiny_hf, tmp_path):
    release = tmp_path / "release_dir"
    conv = cli("convert", "--hf-checkpoint", tiny_hf, "--save", release)
    assert conv.returncode == 0, conv.stderr
    assert read_tracker(release).release and (release / "release" / "manifest.json").is_file()
    again = cli("convert", "--hf-checkpoint", tiny_hf, "--save", release)
    assert again.returncode == 2 and "already holds" in again.stderr

    save = tmp_path / "run"
    raw = cli(
        "train",
        *fast_train_args(tiny_hf),
        "--megatron-to-hf-mode",
        "raw",
        "--ref-load",
        release,
        "--num-rollout",
        1,
        "--save",
        save,
        "--load",
        save,
    )
    assert raw.returncode == 0, raw.stderr
    assert "fresh start at rollout 0" in raw.stdout and str(release / "release") in raw.stdout

    out = tmp_path / "exported"
    exp = cli("export-hf", "--load", save, "--hf-checkpoint", tiny_hf, "--out", out)
    assert exp.returncode == 0, exp.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    saved = load_tensors(save / "iter_0000000" / "model")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert (out / "tokenizer.json").is_file()


def test_async_snapshots_reuse_the_previous_buffers_and_commit_the_live_values(tmp_path):
    import torch

    from mileage.checkpoint.store import CheckpointState, verify_checkpoint
    from mileage.checkpoint.tensors import load_tensors
    from mileage.checkpoint.writer import CheckpointWriter

    live = {"w": torch.zeros(64, 8), "b": torch.zeros(8)}
    writer = CheckpointWriter(tmp_path, async_save=True)
    buffers = []
    for rollout_id in range(3):
        for t in live.values():
            t.fill_(float(rollout_id + 1))
        writer.save(rollout_id, CheckpointState(model=live, meta={"rollout_id": rollout_id}))
        for t in live.values():
            t.fill_(-1.0)  # training goes on while the snapshot is written
        buffers.append(writer._last_snapshot.model["w"].data_ptr())
    writer.wait()
    assert buffers[1] == buffers[2], "the second snapshot did not reuse the first one's buffer"
    for rollout_id in range(3):
        ckpt = tmp_path / f"iter_{rollout_id:07d}"
        assert verify_checkpoint(ckpt) == []
        saved = load_tensors(ckpt / "model")
        assert all(torch.all(t == rollout_id + 1) for t in saved.values())
    # a changed shape gets a fresh buffer instead of a wrong copy
    grown = CheckpointState(model={"w": torch.ones(65, 8)}, meta={})
    snapshot = grown.copied(reuse=writer._last_snapshot)
    assert snapshot.model["w"].shape == (65, 8) and torch.all(snapshot.model["w"] == 1)


def test_tied_embeddings_are_stored_once_and_load_tied(tiny_hf, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from mileage.checkpoint.store import CheckpointState, commit_checkpoint
    from mileage.checkpoint.tensors import load_model_weights
    from mileage.models.hf import empty_causal_lm, load_causal_lm
    from mileage.models.tensors import model_tensors

    model = load_causal_lm(tiny_hf)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ckpt = commit_checkpoint(tmp_path, 0, CheckpointState(model=model_tensors(model), meta={}))
    stored = dcp.FileSystemReader(str(ckpt / "model")).read_metadata().state_dict_metadata
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored
    assert set(stored) == set(model.state_dict()) - {"lm_head.weight"}
    fresh = empty_causal_lm(tiny_hf)
    load_model_weights(ckpt, fresh)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_background_save_finishes_before_the_next_one_reuses_its_buffers(tmp_path, monkeypatch):
    """--async-save: the next save's snapshot is copied into the previous snapshot's buffers, so
    it must wait until that one is written. A slow disk (a commit held until released) makes the
    overlap certain instead of a race the end-to-end chains can miss."""
    import threading

    from mileage.checkpoint import writer as writer_module
    from mileage.checkpoint.store import CheckpointState
    from mileage.checkpoint.writer import CheckpointWriter

    written, release = {}, threading.Event()

    def slow_commit(save_dir, rollout_id, state):
        if rollout_id == 0:
            release.wait(timeout=60)
        written[rollout_id] = state.model["w"].clone()
        return Path(save_dir) / f"iter_{rollout_id}"

    monkeypatch.setattr(writer_module, "commit_checkpoint", slow_commit)
    monkeypatch.setattr(writer_module, "prune_checkpoints", lambda *args: [])
    writer = CheckpointWriter(tmp_path, async_save=True)
    writer.save(0, CheckpointState(model={"w": torch.zeros(4)}, meta={}))
    second = threading.Thread(
        target=writer.save, args=(1, CheckpointState(model={"w": torch.ones(4)}, meta={}))
    )
    second.start()
    second.join(timeout=0.5)
    still_waiting = second.is_alive()
    release.set()
    second.join(timeout=60)
    writer.wait()
    assert still_waiting, "the second save did not wait for the first one"
    assert torch.equal(written[0], torch.zeros(4)), "the first save wrote the second's values"
    assert torch.equal(written[1], torch.ones(4))

"""LoRA runs (PEFT): adapter-only checkpoints that resume exactly, on the base they belong to.

One uninterrupted LoRA run on the built-in model (with dropout and a KL loss against the base,
so the reference path and the dropout masks are exercised) is the reference for a chain of
kills at commit points and for a stop-and-rerun: every adapter and optimizer tensor, and the
metrics, must equal it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import builtin_train_args

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.checkpoint.tensors import MODEL_DIR, OPTIMIZER_DIR, load_tensors, tensor_digest
from mileage.cli.main import main
from mileage.testing.compare import compare_runs
from mileage.testing.crash import launch, outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill, crash_run_args

pytest.importorskip("peft")

LORA = [
    "--lora-rank", "8",
    "--lora-alpha", "16",
    "--lora-dropout", "0.1",
    "--target-modules", "all-linear",
    "--exclude-modules", "gate_proj",
    "--use-kl-loss", "--kl-loss-coef", "0.05",
    "--lr", "2e-3",
]  # fmt: skip
ARGS = [*crash_run_args(num_rollout=4), *LORA]

# commit points of the save order, and the loop's, each hit once along one chain of launches
CHAIN = [
    Kill.at("optimizer_step"),
    Kill.at("save_after_model"),
    Kill.at("save_after_optimizer"),
    Kill.at("commit_before_tracker"),
    Kill.at("after_metrics"),
    Kill.at("commit_after_tracker"),
]


def rollout_records(save: Path) -> list[dict]:
    """The per-rollout records of metrics.jsonl (the evaluation before training, rollout -1,
    is a record of its own)."""
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["rollout_id"] >= 0]


def final_checkpoint(save: Path) -> Path:
    return checkpoint_path(save, read_tracker(save).iteration)


def assert_adapter_learned(save: Path) -> None:
    """lora_B starts at zero: a learned adapter has non-zero B's and a gradient above 0."""
    adapter = load_tensors(final_checkpoint(save) / MODEL_DIR)
    assert adapter and all(".lora_" in name for name in adapter), sorted(adapter)[:3]
    assert any(
        n.endswith("lora_B.default.weight") and v.abs().sum() > 0 for n, v in adapter.items()
    )
    records = rollout_records(save)
    assert any(r["grad_norm"] > 0 for r in records)


@pytest.fixture(scope="module")
def reference(builtin_model, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("lora_reference") / "run"
    run_uninterrupted(ARGS, save)
    assert_adapter_learned(save)
    return save


def test_checkpoint_holds_the_adapter_and_records_its_base(reference, builtin_model, capsys):
    ckpt = final_checkpoint(reference)
    meta = json.loads((ckpt / "meta.json").read_text())
    lora = meta["lora"]
    assert lora["lora_rank"] == 8 and "gate_proj" not in lora["target_modules"]
    assert lora["base"]["path"] == str(Path(builtin_model).resolve())
    assert len(lora["base"]["weights_sha256"]) == 64
    model = load_tensors(ckpt / MODEL_DIR)
    optimizer = load_tensors(ckpt / OPTIMIZER_DIR)
    # Adam state for every adapter tensor and for nothing else
    assert {k.rpartition(".")[0] for k in optimizer} == set(model)
    base_bytes = sum(f.stat().st_size for f in Path(builtin_model).glob("*.safetensors"))
    adapter_bytes = sum(v.numel() * v.element_size() for v in model.values())
    assert adapter_bytes < 0.05 * base_bytes
    # the checkpoint tools need nothing LoRA-specific
    assert main(["ckpt", "verify", str(reference)]) == 0
    capsys.readouterr()
    assert main(["ckpt", "ls", str(reference), "--json"]) == 0
    (tracked,) = [row for row in json.loads(capsys.readouterr().out) if row["tracked"]]
    assert tracked["name"] == ckpt.name and tracked["model_digest"] == tensor_digest(model)


def test_kills_at_commit_points_resume_to_the_uninterrupted_tensors(reference, tmp_path):
    save = tmp_path / "run"
    outcomes = run_with_kills(ARGS, save, CHAIN)
    table = outcome_table(outcomes)
    assert [o.status for o in outcomes] == ["killed"] * len(CHAIN), table
    for outcome in outcomes:
        assert not outcome.problems and outcome.intact and outcome.resumed, table
    assert compare_runs(reference, save) == [], table


def test_a_relaunched_lora_run_resumes_at_the_next_rollout(reference, tmp_path):
    """miles#2661: a relaunched LoRA run restarted at rollout 0."""
    save = tmp_path / "run"
    first = launch([*ARGS, "--debug-exit-after-rollout", "2"], save)
    assert first.returncode == 0, first.tail()
    assert read_tracker(save).iteration == 1
    second = launch(ARGS, save)
    assert second.returncode == 0, second.tail()
    assert "plan: resume at rollout 2 of 4" in second.stdout, second.stdout
    assert compare_runs(reference, save) == []


def resume_copy(reference: Path, save: Path, iteration: int) -> None:
    """`save` holding only iter_`iteration` of `reference`, tracked."""
    save.mkdir()
    source = checkpoint_path(reference, iteration)
    shutil.copytree(source, save / source.name)
    (save / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def test_dropout_masks_depend_on_seed_and_step_not_on_the_rng_stream(reference, tmp_path):
    """A resume without the global RNG (--no-load-rng) still draws the same dropout masks:
    the adapter and its optimizer state end equal to the uninterrupted run's."""
    from mileage.testing.compare import compare_tensors

    save = tmp_path / "run"
    resume_copy(reference, save, 1)
    done = launch([*ARGS, "--no-load-rng"], save)
    assert done.returncode == 0, done.tail()
    assert "also loads: optimizer, data position" in done.stdout, done.stdout
    ours, theirs = final_checkpoint(save), final_checkpoint(reference)
    assert ours.name == theirs.name
    for sub in (MODEL_DIR, OPTIMIZER_DIR):
        assert compare_tensors(sub, load_tensors(ours / sub), load_tensors(theirs / sub)) == []


def test_no_nan_after_an_adapter_only_restore(reference, tmp_path):
    """miles#2572: NaN after restoring the adapter alone (no optimizer state)."""
    save = tmp_path / "run"
    source = checkpoint_path(reference, 1)
    resume_copy(reference, save, 1)
    done = launch([*ARGS, "--no-load-optim"], save)
    assert done.returncode == 0, done.tail()
    assert "plan: resume at rollout 2 of 4" in done.stdout, done.stdout
    assert "also loads: rng, data position" in done.stdout, done.stdout
    records = rollout_records(save)
    assert [r["rollout_id"] for r in records] == [2, 3]
    for record in records:
        for key in ("pg_loss", "kl", "grad_norm", "entropy"):
            assert math.isfinite(record[key]), record
        assert record["grad_norm"] > 0
    restored = load_tensors(source / MODEL_DIR)
    final = load_tensors(final_checkpoint(save) / MODEL_DIR)
    assert all(torch.isfinite(v).all() for v in final.values())
    assert any(not torch.equal(restored[k], final[k]) for k in restored)  # it trained on


@pytest.fixture
def other_base(builtin_model, tmp_path) -> Path:
    """The built-in model with one tensor changed: same architecture, another base."""
    from mileage.models.hf import load_causal_lm

    other = tmp_path / "other_base"
    shutil.copytree(builtin_model, other)
    model = load_causal_lm(other)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.01)
    model.save_pretrained(other)
    return other


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mileage: error: "), err
    return err[0]


def test_resuming_on_another_base_exits_2_naming_both(
    reference, builtin_model, other_base, tmp_path, capsys
):
    save = tmp_path / "save"
    shutil.copytree(reference, save)
    code = main(
        [
            "train",
            *ARGS,
            "--num-rollout",
            "6",
            "--hf-checkpoint",
            str(other_base),
            "--load",
            str(save),
        ]
    )
    line = one_error_line(capsys)
    assert code == 2 and str(other_base) in line and str(Path(builtin_model).resolve()) in line


def test_lora_adapter_path_starts_from_an_exported_adapter_of_this_base_only(
    reference, builtin_model, other_base, tmp_path, capsys
):
    from mileage.models.hf import load_causal_lm
    from mileage.models.lora import LoraConfig, adapter_tensors
    from mileage.training.lora import build_lora_policy

    adapter = tmp_path / "adapter"
    assert (
        main(["export-hf", "--load", str(reference), "--out", str(adapter), "--adapter-only"]) == 0
    )
    capsys.readouterr()  # export-hf's own lines
    trained = load_tensors(final_checkpoint(reference) / MODEL_DIR)
    cfg = LoraConfig(
        lora_rank=8,
        lora_alpha=16,
        target_modules="all-linear",
        exclude_modules="gate_proj",
        lora_adapter_path=str(adapter),
    )

    def policy_on(base: Path):
        return build_lora_policy(
            cfg,
            5,
            (str(base), "hf"),
            (str(base), "hf"),
            False,
            lambda path, fmt: load_causal_lm(path),
            lambda line: None,
        )

    started = adapter_tensors(policy_on(builtin_model).model)
    assert set(started) == set(trained)
    assert all(torch.equal(started[k], trained[k]) for k in trained)

    # the same adapter on another base: refused, naming both
    save = tmp_path / "save"
    flags = ["--lora-rank", "8", "--target-modules", "all-linear", "--exclude-modules", "gate_proj"]
    code = main(
        [
            "train",
            *builtin_train_args("--num-rollout", "1", "--save", str(save)),
            *flags,
            "--hf-checkpoint",
            str(other_base),
            "--lora-adapter-path",
            str(adapter),
        ]
    )
    line = one_error_line(capsys)
    assert code == 2 and "is an adapter of" in line and str(other_base) in line, line
    assert str(Path(builtin_model).resolve()) in line
    assert not (save / "latest_checkpointed_iteration.txt").exists()

    # a foreign adapter (no mileage record) whose shapes do not fit: refused in one line
    (adapter / "mileage_base.json").unlink()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file(
        {k: v[..., :-1].contiguous() for k, v in tensors.items()},
        str(adapter / "adapter_model.safetensors"),
    )
    code = main(
        [
            "train",
            *builtin_train_args("--num-rollout", "1", "--save", str(save)),
            *flags,
            "--lora-adapter-path",
            str(adapter),
        ]
    )
    line = one_error_line(capsys)
    assert code == 2 and "does not fit this run's base" in line, line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lora-alpha", "32"], "--lora-alpha given but --lora-rank is 0"),
        (["--target-modules", "q_proj"], "--target-modules given but --lora-rank is 0"),
        (["--lora-rank", "4"], "--lora-rank needs --target-modules"),
        (["--lora-rank", "4", "--target-modules", "q_proj,qq_proj"], "qq_proj matches no linear"),
        (
            ["--lora-rank", "4", "--target-modules", "q_proj", "--exclude-modules", "v_proj"],
            "--exclude-modules v_proj is not among the target modules",
        ),
        (["--lora-rank", "4", "--target-modules", "q_proj", "--lora-dropout", "1"], "[0, 1)"),
    ],
)
def test_bad_lora_flags_get_one_line_and_exit_2(builtin_model, tmp_path, capsys, extra, message):
    save = tmp_path / "save"
    code = main(["train", *builtin_train_args("--num-rollout", "1", "--save", str(save)), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (save / "latest_checkpointed_iteration.txt").exists()


def test_peft_missing_is_one_line(builtin_model, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    code = main(["train", *builtin_train_args("--lora-rank", "4", "--target-modules", "q_proj")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'mileage[lora]'" in err[0], err


def _greedy(model, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the log-prob of each, by plain forward passes (no cache)."""
    ids, logps = prompt, []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids).logits[:, -1].float()
            token = logits.argmax(-1, keepdim=True)
            logps.append(torch.log_softmax(logits, -1).gather(-1, token))
            ids = torch.cat([ids, token], dim=1)
    return ids[0, prompt.shape[1] :].tolist(), torch.cat(logps, dim=1)


def test_mileage_eval_of_a_lora_run_reproduces_the_logged_evaluation(reference, capsys):
    """`mileage eval --load` rebuilds the recorded base with the adapter (it once needed full
    weights: "lacks 38 tensors the model needs") and draws as training's evaluation did."""
    evaluated = [r for r in rollout_records(reference) if any(k.startswith("eval/") for k in r)]
    assert evaluated, "the reference logs an evaluation after some rollout"
    record = evaluated[0]
    step = str(record["rollout_id"])
    assert main(["eval", *ARGS, "--load", str(reference), "--ckpt-step", step, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rollout_id"] == record["rollout_id"]
    logged = {k: v for k, v in record.items() if k.startswith("eval")}
    assert result["metrics"] == logged and "eval/addition" in logged


def test_merged_and_adapter_exports_generate_as_the_trainer(reference, builtin_model, tmp_path):
    import peft

    from mileage.models.hf import load_causal_lm
    from mileage.models.lora import LoraConfig
    from mileage.training.lora import build_lora_policy

    ckpt = final_checkpoint(reference)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert main(["export-hf", "--load", str(reference), "--out", str(merged)]) == 0
    assert (
        main(["export-hf", "--load", str(reference), "--out", str(adapter), "--adapter-only"]) == 0
    )
    flags = dict(zip(LORA[0:10:2], LORA[1:10:2], strict=True))
    cfg = LoraConfig(
        lora_rank=int(flags["--lora-rank"]),
        lora_alpha=int(flags["--lora-alpha"]),
        lora_dropout=float(flags["--lora-dropout"]),
        target_modules=flags["--target-modules"],
        exclude_modules=flags["--exclude-modules"],
    )
    trainer = build_lora_policy(
        cfg,
        0,
        (str(ckpt), "native"),
        (str(builtin_model), "hf"),
        True,
        lambda path, fmt: load_causal_lm(path),
        lambda line: None,
    ).model.eval()
    prompt = torch.tensor([[1, 5, 7, 3, 9, 2, 4]])
    tokens, logps = _greedy(trainer, prompt, 6)

    loaded = peft.PeftModel.from_pretrained(load_causal_lm(builtin_model), str(adapter)).eval()
    a_tokens, a_logps = _greedy(loaded, prompt, 6)
    # the same modules computing in the same order: bit for bit
    assert a_tokens == tokens and torch.equal(a_logps, logps)

    m_tokens, m_logps = _greedy(load_causal_lm(merged), prompt, 6)
    # merging adds B @ A into W once: the float order differs, so close rather than equal
    assert m_tokens == tokens
    torch.testing.assert_close(m_logps, logps, rtol=0, atol=1e-5)
    # and the adapter matters: without it the log-probs are not those
    assert not torch.allclose(_greedy(load_causal_lm(builtin_model), prompt, 6)[1], logps)


def test_the_reference_is_the_base_with_the_adapter_off(builtin_model):
    from mileage.models.hf import load_causal_lm
    from mileage.models.lora import LoraConfig, MergedView, adapter_tensors
    from mileage.training.lora import build_lora_policy

    cfg = LoraConfig(lora_rank=4, target_modules="q_proj,v_proj,down_proj")
    policy = build_lora_policy(
        cfg,
        1,
        (str(builtin_model), "hf"),
        (str(builtin_model), "hf"),
        False,
        lambda path, fmt: load_causal_lm(path),
        lambda line: None,
    )
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, tensor in adapter_tensors(policy.model).items():
            tensor.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.tensor([[1, 4, 6, 8, 3]])
    with torch.no_grad():
        base = load_causal_lm(builtin_model)(input_ids=ids).logits
        adapted = policy.model(input_ids=ids).logits
        reference = policy.reference()(input_ids=ids).logits
        merged = MergedView(policy.peft_model, str(builtin_model)).model(input_ids=ids).logits
    assert torch.equal(reference, base)  # no second copy, and exactly the base
    assert not torch.allclose(adapted, base, atol=1e-3)
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)  # the engine fallback
    # the base itself never trains
    assert not any(p.requires_grad for n, p in policy.model.named_parameters() if ".lora_" not in n)


def test_mileage_serve_generates_with_the_merged_adapter(builtin_model, tmp_path):
    """An engine that takes no adapter gets merged weights on every sync, said once."""
    from mileage.testing.servers import start_servers

    # fp32 on both sides: the check below is a log-prob match to float rounding, which bf16's
    # rounding (~1e-4 here) would blur
    (server,) = start_servers(builtin_model, 1, args=("--dtype", "float32"))
    try:
        save = tmp_path / "run"
        engine = ["--rollout-engine", "sglang", "--rollout-url", server.url, "--precision", "fp32"]
        done = run_uninterrupted(
            [
                *builtin_train_args("--num-rollout", "2", "--global-batch-size", "16"),
                *LORA,
                *engine,
            ],
            save,
        )
    finally:
        server.stop()
    assert done.stdout.count("given merged weights") == 1, done.stdout
    records = rollout_records(save)
    # the server sampled with the weights the trainer had (merged, so equal to float rounding);
    # the second rollout's weights carry a trained adapter, so a stale or unmerged sync shows
    assert records[1]["global_step"] > 0
    assert all(0 <= r["logprob_abs_diff"] < 1e-4 for r in records), records
    assert_adapter_learned(save)


def test_lora_under_torchrun_with_broadcast_weight_sync_is_one_line(
    builtin_model, tmp_path, monkeypatch, capsys
):
    """LoRA under torchrun syncs remote engines through the disk or the request
    (tests/test_lora_remote_fsdp.py); broadcast sync there is refused before anything starts."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    engine = ["--rollout-engine", "sglang", "--rollout-url", "http://127.0.0.1:9",
              "--rollout-weight-sync", "broadcast"]  # fmt: skip
    args = builtin_train_args("--save", str(tmp_path / "run"), *LORA, *engine)
    assert main(["train", *args]) == 2
    assert "drop --rollout-weight-sync broadcast" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()

"""Evaluation as miles runs it: named datasets, n samples per prompt, unbiased pass@k, eval seeds,
`--log-passrate`, and `mileage eval --load RUN` on a saved run."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import builtin_train_args

from mileage.cli.main import main
from mileage.errors import UserError
from mileage.metrics import read_metrics
from mileage.rollout.data import DataConfig, eval_sources
from mileage.rollout.engines.base import SamplingSeed
from mileage.rollout.evaluation import eval_seed, pass_at_k, pass_ks, pass_rates
from mileage.rollout.tasks import builtin_task


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n answers (c correct) holding a correct one: pass@k's meaning."""
    answers = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(answers, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_closed_form_of_chen_et_al():
    # hand-made: 5 answers, 2 correct, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                closed = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_pass_rates_average_groups_at_powers_of_two_and_n():
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]
    # prompt 1: 2 of 4 correct (a reward of 1.5 counts as correct), prompt 2: none
    rates = pass_rates([1.0, 0.0, 0.5, 1.5, 0.0, 0.0, 0.0, 0.0], 4)
    assert rates == pytest.approx(
        {"pass@1": (0.5 + 0) / 2, "pass@2": (1 - 1 / 6 + 0) / 2, "pass@4": (1.0 + 0) / 2}
    )


def test_eval_seeds_are_deterministic_and_never_training_s():
    def draws(seed: SamplingSeed) -> list[float]:
        return torch.rand(4, generator=seed.generator(), dtype=torch.float64).tolist()

    a3 = eval_seed(1234, 3, "a")
    assert draws(a3) == draws(eval_seed(1234, 3, "a"))  # resume draws the same
    others = [SamplingSeed(1234, 3), eval_seed(1234, 3, "b"), eval_seed(1234, 4, "a")]
    for other in others:
        assert draws(a3) != draws(other)
        assert a3.row_seed(0) != other.row_seed(0)
    # training's own seeds are unchanged by the eval purpose
    assert SamplingSeed(1234, 3).row_seed(5) == SamplingSeed(1234, 3, "rollout").row_seed(5)


def test_eval_prompt_data_pairs_and_a_single_path():
    pairs = DataConfig(eval_prompt_data=["aime", "x/aime.jsonl", "math", "y.parquet"])
    assert eval_sources(pairs) == [("aime", "x/aime.jsonl"), ("math", "y.parquet")]
    single = DataConfig(eval_prompt_data=["data/aime-2024.jsonl"])
    assert eval_sources(single) == [("aime-2024", "data/aime-2024.jsonl")]
    gym_single = DataConfig(eval_prompt_data=["gym:basic_arithmetic?size=5&seed=1"])
    assert eval_sources(gym_single)[0][0] == "basic_arithmetic"
    for values, message in (
        (["a", "A", "b"], "'b' has no path"),
        (["a", "A", "a", "B"], "'a' is given twice"),
        (["x/y", "A", "b", "B"], "must be non-empty, without '/'"),
    ):
        with pytest.raises(UserError, match=message):
            eval_sources(DataConfig(eval_prompt_data=values))


def _write_sets(tmp_path: Path) -> tuple[Path, Path]:
    held_out = builtin_task("addition")[1]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in held_out[:6]))
    b.write_text("".join(json.dumps(r) + "\n" for r in held_out[6:10]))
    return a, b


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def test_named_eval_sets_log_pass_at_k_and_mileage_eval_reproduces_them(
    cli, builtin_model, tmp_path
):
    a, b = _write_sets(tmp_path)
    save = tmp_path / "run"
    sets = ["--eval-prompt-data", "a", a, "b", b, "--n-samples-per-eval-prompt", "4"]
    train = [*builtin_train_args("--num-rollout", "2", "--eval-interval", "1"), *sets]
    done = cli("train", *train, "--log-passrate", "--save", save, "--save-interval", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval before training: a " in done.stdout and "; b " in done.stdout
    number = r"\d\.\d{3}"
    each = rf"reward {number} solved {number} \(pass@4 {number}\)"
    assert re.search(rf"rollout 1 \|.* \| eval a {each}; b {each}", done.stdout)

    records = read_metrics(save)
    assert [r["rollout_id"] for r in records] == [-1, 0, 1]
    for record in records:
        for name, prompts in (("a", 6), ("b", 4)):
            key = f"eval/{name}"
            assert {f"{key}/pass@{k}" for k in (1, 2, 4)} <= record.keys()
            # rewards are 0 or 1 here: pass@1 is the mean reward, a multiple of 1/(4 * prompts)
            assert record[f"{key}/pass@1"] == pytest.approx(record[key])
            assert (record[key] * 4 * prompts) == pytest.approx(round(record[key] * 4 * prompts))
            assert record[f"{key}/pass@1"] <= record[f"{key}/pass@2"] <= record[f"{key}/pass@4"]
        assert "eval_accuracy" not in record  # two datasets: no single accuracy
    # sampled, not greedy: the 4 answers of a prompt differ somewhere
    assert any(r[f"eval/{n}/pass@4"] > r[f"eval/{n}/pass@1"] for r in records for n in "ab")
    for record in records[1:]:
        assert {"passrate/pass@1", "passrate/pass@2", "passrate/pass@4"} <= record.keys()
        assert record["passrate/pass@1"] == pytest.approx(record["accuracy"])

    # `mileage eval`: the tracker's checkpoint (rollout 1), then --ckpt-step 0; writes nothing
    before = _tree(save)
    flags = ["--load", save, *sets, "--rollout-max-response-len", "4", "--num-threads", "1"]
    for extra, record in (([], records[2]), (["--ckpt-step", "0"], records[1])):
        out = cli("eval", *flags, *extra, "--json")
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout)
        assert result["rollout_id"] == record["rollout_id"]
        assert result["metrics"] == {k: v for k, v in record.items() if k.startswith("eval/")}
    text = cli("eval", *flags)
    assert text.returncode == 0, text.stderr[-3000:]
    assert "a: reward " in text.stdout and "pass@4" in text.stdout and "b: reward " in text.stdout
    assert _tree(save) == before

    # killed after rollout 0 and rerun: the sampled evaluations are the uninterrupted run's
    resumed = tmp_path / "resumed"
    again = [*train, "--log-passrate", "--save", resumed, "--load", resumed, "--save-interval", "1"]
    stopped = cli("train", *again, "--debug-exit-after-rollout", "1")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    rerun = cli("train", *again)
    assert rerun.returncode == 0, rerun.stderr[-3000:]

    def evals(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k.startswith("eval")} for r in read_metrics(run)]

    assert evals(resumed) == evals(save)


def test_eval_tool_key_reads_the_evaluation_datas_tools(tmp_path):
    """--eval-tool-key names the evaluation data's tools key (miles' meaning), --tool-key's
    when not given; the prompts carry them to the tool loop."""
    from mileage.rollout.data import load_eval_sets

    spec = {"type": "function", "function": {"name": "add", "parameters": {}}}
    path = tmp_path / "e.jsonl"
    path.write_text(
        json.dumps({"prompt": "1+2=", "label": "3", "fns": [spec]}) + "\n"
        + json.dumps({"prompt": "2+2=", "label": "4"}) + "\n"
    )  # fmt: skip
    (held,) = load_eval_sets(DataConfig(eval_prompt_data=["e", str(path)], eval_tool_key="fns"))
    assert [p.tools for p in held.prompts] == [[spec], None]
    (plain,) = load_eval_sets(DataConfig(eval_prompt_data=["e", str(path)]))  # --tool-key: tools
    assert [p.tools for p in plain.prompts] == [None, None]


def test_bad_eval_input_is_one_line_exit_2(tmp_path, capsys):
    a, _ = _write_sets(tmp_path)
    bad_tools = tmp_path / "bad_tools.jsonl"
    bad_tools.write_text(json.dumps({"prompt": "1+2=", "label": "3", "fns": "add"}) + "\n")
    cases = {
        "a name without a path": (
            ["train", "--eval-prompt-data", "a", a, "b"],
            "--eval-prompt-data takes NAME PATH pairs; 'b' has no path",
        ),
        "an unknown key": (
            ["train", "--eval-prompt-data", "a", a, "--eval-input-key", "question"],
            "a.jsonl:1: missing key 'question' (set --eval-input-key/--eval-label-key)",
        ),
        "n-samples 0": (
            ["train", "--n-samples-per-eval-prompt", "0"],
            "--n-samples-per-eval-prompt must be positive, got 0",
        ),
        "tools that are not a list": (
            ["train", "--eval-prompt-data", "a", bad_tools, "--eval-tool-key", "fns"],
            "'fns' must be a list of tool dicts",
        ),
        "eval without --load": (["eval", "--eval-prompt-data", "a", a], "needs --load RUN"),
        "eval of a missing run": (
            ["eval", "--load", tmp_path / "nothing"],
            "does not exist or is not a directory",
        ),
    }
    for case, (argv, message) in cases.items():
        save = tmp_path / f"save-{len(case)}"
        code = main([*map(str, argv), "--save", str(save), "--num-threads", "1"])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2, (case, err)
        assert len(lines) == 1 and lines[0].startswith("mileage: error: "), (case, err)
        assert message in lines[0], (case, err)
        assert not save.exists(), case

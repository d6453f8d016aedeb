"""Custom reward loading, prompt files (JSONL, Parquet), and data-order determinism."""

from __future__ import annotations

import json

import pytest

from mileage.errors import UserError
from mileage.rollout.data import Prompt, PromptSource, load_jsonl, load_prompts
from mileage.rollout.rewards import RewardConfig, build_reward_fn, load_custom_reward, score_all
from mileage.rollout.rewards.rules import exact_reward
from mileage.rollout.tasks import builtin_task


def test_exact_reward_strips_whitespace_only():
    assert exact_reward("", " 25\n", "25") == 1.0 and exact_reward("", "250", "25") == 0.0


def test_custom_reward_sync_and_async(tmp_path, monkeypatch):
    (tmp_path / "my_rm.py").write_text(
        "import asyncio\n"
        "def length(prompt, response, label):\n    return float(len(response))\n"
        "async def later(prompt, response, label):\n"
        "    await asyncio.sleep(0)\n    return 1.0 if response == label else -1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sync = build_reward_fn(RewardConfig(custom_rm_path="my_rm:length"))
    assert score_all(sync, [("p", "abc", "x")]) == [3.0]
    async_fn = load_custom_reward("my_rm:later")
    assert score_all(async_fn, [("p", "a", "a"), ("p", "b", "a")]) == [1.0, -1.0]


@pytest.mark.parametrize("path", ["nope_module_xyz:fn", "json:no_such_fn", "missing_colon"])
def test_bad_custom_reward_path_is_a_user_error(path):
    with pytest.raises(UserError):
        load_custom_reward(path)


def test_jsonl_keys_and_errors(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text('{"q": "1+1", "a": 2}\n\n{"q": "2+2", "a": 4}\n')
    assert load_jsonl(str(good), "q", "a") == [Prompt(0, "1+1", "2"), Prompt(1, "2+2", "4")]
    with pytest.raises(UserError, match=r"d.jsonl:1: missing key 'prompt'"):
        load_jsonl(str(good), "prompt", "a")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1, "a": 2}\n{oops\n')
    with pytest.raises(UserError, match="bad.jsonl:2: not valid JSON"):
        load_jsonl(str(bad), "q", "a")


def test_parquet_prompts_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["1+1", "2+2"], "a": [2, 4], "other": ["x", "y"]}), good)
    assert load_prompts(str(good), "q", "a") == [Prompt(0, "1+1", "2"), Prompt(1, "2+2", "4")]
    with pytest.raises(UserError, match=r"d.parquet: missing column 'prompt' .*columns: q, a"):
        load_prompts(str(good), "prompt", "a")
    empty = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table({"q": pa.array([], pa.string()), "a": pa.array([], pa.string())}), empty
    )
    with pytest.raises(UserError, match="prompt file is empty"):
        load_prompts(str(empty), "q", "a")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UserError, match="corrupt.parquet: not a readable Parquet file"):
        load_prompts(str(corrupt), "q", "a")
    with pytest.raises(UserError, match="prompt file not found"):
        load_prompts(str(tmp_path / "nope.parquet"), "q", "a")


def test_parquet_error_is_one_line_on_the_cli(tmp_path, cli):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet at all")
    result = cli("plan", "--prompt-data", bad)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("mileage: error: ") and result.stderr.count("\n") == 1
    assert "not a readable Parquet file" in result.stderr


def test_data_position_for_other_content_of_the_same_size_is_refused():
    source = PromptSource(prompts(8), False, seed=0)
    other = [Prompt(i, f"other {i}", str(i)) for i in range(8)]
    with pytest.raises(UserError, match="other prompts"):
        PromptSource(other, False, seed=0).load_state_dict(source.state_dict())
    legacy = {k: v for k, v in source.state_dict().items() if k != "digest"}
    PromptSource(other, False, seed=0).load_state_dict(legacy)  # older checkpoints: size only


def prompts(n: int) -> list[Prompt]:
    return [Prompt(i, str(i), str(i)) for i in range(n)]


def test_shuffled_order_is_a_function_of_seed_and_epoch():
    a, b = PromptSource(prompts(10), True, seed=1), PromptSource(prompts(10), True, seed=1)
    assert a.order(0) == b.order(0) and a.order(3) == b.order(3)
    assert a.order(0) != a.order(1) and sorted(a.order(1)) == list(range(10))
    assert PromptSource(prompts(10), True, seed=2).order(0) != a.order(0)
    assert PromptSource(prompts(10), False, seed=1).order(5) == list(range(10))


def test_position_continues_exactly_across_epoch_boundaries():
    straight = PromptSource(prompts(10), True, seed=7)
    seen = [p.index for _ in range(7) for p in straight.next_batch(4)]  # 28 prompts, 2.8 epochs
    assert seen[:10] == straight.order(0) and seen[10:20] == straight.order(1)
    resumed, replay = PromptSource(prompts(10), True, seed=7), []
    for _ in range(7):
        fresh = PromptSource(prompts(10), True, seed=7)
        fresh.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
        replay += [p.index for p in fresh.next_batch(4)]
        resumed = fresh
    assert replay == seen
    assert resumed.state_dict()["epoch"] == 2 and resumed.state_dict()["offset"] == 8


def test_resume_at_an_exact_epoch_boundary_continues_with_the_next_epoch():
    source = PromptSource(prompts(8), True, seed=3)
    source.next_batch(4)
    source.next_batch(4)
    assert source.state_dict()["epoch"] == 1 and source.state_dict()["offset"] == 0
    again = PromptSource(prompts(8), True, seed=3)
    again.load_state_dict(source.state_dict())
    assert [p.index for p in again.next_batch(4)] == again.order(1)[:4]


def test_data_position_for_other_data_is_refused():
    source = PromptSource(prompts(8), False, seed=0)
    with pytest.raises(UserError, match="8 prompts"):
        PromptSource(prompts(9), False, seed=0).load_state_dict(source.state_dict())


def test_builtin_tasks_are_deterministic_and_disjoint():
    train, test = builtin_task("addition")
    assert len(train) == 9500 and len(test) == 500
    assert builtin_task("addition") == (train, test)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert {"prompt": "07+45=", "label": "25"} in train + test
    rev_train, _ = builtin_task("reversal")
    assert all(r["label"] == r["prompt"][:-1][::-1] for r in rev_train)

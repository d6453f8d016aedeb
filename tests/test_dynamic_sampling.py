"""Dynamic sampling in `mileage train`: the round logic on fakes, the filter loading, the round
cap's exit 2, and end to end on the built-in model: no trained group has equal rewards, every
prompt of every epoch is drawn once and is trained, dropped or left in the saved buffer, and a
run killed between sampling rounds and while saving resumes to the uninterrupted tensors (the
commit points, with partial rollout on, are in tests/test_partial_rollout.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mileage.checkpoint.layout import checkpoint_path, read_tracker
from mileage.checkpoint.store import TRAINER_STATE
from mileage.errors import UserError
from mileage.rollout.buffer import STATE_KEY, RolloutBuffer, split_groups
from mileage.rollout.data import Prompt, PromptSource
from mileage.rollout.dynamic import (
    MILES_NONZERO_STD,
    DynamicSamplingConfig,
    check_reward_nonzero_std,
    judge,
    load_group_filter,
    sample_dynamic,
    take_buffered,
)
from mileage.rollout.rollout import Sample
from mileage.rollout.tasks import builtin_task
from mileage.testing.compare import compare_runs
from mileage.testing.crash import outcome_table, run_uninterrupted, run_with_kills
from mileage.testing.kills import Kill

N = 2
PROMPTS = 16


def rollout_records(save: Path) -> list[dict]:
    """The per-rollout records of metrics.jsonl (the evaluation before training, rollout -1,
    is a record of its own)."""
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["rollout_id"] >= 0]


def fake_generate(rewards_by_prompt: dict[int, list[float]], slots: list[int]):
    """Samples whose rewards are fixed per prompt index; records the slot of each call."""

    def generate(prompts: list[Prompt], slot: int) -> list[Sample]:
        slots.append(slot)
        return [
            Sample(p, [1], [2], [-0.5], "x", reward, True, 0, [0])
            for p in prompts
            for reward in rewards_by_prompt[p.index]
        ]

    return generate


def prompts(count: int) -> list[Prompt]:
    return [Prompt(i, f"p{i}", "l") for i in range(count)]


def test_rounds_fill_the_batch_in_submission_order_and_buffer_the_rest():
    # prompts 1, 2, 4, 5 have equal rewards (dropped); the others are kept
    rewards = {i: ([1.0, 1.0] if i in (1, 2, 4, 5) else [0.0, 1.0]) for i in range(20)}
    source = PromptSource(prompts(20), shuffle=False, seed=0)
    buffer, slots = RolloutBuffer(), []
    buffer.next_slot = 7
    cfg = DynamicSamplingConfig(MILES_NONZERO_STD, over_sampling_batch_size=3)
    generate = fake_generate(rewards, slots)
    out = sample_dynamic(
        buffer, source.next_batch, generate, check_reward_nonzero_std, None, None, cfg, 3, N, 0
    )
    # round 1 draws 0,1,2 (keeps 0); round 2 draws 3,4,5 (keeps 3); round 3 draws 6,7,8
    assert [g.prompt.index for g in out.groups] == [0, 3, 6]
    assert [g.prompt.index for g in buffer.groups] == [7, 8]
    assert slots == [7, 8, 9] and buffer.next_slot == 10  # one distinct seed slot per round
    assert [p.index for p in out.drawn] == list(range(9))
    stats = out.stats
    assert stats["dynamic_filter/rounds"] == 3
    assert stats["dynamic_filter/groups_drawn"] == 9
    assert stats["dynamic_filter/groups_dropped"] == 4
    assert stats["dynamic_filter/drop_zero_std_1.0"] == 4
    assert stats["dynamic_filter/groups_kept"] == 5
    assert stats["dynamic_filter/groups_buffered"] == 2
    assert stats["group_slots"] == [7, 8, 9]
    assert source.state_dict()["offset"] == 9  # every drawn prompt moved the data position

    # the next rollout takes the buffered groups first, then samples one more round
    out = sample_dynamic(
        buffer, source.next_batch, generate, check_reward_nonzero_std, None, None, cfg, 3, N, 1
    )
    assert [g.prompt.index for g in out.groups] == [7, 8, 9]
    assert out.stats["dynamic_filter/groups_from_buffer"] == 2
    assert [g.prompt.index for g in buffer.groups] == [10, 11]
    assert slots[-1] == 10


def test_the_buffer_round_trips_through_json_with_its_leftover_groups():
    rewards = {i: [0.0, 1.0] for i in range(8)}
    buffer, source = RolloutBuffer(), PromptSource(prompts(8), False, 0)
    cfg = DynamicSamplingConfig(None, over_sampling_batch_size=5)
    sample_dynamic(
        buffer, source.next_batch, fake_generate(rewards, []), None, None, None, cfg, 2, N, 0
    )
    again = RolloutBuffer()
    again.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert again.state_dict() == buffer.state_dict()
    assert [g.prompt.index for g in again.groups] == [2, 3, 4]


def test_a_buffer_filter_takes_what_it_removes_and_leaves_the_rest_in_its_order():
    buffer = RolloutBuffer()
    buffer.groups.extend(
        split_groups(3, 1, [Sample(p, [1], [2], [0.0], "x", 1.0, True) for p in prompts(4)], 1)
    )

    def newest_two_reversed(config, rollout_id, groups, count):
        taken = [groups.pop(), groups.pop()]  # the newest first
        groups.reverse()
        return taken

    taken = take_buffered(buffer, newest_two_reversed, None, 0, 2)
    assert [g.prompt.index for g in taken] == [3, 2]
    assert [g.prompt.index for g in buffer.groups] == [1, 0]
    assert all(g.slot == 3 for g in taken)

    def keeps_them_too(config, rollout_id, groups, count):
        return groups[:1]  # returned but not removed: refused

    with pytest.raises(UserError, match="--buffer-filter-path: rollout 4"):
        take_buffered(buffer, keeps_them_too, None, 4, 2)
    assert [g.prompt.index for g in take_buffered(buffer, None, None, 0, 5)] == [1, 0]


def test_the_round_cap_stops_with_the_counts():
    rewards = {i: [0.0, 0.0] for i in range(50)}
    source = PromptSource(prompts(50), False, 0)
    cfg = DynamicSamplingConfig(MILES_NONZERO_STD, 4, dynamic_sampling_max_rounds=3)
    with pytest.raises(UserError) as caught:
        sample_dynamic(
            RolloutBuffer(),
            source.next_batch,
            fake_generate(rewards, []),
            check_reward_nonzero_std,
            None,
            None,
            cfg,
            2,
            N,
            5,
        )
    message = str(caught.value)
    assert "rollout 5" in message and "kept 0 of 2 groups after 3 rounds" in message
    assert "12 prompts drawn, 12 groups dropped: zero_std_0.0 12" in message


def test_filters_may_return_bool_pair_or_miles_output(tmp_path, monkeypatch):
    samples = [Sample(Prompt(0, "p", "l"), [1], [2], [0.0], "x", 0.5, True)] * 3
    assert check_reward_nonzero_std(None, samples) == (False, "zero_std_0.5")
    assert judge(lambda c, s: False, None, samples) == (False, "filtered")
    assert judge(lambda c, s: True, None, samples) == (True, "")

    class Output:
        keep, reason = False, "too_long"

    assert judge(lambda c, s: Output(), None, samples) == (False, "too_long")
    (tmp_path / "myfilters.py").write_text("def keep_all(config, samples):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_group_filter("myfilters.keep_all")(None, samples) is True
    assert load_group_filter("myfilters:keep_all")(None, samples) is True
    assert load_group_filter(MILES_NONZERO_STD) is check_reward_nonzero_std
    for bad, said in (("nodots", "module.path.function"), ("nosuchmod.fn", "cannot import")):
        with pytest.raises(UserError, match=said):
            load_group_filter(bad)
    with pytest.raises(UserError, match="has no function 'nope'"):
        load_group_filter("myfilters.nope")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--over-sampling-batch-size", "0"], "--over-sampling-batch-size must be positive"),
        (["--mask-offpolicy-in-partial-rollout"], "needs --partial-rollout"),
        (["--buffer-filter-path", "x.y"], "--buffer-filter-path selects from dynamic sampling"),
        (
            ["--over-sampling-batch-size", "8", "--buffer-filter-path", "nosuch.fn"],
            "--buffer-filter-path: cannot import 'nosuch'",
        ),
        (["--dynamic-sampling-filter-path", "nosuch.module.fn"], "cannot import 'nosuch.module'"),
    ],
)
def test_bad_dynamic_sampling_input_is_one_line_and_exit_2(cli, tmp_path, extra, message):
    done = cli("train", "--save", tmp_path / "s", *extra)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


def test_train_async_refuses_dynamic_sampling(cli, tmp_path):
    done = cli("train-async", "--over-sampling-batch-size", "8", "--save", tmp_path / "s")
    assert done.returncode == 2 and "mileage train" in done.stderr, done.stderr


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    """PROMPTS built-in addition prompts: a few rollouts cross several epochs."""
    path = tmp_path_factory.mktemp("ds_data") / "prompts.jsonl"
    records = builtin_task("addition")[0][:PROMPTS]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def dynamic_args(prompt_file: Path, *extra: object) -> list[str]:
    return [
        "--prompt-data", prompt_file,
        "--rollout-shuffle",
        "--num-rollout", "6",
        "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "4",
        "--global-batch-size", "8",
        "--lr", "1e-4",
        "--eval-interval", "0",
        "--num-threads", "1",
        "--dynamic-sampling-filter-path", MILES_NONZERO_STD,
        "--over-sampling-batch-size", "6",
        # REINFORCE++ with its group-mean baseline (composition row 12: the family's only row
        # beside row 15)
        "--advantage-estimator", "reinforce_plus_plus_baseline", "--normalize-advantages",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def dynamic_reference(builtin_model, prompt_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_ref")
    slots = root / "slots" / "{slot}.json"  # one file per sampling round
    save = root / "run"
    run_uninterrupted(dynamic_args(prompt_file, "--save-debug-rollout-data", slots), save)
    records = rollout_records(save)
    return save, slots, records


def slot_groups(slots: Path, slot: int) -> dict[int, list[float]]:
    """Rewards of every group sampled in one round, by prompt index."""
    samples = json.loads(Path(str(slots).format(slot=slot)).read_text())["samples"]
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s["prompt"]["index"], []).append(s["reward"])
    return groups


@pytest.mark.slow
def test_no_trained_group_has_equal_rewards_and_every_drawn_prompt_is_accounted(
    dynamic_reference, prompt_file, builtin_model
):
    from conftest import assert_learned

    save, slots, records = dynamic_reference
    assert_learned(save, builtin_model)
    trained, dropped = set(), set()
    for record in records:
        for slot, index in zip(record["group_slots"], record["prompt_indices"], strict=True):
            rewards = slot_groups(slots, slot)[index]
            assert len(set(rewards)) > 1, (record["rollout_id"], slot, index, rewards)
            assert (slot, index) not in trained  # each group is trained once
            trained.add((slot, index))
    assert sum(r["dynamic_filter/groups_dropped"] for r in records) > 0  # the filter did bind
    assert any(r["dynamic_filter/groups_buffered"] for r in records)  # and groups were left over

    # the data position: the prompts drawn, rollout after rollout, are the epochs' orders
    drawn = [i for r in records for i in r["drawn_prompt_indices"]]
    source = PromptSource([Prompt(i, "", "") for i in range(PROMPTS)], shuffle=True, seed=1234)
    assert drawn == [p.index for p in source.next_batch(len(drawn))]
    assert len(drawn) > 2 * PROMPTS  # several epochs, each drawn exactly once in its own order

    # every drawn group is trained, dropped by the filter, or in the last checkpoint's buffer
    last = checkpoint_path(save, read_tracker(save).iteration)
    state = json.loads((last / TRAINER_STATE).read_text())
    buffered = {(g["slot"], g["samples"][0]["prompt"]["index"]) for g in state[STATE_KEY]["groups"]}
    assert state["data"]["epoch"] * PROMPTS + state["data"]["offset"] == len(drawn)
    first_slot = 0
    for slot in range(first_slot, state[STATE_KEY]["next_slot"]):
        for index, rewards in slot_groups(slots, slot).items():
            if len(set(rewards)) == 1:
                dropped.add((slot, index))
            else:
                assert ((slot, index) in trained) != ((slot, index) in buffered), (slot, index)
    assert len(trained) + len(dropped) + len(buffered) == len(drawn)
    assert len(dropped) == sum(r["dynamic_filter/groups_dropped"] for r in records)


@pytest.mark.slow
def test_round_cap_exits_2_with_the_counts(cli, builtin_model, prompt_file, tmp_path):
    (tmp_path / "dropall.py").write_text("def drop(config, samples):\n    return False\n")
    args = dynamic_args(prompt_file, "--dynamic-sampling-filter-path", "dropall.drop")
    done = cli(
        "train", *args, "--dynamic-sampling-max-rounds", "2", env={"PYTHONPATH": f"{tmp_path}"}
    )
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()
    assert len(line) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "rollout 0: dynamic sampling kept 0 of 4 groups after 2 rounds" in line[0]
    assert "12 prompts drawn, 12 groups dropped: filtered 12" in line[0]


# kills between sampling rounds (several hits, so some land after a round that left groups in
# the buffer) and while the trainer state with the buffer is written; the commit points and more
# round kills run with partial rollout on (tests/test_partial_rollout.py, the same buffer)
DYNAMIC_CHAIN = [
    Kill.at("after_sampling_round", 3),
    Kill.at("save_after_state"),
    Kill.at("after_sampling_round", 2),
]


@pytest.mark.slow
def test_kills_between_rounds_and_in_the_save_resume_to_the_uninterrupted_run(
    dynamic_reference, prompt_file, tmp_path
):
    reference, _, records = dynamic_reference
    save = tmp_path / "run"
    outcomes = run_with_kills(dynamic_args(prompt_file), save, DYNAMIC_CHAIN)
    table = outcome_table(outcomes)
    for outcome in outcomes:
        assert not outcome.problems, f"{outcome.kill.label}: {outcome.problems}\n{table}"
    assert sum(o.status == "killed" for o in outcomes) == len(DYNAMIC_CHAIN), table
    # the same tensors, and the same metrics: the same prompts drawn and trained, rollout by rollout
    assert compare_runs(reference, save) == [], table


@pytest.mark.slow
def test_keeping_every_group_without_over_sampling_trains_what_plain_train_trains(
    crash_reference, tmp_path
):
    """Round k of rollout k is seeded as plain training seeds rollout k, so dynamic sampling
    that keeps everything changes no tensor (only the trainer state's empty buffer and the
    dynamic_filter metrics are extra)."""
    from mileage.testing.compare import TENSOR_DIFF, count_tensor_differences
    from mileage.testing.kills import crash_run_args

    reference, _ = crash_reference
    save = tmp_path / "run"
    run_uninterrupted([*crash_run_args(), "--over-sampling-batch-size", "8"], save)
    diffs = compare_runs(reference, save)
    assert count_tensor_differences(diffs) == 0, [d for d in diffs if d.startswith(TENSOR_DIFF)]
    assert diffs, "the extra buffer and metrics should show as non-tensor differences"
    records = rollout_records(save)
    plain = rollout_records(reference)
    assert [r["prompt_indices"] for r in records] == [r["prompt_indices"] for r in plain]
    assert all(r["dynamic_filter/rounds"] == 1 for r in records)

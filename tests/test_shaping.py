"""Overlong reward shaping (DAPO / verl's overlong_buffer) and truncation masking (TRL's
mask_truncated_completions) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from mileage.rollout.data import Prompt
from mileage.rollout.rollout import Sample
from mileage.rollout.shaping import ShapingConfig, overlong_penalty, shape_rewards
from mileage.training.batch import mask_truncated, pack_samples


def sample(length: int, reward: float = 1.0, finished: bool = True) -> Sample:
    return Sample(
        Prompt(0, "p", "l"), [5, 6], list(range(1, length + 1)), [-0.25] * length, "x", reward,
        finished,
    )  # fmt: skip


def test_overlong_penalty_by_hand():
    # max 8 tokens, buffer 4: free up to 4 tokens, then -1/4 per token up to -1 at 8
    assert [overlong_penalty(n, 8, 4, 1.0) for n in (2, 4, 5, 6, 8)] == [0, 0, -0.25, -0.5, -1.0]
    assert overlong_penalty(7, 8, 4, 0.5) == -0.375  # 3/4 of the way, half the factor


def test_shape_rewards_adds_the_penalty_and_is_off_by_default():
    samples = [sample(3, 1.0), sample(6, 1.0), sample(8, 0.0)]
    shaped = shape_rewards(samples, ShapingConfig(overlong_buffer_len=4), 8)
    assert [s.reward for s in shaped] == [1.0, 0.5, -1.0]
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0]  # the originals are not touched
    assert shape_rewards(samples, ShapingConfig(), 8) is samples


def test_mask_truncated_zeroes_only_the_unfinished_rows():
    samples = [sample(2), sample(3, finished=False), sample(1)]
    batch = pack_samples(samples, pad_id=0)
    before = batch.loss_mask.clone()
    assert mask_truncated(batch, samples) == 1
    # rows: prompt 2 tokens, so response targets start at column 1
    assert torch.equal(batch.loss_mask[0], torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert torch.equal(batch.loss_mask[1], torch.zeros(4))
    assert torch.equal(batch.loss_mask[2], before[2])
    assert torch.equal(batch.loss_mask[2], torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--overlong-buffer-len", "9"], "--overlong-buffer-len must be in [0"),
        (["--overlong-penalty-factor", "-1"], "--overlong-penalty-factor must be >= 0"),
    ],
)
def test_bad_shaping_input_is_one_line_and_exit_2(cli, tmp_path, extra, message):
    done = cli("train", "--rollout-max-response-len", "8", "--save", tmp_path / "s", *extra)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_train_loop_masks_truncated_answers_and_shapes_only_the_trained_reward(
    cli, builtin_model, tmp_path
):
    import json

    from conftest import builtin_train_args

    args = builtin_train_args("--rollout-max-response-len", "2", "--num-rollout", "1")
    shaping = ["--overlong-buffer-len", "1", "--mask-truncated-completions"]
    done = cli("train", *args, *shaping, "--save", tmp_path / "s")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "s" / "metrics.jsonl").read_text().splitlines()[-1])
    # two-digit answers need 3 tokens with EOS: at 2 tokens most are cut off
    assert record["truncated_masked"] > 0
    assert record["overlong_reward_mean"] < record["reward_mean"]

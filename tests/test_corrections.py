"""Sequence-level IS, MIS / IcePop masks, mismatch metrics and OPSM against hand-computed values
on small tensors, each with a case where the clip or the mask binds; rejected tokens leave the
loss mask (and so the loss denominator)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from mileage.errors import UserError
from mileage.training import mismatch as mm
from mileage.training.batch import TrainBatch
from mileage.training.corrections import (
    MILES_ICEPOP,
    is_weights,
    mismatch_metrics,
    opsm_keep,
)
from mileage.training.losses import LossReducer

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# trainer - engine per token: row 0 ratios 1, 3, 0.5; row 1 ratios 0.5, 1.5 (third masked)
TRAINER = torch.zeros(2, 3)
ENGINE = -torch.log(torch.tensor([[1.0, 3.0, 0.5], [0.5, 1.5, 1.0]])) * MASK


def test_token_truncate_is_tis_with_the_clamp_binding():
    w, kept, m = is_weights(TRAINER, ENGINE, MASK, mode="truncate", low=0.6, high=2.0)
    assert_close(w, torch.tensor([[1.0, 2.0, 0.6], [0.6, 1.5, 0.0]]))
    assert torch.equal(kept, MASK)
    assert m["tis_clipfrac"] == pytest.approx(3 / 5)
    assert m["tis_mean"] == pytest.approx((1 + 3 + 0.5 + 0.5 + 1.5) / 5)


def test_token_mask_is_icepop_rejecting_both_sides():
    w, kept, m = is_weights(TRAINER, ENGINE, MASK, mode="mask", low=0.6, high=2.0)
    assert torch.equal(kept, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert_close(w, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.5, 0.0]]))
    assert m["tis_rejected_frac"] == pytest.approx(3 / 5)


def test_sequence_level_ratio_is_the_product_over_the_sequence():
    # row 0: 1 * 3 * 0.5 = 1.5; row 1: 0.5 * 1.5 = 0.75 (the masked token does not count)
    w, kept, _ = is_weights(
        TRAINER, ENGINE, MASK, level="sequence", mode="truncate", low=0.8, high=2.0
    )
    assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [0.8, 0.8, 0.0]]))
    w, kept, m = is_weights(TRAINER, ENGINE, MASK, level="sequence", mode="mask", low=0.8, high=2.0)
    assert torch.equal(kept, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]))
    assert m["tis_rejected_frac"] == pytest.approx(2 / 5)


# the trainer's log-probs are patched in; the actor only says its model computes in fp32
FP32_ACTOR = SimpleNamespace(model=torch.nn.Linear(1, 1))


def test_rejected_tokens_leave_the_loss_denominator(monkeypatch):
    batch = TrainBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        loss_mask=MASK.clone(),
        old_logprobs=ENGINE.clone(),
        rewards=torch.zeros(2),
    )
    monkeypatch.setattr(mm, "trainer_logprobs", lambda actor, b: TRAINER.clone())
    cfg = mm.MismatchConfig(use_tis=True, tis_clip=2.0, tis_clip_low=0.6, tis_mode="mask")
    stats = mm.apply_mismatch(cfg, None, FP32_ACTOR, batch)
    assert torch.equal(batch.loss_mask, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert stats["tis_rejected_frac"] == pytest.approx(3 / 5)
    # per-token loss: 2 tokens in the divisor, not 5; per-token values 10 and 20 -> (10*1 + 20*1.5)/2
    values = torch.tensor([[10.0, 99.0, 99.0], [99.0, 20.0, 99.0]])
    reduce = LossReducer(
        batch.loss_mask, True, LossReducer.global_denominator(batch.loss_mask, True)
    )
    assert float(reduce(values * batch.tis_weights)) == pytest.approx((10 + 30) / 2)
    # miles' icepop path names the same token-level mask
    batch.loss_mask, batch.old_logprobs = MASK.clone(), ENGINE.clone()
    cfg = mm.MismatchConfig(use_tis=True, tis_clip=2.0, tis_clip_low=0.6)
    cfg.custom_tis_function_path = MILES_ICEPOP
    mm.apply_mismatch(cfg, None, FP32_ACTOR, batch)
    assert torch.equal(batch.loss_mask, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


def test_mismatch_metrics_by_hand():
    trainer = torch.zeros(1, 2)
    engine = torch.tensor([[math.log(2.0), 0.0]])
    m = mismatch_metrics(trainer, engine, torch.ones(1, 2))
    assert m["mismatch_k3_kl"] == pytest.approx((2 - 1 - math.log(2)) / 2)
    assert m["mismatch_k1_kl"] == pytest.approx(-math.log(2) / 2)
    assert m["mismatch_seq_ppl_ratio"] == pytest.approx(math.exp(-math.log(2) / 2))


def test_opsm_drops_only_negative_advantage_sequences_past_delta():
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    current = torch.zeros(3, 2)
    old = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.05, 7.0]])  # mean old - current: .5 .5 .05
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]]) * mask
    keep = opsm_keep(current, old, adv, mask, delta=0.1)
    assert torch.equal(keep, torch.tensor([[0.0], [1.0], [1.0]]))


def test_choosing_a_correction_without_use_tis_is_refused():
    with pytest.raises(UserError, match="give --use-tis"):
        mm.MismatchConfig(tis_mode="mask").validate()
    with pytest.raises(UserError, match="--custom-tis-function-path: cannot import"):
        mm.MismatchConfig(use_tis=True, custom_tis_function_path="nosuch.fn").validate()


def test_a_custom_tis_function_is_named_when_it_raises_or_returns_the_wrong_thing(tmp_path):
    """--custom-tis-function-path goes through the hook boundary like every user function: what
    it raises is one line naming the flag, and its return is checked before it weights a loss."""
    module = tmp_path / "tis_fns.py"
    module.write_text(
        "import torch\n"
        "def boom(cfg, trainer, rollout, mask):\n    raise RuntimeError('no')\n"
        "def scalar(cfg, trainer, rollout, mask):\n    return 1.0\n"
        "def nan(cfg, trainer, rollout, mask):\n"
        "    return mask * float('nan'), mask, {}\n"
        "def good(cfg, trainer, rollout, mask):\n    return mask, mask, {'w': 1.0}\n"
    )
    mask = torch.ones(2, 3)
    for name, message in (
        ("boom", "--custom-tis-function-path"),
        ("scalar", "returned float; expected (weights tensor"),
        ("nan", "returned weights that are not all finite"),
    ):
        cfg = mm.MismatchConfig(use_tis=True, custom_tis_function_path=f"{module}:{name}")
        with pytest.raises(UserError, match=re.escape(message)):
            mm.load_tis_function(cfg)(cfg, mask, mask, mask)
    cfg = mm.MismatchConfig(use_tis=True, custom_tis_function_path=f"{module}:good")
    assert mm.load_tis_function(cfg)(cfg, mask, mask, mask)[2] == {"w": 1.0}


def test_the_corrections_run_in_train(cli, builtin_model, tmp_path):
    import json

    from conftest import builtin_train_args

    flags = ["--use-tis", "--tis-mode", "mask", "--tis-level", "sequence", "--use-opsm"]
    done = cli(
        "train",
        *builtin_train_args("--num-rollout", "1", *flags, "--get-mismatch-metrics"),
        "--save",
        tmp_path / "s",
    )
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "s" / "metrics.jsonl").read_text().splitlines()[-1])
    # the in-process engine samples with the trainer's weights: nothing rejected, ~no mismatch
    # (in bf16 its fp32 logits against the trainer's bf16 ones: k3 ~1e-5)
    assert record["tis_rejected_frac"] == 0.0 and abs(record["mismatch_k3_kl"]) < 1e-4
    assert "opsm_masked_frac" in record and record["grad_norm"] > 0

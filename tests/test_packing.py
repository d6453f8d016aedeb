"""Token-budget micro-batches (`mileage.training.packing`): packed forwards give the padded
forward's log-probs, entropies, values and gradients (to float rounding), the loss is
normalised as with padded micro-batches, the micro-batches are cut within the budget and in the
same number on every rank, and the flags are refused where they would not do what they say."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_shared_prompt import A, B, C, Sample
from transformers import AutoModelForCausalLM

from mileage import ranks
from mileage.precision import BF16, FP32, set_precision
from mileage.training.actor import sequence_logprobs
from mileage.training.batch import pack_samples
from mileage.training.critic import ValueModel, sequence_values
from mileage.training.losses import LossReducer
from mileage.training.packing import Batching, pack, split_to, token_bins

# long-tailed responses, repeated and distinct prompts, an empty response, a row whose
# response is all tool tokens (loss mask 0)
ROWS = [
    (A, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]),
    (C, [25]),
    (A, [26, 27]),
    (B, []),
    (C, [28, 29, 30, 31, 32, 33]),
    (B, [34, 35, 36], False),
    (A, [37, 38, 39]),
    ([1, 40, 41], [42, 43]),
]


def _batch():
    samples = [Sample(p, [t % 40 for t in r], *rest) for p, r, *rest in ROWS]
    return pack_samples(samples, pad_id=0), samples


@pytest.fixture(scope="module")
def model(tiny_hf):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_hf)
    for p in m.parameters():  # a random model's logits are near uniform: sharpen them
        p.data.mul_(3.0)
    return set_precision(m, FP32)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _losses_and_grads(model, batch, batching: Batching, per_token: bool):
    """What the actor does with a global batch: per micro-batch, a loss share of the global
    batch's normaliser, accumulated; returns the summed loss, the gradients and the log-probs
    in the batch's target space."""
    model.zero_grad(set_to_none=True)
    denominator = LossReducer.global_denominator(batch.loss_mask, per_token)
    total = 0.0
    logps = torch.zeros_like(batch.old_logprobs)
    row = 0
    for part in batching.rank_parts(batch, 0, len(batch)):
        logp, entropy = sequence_logprobs(model, part, 0.7, with_entropy=True)
        reduce = LossReducer(part.loss_mask, per_token, denominator)
        loss = -reduce(logp) - 0.1 * reduce(entropy)
        loss.backward()
        total += float(loss.detach())
        first = part.target_offset
        logps[row : row + len(part), first : first + logp.shape[1]] = logp.detach()
        row += len(part)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return total, grads, logps * batch.loss_mask


@pytest.mark.parametrize("attention", ["mileage_sdpa", "sdpa"])
@pytest.mark.parametrize("per_token", [False, True], ids=["sample-mean", "token-mean"])
def test_packed_loss_and_gradients_equal_the_padded_ones(model, attention, per_token):
    """mileage_sdpa runs each packed sample's attention alone; stock SDPA gets transformers'
    block-diagonal mask from the restarting positions: both equal the padded micro-batches."""
    m = copy.deepcopy(model)
    m.set_attn_implementation(attention)
    batch, _ = _batch()
    padded = _losses_and_grads(m, batch, Batching(micro=3), per_token)
    packed_batching = Batching(micro=len(batch), max_tokens=24)
    parts = list(packed_batching.rank_parts(batch, 0, len(batch)))
    assert len(parts) > 2 and all(p.packed for p in parts)  # several packs, several samples each
    packed = _losses_and_grads(m, batch, packed_batching, per_token)
    assert packed[0] == pytest.approx(padded[0], rel=1e-5)
    torch.testing.assert_close(packed[2], padded[2], rtol=0, atol=2e-5)
    assert len(packed[1]) == len(padded[1]) > 0
    for got, want in zip(packed[1], padded[1], strict=True):
        assert _relative_error(got, want) < 1e-5


def test_bf16_packed_logprobs_match_the_padded_ones(model):
    m = set_precision(copy.deepcopy(model), BF16)
    batch, _ = _batch()
    with torch.no_grad():
        padded, _ = sequence_logprobs(m, batch.slice(0, len(batch)), 1.0)
        part = dataclasses.replace(batch.slice(0, len(batch)), packed=True)
        packed, _ = sequence_logprobs(m, part, 1.0)
    mask = part.loss_mask
    torch.testing.assert_close(packed * mask, padded * mask, rtol=0, atol=2e-2)


def test_no_attention_crosses_samples_in_a_pack(model):
    """Changing one sample's tokens leaves every other sample's log-probs as they were."""
    batch, _ = _batch()
    part = dataclasses.replace(batch.slice(0, len(batch)), packed=True)
    changed = dataclasses.replace(part, input_ids=part.input_ids.clone())
    changed.input_ids[0, 1:6] = 2  # the first sample's prompt and response
    with torch.no_grad():
        before, _ = sequence_logprobs(model, part, 1.0)
        after, _ = sequence_logprobs(model, changed, 1.0)
    assert not torch.equal(before[0], after[0])
    torch.testing.assert_close(before[1:], after[1:], rtol=0, atol=0)


def test_packed_critic_values_equal_the_padded_ones(model):
    critic = ValueModel(copy.deepcopy(model), seed=3)
    batch, _ = _batch()
    whole = batch.slice(0, len(batch))
    with torch.no_grad():
        padded = sequence_values(critic, whole)
        packed = sequence_values(critic, dataclasses.replace(whole, packed=True))
    inside = torch.zeros_like(padded, dtype=torch.bool)
    lengths = whole.attention_mask.sum(dim=1)
    for row, length in enumerate(lengths.tolist()):
        inside[row, : length - 1 - whole.target_offset] = True
    torch.testing.assert_close(packed[inside], padded[inside], rtol=0, atol=2e-5)
    assert torch.all(packed[~inside] == 0)


def test_pack_lays_rows_end_to_end_with_restarting_positions():
    batch, samples = _batch()
    packed = pack(batch.slice(2, 5), response_only=True)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples[2:5]]
    assert packed.input_ids.shape == (1, sum(lengths))
    want = [p for n in lengths for p in range(n)]
    assert packed.position_ids[0].tolist() == want
    kwargs = packed.forward_kwargs()
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 6, 9, 22]
    # response columns only: A + 2 answers, B + none, C + 6 answers
    assert packed.rows.tolist() == [0, 0, 2, 2, 2, 2, 2, 2]


def test_token_bins_are_contiguous_within_the_budget_and_cover_every_sample():
    lengths = [5, 9, 3, 12, 1, 1, 7, 30, 2]
    bins = token_bins(lengths, 12, start=4)
    assert bins[0][0] == 4 and bins[-1][1] == 4 + len(lengths)
    assert all(a[1] == b[0] for a, b in zip(bins, bins[1:], strict=False))
    for a, b in bins:
        tokens = sum(lengths[i - 4] for i in range(a, b))
        assert tokens <= 12 or b - a == 1  # a sample over the budget runs alone
    assert (11, 12) in bins  # the 30-token sample
    assert token_bins([], 8) == []


def test_split_to_reaches_the_count_by_halving_the_largest_packs():
    lengths = dict(enumerate([4, 4, 4, 4, 10, 1]))
    bins = [(0, 4), (4, 6)]
    assert split_to(bins, lengths, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_to(bins, lengths, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert split_to([(0, 1)], lengths, 3) == [(0, 1)]  # one sample cannot be split


def test_every_rank_runs_as_many_micro_batches(monkeypatch):
    """FSDP2 pairs up the ranks' backwards: a rank whose share packs into fewer micro-batches
    splits its own until the counts agree (here rank 1 of 2, whose samples are short)."""
    batch, _ = _batch()
    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    counts = {}
    for rank in (0, 1):
        monkeypatch.setattr(ranks, "rank", lambda rank=rank: rank)
        monkeypatch.setattr(ranks, "all_gather_object", lambda n: [n, 4])
        parts = list(Batching(micro=8, max_tokens=20).rank_parts(batch, 0, 8))
        counts[rank] = [len(p) for p in parts]
    assert counts == {0: [1, 1, 1, 1], 1: [1, 1, 1, 1]}
    monkeypatch.setattr(ranks, "all_gather_object", lambda n: [n, n])
    monkeypatch.setattr(ranks, "rank", lambda: 1)
    assert [len(p) for p in Batching(micro=8, max_tokens=20).rank_parts(batch, 0, 8)] == [2, 2]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
        (["--max-tokens-per-gpu", "64"], "applies only with --use-dynamic-batch-size"),
        (
            ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--micro-batch-size", "4"],
            "--micro-batch-size 4 would be ignored",
        ),
        (
            ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "8"],
            "--max-tokens-per-gpu 8 is less than one sample: prompts of up to 7 tokens + "
            "--rollout-max-response-len 4 = 11; give at least 11",
        ),
    ],
    ids=["no-budget", "budget-alone", "with-micro-batch", "budget-below-a-sample"],
)
def test_flags_that_cannot_work_are_one_line_and_exit_2(
    builtin_model, tmp_path, capsys, flags, says
):
    from mileage.cli.main import main

    code = main(["plan", "--rollout-max-response-len", "4", "--save", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [f"mileage: error: {err.strip().split('error: ', 1)[1]}"]
    assert says in err


def test_the_plan_states_the_token_budget(builtin_model, tmp_path, capsys):
    from mileage.cli.main import main

    flags = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"]
    assert main(["plan", "--rollout-max-response-len", "4", "--save", str(tmp_path), *flags]) == 0
    out = capsys.readouterr().out
    assert "micro-batches of up to 64 tokens, each packed into one row" in out


def test_the_gpu_check_s_packing_step_passes_here_on_the_cpu(builtin_model, capsys):
    """scripts/gpu_packing.py, which scripts/gpu_check.sh runs on a GPU, checked on the CPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_packing.py"
    spec = importlib.util.spec_from_file_location("gpu_packing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--precision", "fp32"]) == 0
    assert "one SDPA call per sample" in capsys.readouterr().out

"""Sampling noise is indexed by (seed, rollout, row, rank), never repeated across them.

The exactness tests compare a run with itself, so a sampler seeded the same way in every
rollout (or every group, epoch or rank) would pass them all. These tests hold the prompt and
the weights fixed and change one index at a time: the samples must then differ, and with the
same indices they must be equal. miles and slime seed SGLang with `rollout_seed + index in
group`, the same seeds in every group and every rollout; mileage must not.

Seeds are only checked for distinctness, never for their values, so these tests hold for any
seed width (remote engines may mask row seeds to what the server accepts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import fast_train_args

from mileage import ranks
from mileage.distributed import rollout as dist_rollout
from mileage.models.hf import load_causal_lm
from mileage.rollout.engine import Completion, LocalEngine, SamplingParams
from mileage.rollout.engines.base import SamplingSeed
from mileage.rollout.engines.config import EngineConfig
from mileage.rollout.engines.sglang import SGLangEngine
from mileage.rollout.engines.vllm import VLLMEngine
from mileage.testing.servers import start_servers

PROMPT = [1, 5, 6, 7]
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0)
ROWS, GROUP = 16, 4  # one rollout: 4 groups of 4 samples of the same prompt


def responses(completions: list[Completion]) -> list[tuple[int, ...]]:
    return [tuple(c.response_ids) for c in completions]


def assert_mostly_different(a: list, b: list) -> None:
    """Two draws of the same rows from independent streams: at most one row may coincide by
    chance (a short answer ending in EOS at once); a repeated stream makes every row equal."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    assert same <= 1, f"{same} of {len(a)} rows drew the same sample"


def assert_rows_distinct(rows: list) -> None:
    """Rows of one rollout (here all of the same prompt) draw from distinct streams."""
    assert len(set(rows)) >= len(rows) - 1, rows


@pytest.fixture(scope="module")
def model(tiny_hf):
    return load_causal_lm(tiny_hf)


# --- the seeds themselves --------------------------------------------------------------------


def test_row_seeds_are_distinct_across_seeds_rollouts_and_rows_and_stable():
    grid = [(s, r, row) for s in (0, 1234) for r in range(8) for row in range(64)]
    seeds = [SamplingSeed(s, r).row_seed(row) for s, r, row in grid]
    assert len(set(seeds)) == len(grid)  # no two (seed, rollout, row) share a stream
    assert seeds == [SamplingSeed(s, r).row_seed(row) for s, r, row in grid]
    assert all(isinstance(x, int) and x >= 0 for x in seeds)


def test_in_process_generators_differ_across_rollouts_and_repeat_for_the_same_rollout():
    draws = {r: torch.rand(32, generator=SamplingSeed(7, r).generator()) for r in range(4)}
    for r in range(1, 4):
        assert not torch.equal(draws[0], draws[r])
    assert torch.equal(draws[2], torch.rand(32, generator=SamplingSeed(7, 2).generator()))
    assert not torch.equal(draws[0], torch.rand(32, generator=SamplingSeed(8, 0).generator()))


# --- what remote engines send ----------------------------------------------------------------


def sglang_seeds(tmp_path: Path, rollout_id: int) -> list[int]:
    """The `sampling_seed` of every row SGLangEngine sends for one rollout, in row order."""
    engine = SGLangEngine(["http://127.0.0.1:9"], 64, timeout=1, attempts=1, sync_timeout=1,
                          weights_dir=str(tmp_path / "w"))  # fmt: skip
    sent: list[dict] = []

    def fake_map(endpoint, payloads, validators):
        sent.extend(payloads)
        return [[] for _ in payloads]

    engine.pool.map = fake_map
    engine.generate([PROMPT] * ROWS, PARAMS, SamplingSeed(99, rollout_id), group_size=GROUP)
    assert len(sent) == ROWS // GROUP  # one request per group
    return [row["sampling_seed"] for payload in sent for row in payload["sampling_params"]]


def vllm_seeds(tmp_path: Path, rollout_id: int) -> list[int]:
    """The `seed` of every request VLLMEngine sends for one rollout (one row per request)."""
    cfg = EngineConfig(rollout_engine="vllm", rollout_url=["http://127.0.0.1:9"],
                       rollout_weights_dir=str(tmp_path / "w"))  # fmt: skip
    engine = VLLMEngine(cfg, vocab_size=64, eos_id=2, model_dir="unused", log=print)
    sent: list[dict] = []

    def fake_map(endpoint, payloads, validators):
        sent.extend(payloads)
        return []

    engine.pool.map = fake_map
    engine.generate([PROMPT] * ROWS, PARAMS, SamplingSeed(99, rollout_id), group_size=GROUP)
    return [payload["seed"] for payload in sent]


@pytest.mark.parametrize("seeds_of", [sglang_seeds, vllm_seeds], ids=["sglang", "vllm"])
def test_remote_engines_send_every_row_of_every_rollout_its_own_seed(tmp_path, seeds_of):
    first, second = seeds_of(tmp_path, 0), seeds_of(tmp_path, 1)
    assert len(first) == ROWS
    # distinct across rows and groups (not `seed + index in group`) and across rollouts
    assert len(set(first + second)) == 2 * ROWS
    assert seeds_of(tmp_path, 0) == first  # a retry or a resume sends the same seeds


@pytest.fixture(scope="module")
def server(tiny_hf):
    (proc,) = start_servers(tiny_hf, 1)
    yield proc
    proc.stop()


def test_mileage_serve_samples_differ_across_rollouts_and_groups(server, model, tmp_path):
    engine = SGLangEngine([server.url], 64, timeout=60, attempts=2, sync_timeout=60,
                          weights_dir=str(tmp_path / "w"))  # fmt: skip
    engine.update_weights(model, 0)
    try:
        runs = {
            r: responses(engine.generate([PROMPT] * ROWS, PARAMS, SamplingSeed(5, r), GROUP))
            for r in (0, 1)
        }
        again = responses(engine.generate([PROMPT] * ROWS, PARAMS, SamplingSeed(5, 0), GROUP))
    finally:
        engine.close()
    assert again == runs[0]
    assert_mostly_different(runs[0], runs[1])
    assert_rows_distinct(runs[0])
    # group g's rows against group 0's: the same prompt in another group draws other samples
    for g in range(1, ROWS // GROUP):
        assert_mostly_different(runs[0][:GROUP], runs[0][g * GROUP : (g + 1) * GROUP])


# --- the in-process engine -------------------------------------------------------------------


def test_local_engine_samples_differ_across_rollouts_and_rows(model):
    engine = LocalEngine(model, pad_id=0, eos_id=2)

    def sample(seed: int, rollout_id: int):
        return responses(engine.generate([PROMPT] * ROWS, PARAMS, SamplingSeed(seed, rollout_id)))

    first = sample(3, 0)
    assert sample(3, 0) == first
    assert_rows_distinct(first)
    assert_mostly_different(first, sample(3, 1))
    assert_mostly_different(first, sample(4, 0))


# --- ranks under torchrun (simulated: the share a rank samples does not need a process group) -


def rank_share(model, monkeypatch, rank: int, world: int, rollout_id: int = 0):
    """What rank `rank` of `world` samples itself (before the all-gather) for one rollout."""
    # env re-exports mileage.ranks' helpers, which call each other there: patch both
    for module in (dist_rollout.env, ranks):
        monkeypatch.setattr(module, "world_size", lambda: world)
        monkeypatch.setattr(module, "rank", lambda: rank)
        monkeypatch.setattr(module, "all_gather_object", lambda value: [value])
    engine = dist_rollout.ShardedGenerationEngine(LocalEngine(model, 0, 2), group_size=GROUP)
    seed = SamplingSeed(11, rollout_id)
    return responses(engine.generate([PROMPT] * ROWS, PARAMS, seed, group_size=GROUP))


def test_two_ranks_do_not_draw_the_same_stream(model, monkeypatch):
    rank0 = rank_share(model, monkeypatch, 0, 2)
    rank1 = rank_share(model, monkeypatch, 1, 2)
    assert len(rank0) == len(rank1) == ROWS // 2
    assert rank_share(model, monkeypatch, 1, 2) == rank1
    assert_mostly_different(rank0, rank1)  # same prompt, same weights, another rank
    assert_rows_distinct(rank0 + rank1)
    # a group's samples do not depend on which rank drew it: rank 1 of 2 holds groups 2 and 3,
    # which are rank 2's and rank 3's shares at world size 4
    assert rank1 == rank_share(model, monkeypatch, 2, 4) + rank_share(model, monkeypatch, 3, 4)
    assert_mostly_different(rank1, rank_share(model, monkeypatch, 1, 2, rollout_id=1))


# --- a run: the same prompts in the next epoch, with unchanged weights ------------------------


def test_a_run_samples_the_same_prompts_differently_in_each_epoch(cli, tiny_hf, tmp_path):
    """Four prompts, a batch of four: rollout 1 is epoch 1 with the very prompts of rollout 0,
    and --lr 0 keeps the weights; the samples must still differ (and repeat in a rerun)."""
    data = tmp_path / "four.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n"
                            for i in range(1, 5)))  # fmt: skip

    def run(name: str) -> dict[int, list]:
        debug = tmp_path / name / "rollout_{rollout_id}.json"
        args = fast_train_args(tiny_hf, "--rollout-max-response-len", "8")
        result = cli("train", *args, "--prompt-data", data, "--num-rollout", 2, "--lr", 0,
                     "--save", tmp_path / name / "save", "--save-debug-rollout-data", debug)  # fmt: skip
        assert result.returncode == 0, result.stderr
        out = {}
        for r in (0, 1):
            samples = json.loads(Path(str(debug).format(rollout_id=r)).read_text())["samples"]
            by_prompt: dict[int, list] = {}
            for s in samples:  # a prompt's samples in the order they were drawn
                by_prompt.setdefault(s["prompt"]["index"], []).append(tuple(s["response_ids"]))
            out[r] = [row for index in sorted(by_prompt) for row in by_prompt[index]]
            assert sorted(by_prompt) == [0, 1, 2, 3]  # every prompt, in both epochs
        return out

    first = run("a")
    assert_mostly_different(first[0], first[1])
    assert run("b") == first

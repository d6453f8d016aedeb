"""User functions at the hook boundary (mileage.rollout.userfn): what a reward, filter, generate,
rollout or loss function returns is checked; one that raises, calls sys.exit or hangs stops the
run with one line naming the function, its flag and the sample (exit 2), the user's traceback
above it; a generate function that leaves `response` empty has it decoded.

In-process with fakes (a one-turn engine, the char tokenizer), except one `mileage train` that
shows a hanging reward stops the run before its rollout is saved."""

from __future__ import annotations

import asyncio
import re
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from conftest import fast_train_args, run_cli

from mileage.errors import UserError
from mileage.models.tiny import build_char_tokenizer
from mileage.rollout.agent import Agent, load_user_functions
from mileage.rollout.dynamic import judge, load_group_filter
from mileage.rollout.engines.base import Completion, SamplingParams
from mileage.rollout.multiturn import MultiTurnConfig
from mileage.rollout.prompts import Prompt
from mileage.rollout.rewards import MAX_ABS_REWARD, load_custom_reward, score_all, score_samples
from mileage.rollout.rollout import PromptEncoder, generate_samples
from mileage.rollout.sample import Sample
from mileage.rollout.tasks import builtin_alphabet
from mileage.training.algo import load_custom_loss

HOOKS = """
import asyncio, sys, threading

RELEASE = threading.Event()  # set by the tests: lets a hung hook's thread end
# a "hang" ends by itself after this long, so a timeout that never fires fails the test
# (the hook returns) instead of hanging it (mutant hook-timeout-never-fires)
HANG = 5


def reward_of(value):
    def reward(prompt, response, label):
        return value
    return reward


yes, none, a_list = reward_of("yes"), reward_of(None), reward_of([1.0])
nan, inf, huge = reward_of(float("nan")), reward_of(float("inf")), reward_of(1e308)
true = reward_of(True)


def bad_second(prompt, response, label):
    return "yes" if prompt == "p1" else 0.5


def raises(prompt, response, label):
    return {}["no such key"]


def exits(prompt, response, label):
    sys.exit(0)


def hangs(prompt, response, label):
    RELEASE.wait(HANG)
    return 0.0


async def hangs_async(prompt, response, label):
    for _ in range(HANG * 100):
        if RELEASE.is_set():
            break
        await asyncio.sleep(0.01)
    return 0.0


def group_short(config, samples):
    return [1.0]


def maybe(config, samples):
    return "maybe"


def keep_none(config, samples):
    return None


def filter_raises(config, samples):
    raise ValueError("filter broke")


async def generate_out_of_vocab(ctx, sample, params):
    sample.response_ids, sample.logprobs = [10**6], [0.0]
    sample.loss_mask, sample.weight_versions = [1], [0]
    return sample


async def generate_no_text(ctx, sample, params):
    out = await ctx.client.generate(sample.prompt_ids)
    sample.response_ids, sample.logprobs = out.ids, out.logprobs
    sample.loss_mask = [1] * len(out.ids)
    sample.weight_versions = [out.weight_version] * len(out.ids)
    return sample  # response left ""


async def generate_raises(ctx, sample, params):
    raise RuntimeError("generate broke")


async def generate_exits(ctx, sample, params):
    sys.exit(0)


async def generate_blocks(ctx, sample, params):
    await ctx.client.generate(sample.prompt_ids)
    RELEASE.wait(HANG)  # blocks the event loop: only the watching thread can see it
    return sample


def loss_raises(args, batch, logp, reduce):
    raise KeyError("loss broke")


def loss_exits(args, batch, logp, reduce):
    sys.exit(3)


def loss_not_a_pair(args, batch, logp, reduce):
    return 1.0
"""


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    path = tmp_path_factory.mktemp("hooks") / "user_hooks.py"
    path.write_text(HOOKS)
    yield f"{path}"
    release = load_custom_reward(f"{path}:hangs").fn.__globals__["RELEASE"]
    release.set()


def samples_of(prompts: list[str]) -> list[Sample]:
    return [
        Sample(Prompt(i, text, "x"), [1], [2], [0.0], "r", 0.0, True)
        for i, text in enumerate(prompts)
    ]


def assert_named(excinfo, *parts: str) -> str:
    line = str(excinfo.value)
    assert "\n" not in line, line
    for part in parts:
        assert part in line, (part, line)
    return line


@pytest.mark.parametrize(
    ("fn", "shown"),
    [
        ("yes", "str 'yes'"),
        ("none", "NoneType None"),
        ("a_list", "list [1.0]"),
        ("nan", "nan"),
        ("inf", "inf"),
        ("huge", "1e+308"),
    ],
)
def test_a_reward_that_is_not_a_bounded_real_number_is_refused(hooks, fn, shown):
    reward = load_custom_reward(f"{hooks}:{fn}")
    with pytest.raises(UserError) as excinfo:
        score_samples(reward, samples_of(["p0", "p1"]), None, 2)
    line = assert_named(excinfo, "--custom-rm-path", "sample 0 (prompt 0)", shown, "expected")
    if fn == "huge":
        assert f"|reward| <= {MAX_ABS_REWARD:g}" in line


def test_a_reward_names_the_sample_it_failed_on_and_bool_counts_as_0_or_1(hooks):
    with pytest.raises(UserError) as excinfo:
        score_all(load_custom_reward(f"{hooks}:bad_second"), [("p0", "r", "l"), ("p1", "r", "l")])
    assert_named(excinfo, "sample 1", "str 'yes'")
    assert score_all(load_custom_reward(f"{hooks}:true"), [("p", "r", "l")]) == [1.0]


def test_a_group_reward_of_the_wrong_length_names_the_group(hooks):
    reward = load_custom_reward(f"{hooks}:group_short", group_rm=True)
    with pytest.raises(UserError) as excinfo:
        score_samples(reward, samples_of(["a", "a", "b", "b"]), None, 2, group_rm=True)
    assert_named(excinfo, "--group-rm", "the group of prompt 0", "expected a list of 2 rewards")


@pytest.mark.parametrize(
    ("fn", "raised"),
    [("raises", "raised KeyError: 'no such key'"), ("exits", "called sys.exit(0)")],
)
def test_a_reward_that_raises_or_exits_is_named_under_its_traceback(hooks, capsys, fn, raised):
    with pytest.raises(UserError) as excinfo:
        score_all(load_custom_reward(f"{hooks}:{fn}"), [("p", "r", "l")])
    assert_named(excinfo, "--custom-rm-path: the reward function", raised, "sample 0")
    err = capsys.readouterr().err
    assert "user_hooks.py" in err and f"in {fn}" in err  # the user's own traceback


@pytest.mark.parametrize("fn", ["hangs", "hangs_async"])
def test_a_hung_reward_is_stopped_by_the_hook_timeout(hooks, fn):
    reward = load_custom_reward(f"{hooks}:{fn}", timeout=0.2)
    with pytest.raises(UserError) as excinfo:
        score_all(reward, [("p", "r", "l")])
    line = assert_named(excinfo, "--custom-rm-path", "--hook-timeout 0.2s", "sample 0")
    if fn == "hangs":  # blocked in the user's code: its line is named
        assert re.search(r"at .*user_hooks\.py:\d+", line), line


@pytest.mark.parametrize(
    ("fn", "shown"), [("maybe", "str 'maybe'"), ("keep_none", "NoneType 'None'")]
)
def test_a_filter_that_does_not_return_a_bool_is_refused(hooks, fn, shown):
    keep = load_group_filter(f"{hooks}:{fn}")
    with pytest.raises(UserError) as excinfo:
        judge(keep, None, samples_of(["a", "a"]))
    assert_named(excinfo, "--dynamic-sampling-filter-path", "the group of prompt 0", shown)


def test_a_filter_that_raises_is_named(hooks, capsys):
    with pytest.raises(UserError) as excinfo:
        judge(load_group_filter(f"{hooks}:filter_raises"), None, samples_of(["a"]))
    assert_named(excinfo, "--dynamic-sampling-filter-path: the filter raised ValueError")
    assert "filter broke" in capsys.readouterr().err


class OneTurnEngine:
    """Answers every prompt with "7" then EOS."""

    in_process = False

    def __init__(self, tok):
        self.tok = tok
        self.weight_version = 0

    def generate(self, prompts, params, seed=None, group_size=1):
        answer = self.tok("7", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [Completion(list(p), answer, [-0.5] * len(answer), True, 0) for p in prompts]

    def close(self):
        pass


def run_generate(hooks: str, fn: str, timeout: float = 600.0) -> list[Sample]:
    mt = MultiTurnConfig(custom_generate_function_path=f"{hooks}:{fn}")
    config = Namespace(multiturn=mt, reward=Namespace(group_rm=False))
    tok = build_char_tokenizer(builtin_alphabet())
    encode = PromptEncoder(tok, False)

    def exact(prompt, response, label):
        return float(response == label)

    user = load_user_functions(mt, timeout)
    agent = Agent(config, user, tok, encode, exact, None, 64)
    prompts = [Prompt(0, "3+4=", "7"), Prompt(1, "1+1=", "2")]
    params = SamplingParams(max_new_tokens=4)
    return generate_samples(OneTurnEngine(tok), encode, prompts, params, 2, exact, 0, 0, agent)


def test_a_generate_function_that_leaves_response_empty_gets_it_decoded(hooks):
    samples = run_generate(hooks, "generate_no_text")
    assert [s.response for s in samples] == ["7"] * 4
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0]  # the reward read the text


def test_generated_ids_outside_the_vocabulary_are_refused(hooks):
    with pytest.raises(UserError) as excinfo:
        run_generate(hooks, "generate_out_of_vocab")
    assert_named(
        excinfo, "--custom-generate-function-path", "1000000", "sample 0 (prompt 0)", "vocabulary"
    )


@pytest.mark.parametrize(
    ("fn", "raised"),
    [("generate_raises", "raised RuntimeError: generate broke"), ("generate_exits", "sys.exit")],
)
def test_a_generate_function_that_raises_or_exits_is_named(hooks, capsys, fn, raised):
    with pytest.raises(UserError) as excinfo:
        run_generate(hooks, fn)
    assert_named(excinfo, "--custom-generate-function-path: the generate function", raised)
    assert f"in {fn}" in capsys.readouterr().err


def test_a_generate_function_blocking_its_event_loop_is_stopped_by_the_timeout(hooks):
    with pytest.raises(UserError) as excinfo:
        run_generate(hooks, "generate_blocks", timeout=0.3)
    assert_named(excinfo, "--custom-generate-function-path", "--hook-timeout 0.3s", "sample 0")


def test_time_spent_waiting_on_the_run_is_not_the_hooks():
    """A generate function's clock stops while it awaits the engine or a tool."""
    from mileage.rollout.userfn import Clock

    clock = Clock()
    clock.start()
    started = clock.started
    with clock.waiting_on_the_run():
        inside = clock.own(started + 100.0)  # 100 s of waiting on the engine...
    assert inside < 1.0  # ...are not the hook's
    assert clock.own(clock.started + 1e9) > 1e8  # its own time is


@pytest.mark.parametrize(
    ("fn", "said"),
    [
        ("loss_raises", "raised KeyError: 'loss broke'"),
        ("loss_exits", "called sys.exit(3)"),
        ("loss_not_a_pair", "returned float; expected (loss tensor, dict of metrics)"),
    ],
)
def test_a_custom_loss_that_fails_is_named(hooks, monkeypatch, fn, said):
    monkeypatch.syspath_prepend(str(Path(hooks).parent))
    loss = load_custom_loss(f"user_hooks:{fn}")
    with pytest.raises(UserError) as excinfo:
        loss(None, None, torch.zeros(1), None)
    assert_named(excinfo, "--custom-loss-function-path: the custom loss", said)


def test_a_hung_reward_stops_train_before_the_rollout_is_saved(hooks, tiny_hf, tmp_path):
    """Rollout 0 is saved; the reward hangs in rollout 1: exit 2, one line naming the hook, and
    the run's last checkpoint is still rollout 0's (a rerun continues from there)."""
    path = tmp_path / "slow_rm.py"
    path.write_text(
        "import threading\n"
        "calls = []\n"
        "def reward(prompt, response, label):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 17:  # rollout 1's first sample (ends: a mutant fails, not hangs)\n"
        "        threading.Event().wait(30)\n"
        "    return 0.0\n"
    )
    save = tmp_path / "run"
    flags = ["--num-rollout", "2", "--save", str(save), "--save-interval", "1"]
    flags += ["--custom-rm-path", f"{path}:reward", "--hook-timeout", "2"]
    result = run_cli("train", *fast_train_args(tiny_hf, *flags), timeout=300)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mileage: error: --custom-rm-path: the reward function"), last
    assert "--hook-timeout 2s" in last and "sample 0" in last, last
    tracker = (save / "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == "0" and not (save / "iter_0000001").exists()


def test_the_reward_bound_is_where_the_advantage_math_stays_finite():
    """Why MAX_ABS_REWARD: a group at the bound (fp32, as training batches rewards) normalises to
    finite advantages; a reward of 1e308 does not."""
    from mileage.training.advantages import grpo_advantages

    for bound, finite in ((MAX_ABS_REWARD, True), (1e308, False)):
        rewards = torch.tensor([bound, -bound, bound, 0.0], dtype=torch.float32)
        adv = grpo_advantages(rewards, torch.ones(4, 1), 4)
        assert bool(torch.isfinite(adv).all()) == finite


def test_async_hooks_are_awaited_concurrently_behind_the_boundary(hooks, tmp_path):
    """A pure coroutine reward scores every sample in one event loop (as before the boundary)."""
    path = tmp_path / "conc.py"
    path.write_text(
        "import asyncio\n"
        "running = []\n"
        "async def reward(prompt, response, label):\n"
        "    running.append(1)\n"
        "    while len(running) < 3:\n"
        "        await asyncio.sleep(0.001)\n"
        "    return 1.0\n"
    )
    reward = load_custom_reward(f"{path}:reward", timeout=60)
    assert score_all(reward, [("p", "r", "l")] * 3) == [1.0, 1.0, 1.0]
    assert asyncio.iscoroutinefunction(reward.fn)

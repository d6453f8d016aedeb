"""verifiers (0.4.0) tasksets as prompt data: the spec, prompts and labels, each task's own rubric
as the reward, what does not fit refused in one line, and an exact resume of a training run on the
built-in model. The tasksets are defined here (no hub download) and imported by verifiers' own
loader from a temporary directory, as an installed environment package would be."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from conftest import builtin_train_args
from judge_server import StandIn

from mileage.checkpoint.inspect import list_checkpoints
from mileage.errors import UserError
from mileage.rollout import vfenv
from mileage.rollout.data import DataConfig, load_eval_sets, load_train_prompts, task_reward
from mileage.rollout.vfenv import VerifiersSpec, parse_verifiers_spec

# An addition taskset in the built-in model's format ("07+45=" -> the sum's digits reversed), with
# a weighted rubric: `correct` (weight 1), `short` (weight 0.5) and a metric that is not summed.
ADDITION = """
import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str = ""


class AddTask(vf.Task[AddData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return float(len(trace.last_reply) <= 3)

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class AddConfig(vf.TasksetConfig):
    n: int = 40
    system: str | None = None


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        for i in range(self.config.n):
            a, b = (7 * i + 3) % 100, (13 * i + 5) % 100
            data = AddData(
                prompt=f"{a:02d}+{b:02d}=",
                answer=str(a + b)[::-1],
                system_prompt=self.config.system,
            )
            yield AddTask(data, self.config.task)


__all__ = ["AddTaskset"]
"""

# Tasksets mileage must refuse, each for a reason docs/verifiers.md gives.
REFUSED = {
    "vf_own_env": """
class OwnEnv(vf.SingleAgentEnv):
    pass

__all__ = ["T", "OwnEnv"]
""",
    "vf_own_harness": """
class OwnHarness(vf.Harness):
    async def launch(self, *args, **kwargs):
        raise NotImplementedError

__all__ = ["T", "OwnHarness"]
""",
    "vf_tools": """
class Calc(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        return a + b

class ToolTask(Task):
    @classmethod
    def toolsets(cls, config):
        return [Calc(vf.ToolsetConfig())]

T.task_cls = ToolTask
__all__ = ["T"]
""",
    "vf_sandbox_reward": """
class SandboxTask(vf.Task):
    @vf.reward
    async def ran(self, trace, runtime) -> float:
        return 1.0

T.task_cls = SandboxTask
__all__ = ["T"]
""",
    "vf_setup": """
class SetupTask(Task):
    async def setup(self, trace, runtime):
        return None

T.task_cls = SetupTask
__all__ = ["T"]
""",
    "vf_messages": """
class ChatTask(Task):
    pass

T.task_cls = ChatTask
T.prompt = [vf.UserMessage(content="a"), vf.AssistantMessage(content="b"),
            vf.UserMessage(content="c")]
__all__ = ["T"]
""",
    "vf_image": """
class ImageTaskset(T):
    def load(self):
        yield Task(vf.TaskData(prompt="12+34=", image="python:3.11"), self.config.task)

__all__ = ["ImageTaskset"]
""",
    "vf_infinite": """
T.INFINITE = True
__all__ = ["T"]
""",
    "vf_broken": """
class BrokenTask(Task):
    @vf.reward
    async def boom(self, trace) -> float:
        raise ValueError("rubric exploded")

T.task_cls = BrokenTask
__all__ = ["T"]
""",
    "vf_slow": """
import asyncio

class SlowTask(Task):
    @vf.reward
    async def slow(self, trace) -> float:
        await asyncio.sleep(30)
        return 1.0

class SlowTaskset(T):
    def load(self):
        timeout = vf.TaskTimeout(scoring=0.2)
        yield SlowTask(vf.TaskData(prompt="12+34=", timeout=timeout), self.config.task)

__all__ = ["SlowTaskset"]
""",
}
REFUSED_BASE = """
import verifiers.v1 as vf


class Task(vf.Task):
    @vf.reward
    async def one(self, trace) -> float:
        return 1.0


class T(vf.Taskset):
    task_cls = Task
    prompt = "12+34="

    def load(self):
        for i in range(3):
            yield self.task_cls(vf.TaskData(prompt=self.prompt, id=str(i)), self.config.task)
"""


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """A directory of taskset packages on sys.path (and on PYTHONPATH for launched runs)."""
    root = tmp_path_factory.mktemp("vf_packages")
    (root / "vf_addition.py").write_text(ADDITION)
    for name, body in REFUSED.items():
        (root / f"{name}.py").write_text(REFUSED_BASE + textwrap.dedent(body))
    (root / "vf_missing_dependency.py").write_text("import vf_no_such_dependency\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    vfenv.load_tasks.cache_clear()


def test_spec_parsing():
    spec = parse_verifiers_spec('verifiers:owner/my-env@0.1?limit=5&skip=2&n=7&system="x y"')
    assert spec == VerifiersSpec("owner/my-env@0.1", 5, 2, (("n", "7"), ("system", '"x y"')))
    assert spec.name == "my-env"
    assert spec.config_data() == {"id": "owner/my-env@0.1", "n": 7, "system": "x y"}
    assert parse_verifiers_spec("verifiers:gsm8k") == VerifiersSpec("gsm8k")
    # a value that is not JSON is a string
    assert parse_verifiers_spec("verifiers:e?split=train").config_data()["split"] == "train"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("verifiers:", "name a verifiers environment"),
        ("verifiers:e?limit=-1", "limit must be a non-negative integer"),
        ("verifiers:e?limit=0", "limit must be positive"),
        ("verifiers:e?skip=x", "skip must be a non-negative integer"),
        ("verifiers:e?oops", "'oops' is not KEY=VALUE"),
        ("verifiers:e?id=f", "goes before '\\?'"),
    ],
)
def test_bad_specs_are_user_errors(text, message):
    with pytest.raises(UserError, match=message):
        parse_verifiers_spec(text)


def test_prompts_labels_and_the_rubric(packages):
    cfg = DataConfig(
        prompt_data="verifiers:vf_addition?limit=30",
        eval_prompt_data=["held", "verifiers:vf_addition?skip=30&limit=5"],
    )
    train = load_train_prompts(cfg)
    assert [p.text for p in train[:3]] == ["03+05=", "10+18=", "17+31="]
    assert len(train) == 30 and [p.index for p in train] == list(range(30))
    # the label is the task key verifiers records on traces: a content hash, unique per task
    tasks = vfenv.load_tasks(parse_verifiers_spec(cfg.prompt_data))
    assert [p.label for p in train] == [t.key for t in tasks]
    assert len({p.label for p in train}) == 30
    (held,) = load_eval_sets(cfg)
    assert held.name == "held" and [p.text for p in held.prompts][:1] == ["13+95="]
    assert not {p.label for p in held.prompts} & {p.label for p in train}

    reward = task_reward(cfg)
    first = train[0]  # 03+05=8 -> "8"
    # correct (weight 1) + short (weight 0.5): the trace's weighted sum, as verifiers sums it
    assert reward(first.text, "8", first.label) == 1.5
    assert reward(first.text, " 8\n", first.label) == 1.5  # last_reply is stripped
    assert reward(first.text, "9", first.label) == 0.5
    assert reward(first.text, "8888", first.label) == 0.0
    batch = [(p.text, "8", p.label) for p in train[:3]] + [(held.prompts[0].text, "82", "x")]
    with pytest.raises(UserError, match="can only grade prompts of its verifiers: environment"):
        reward.score_batch(batch)
    assert reward.score_batch(batch[:3]) == [1.5, 0.5, 0.5]
    # evaluation prompts are scored by their own tasks
    assert reward(held.prompts[0].text, "801", held.prompts[0].label) == 1.5


def test_the_trace_the_rubric_sees(packages):
    spec = parse_verifiers_spec('verifiers:vf_addition?limit=2&system="Add."')
    task = vfenv.load_tasks(spec)[1]
    assert load_train_prompts(DataConfig(prompt_data=str(spec)))[1].text == "Add.\n\n10+18="
    trace = vfenv.one_turn_trace(task, "82")
    assert [m.role for m in trace.messages] == ["system", "user", "assistant"]
    assert trace.last_reply == "82" and trace.num_turns == 1
    assert trace.task.key == task.key and trace.is_completed and trace.ok
    import asyncio

    asyncio.run(task.score(trace))
    assert trace.metrics == {"length": 2.0}
    assert {k: (r.score, r.weight) for k, r in trace.rewards.items()} == {
        "correct": (1.0, 1.0),
        "short": (1.0, 0.5),
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("verifiers:vf_no_such_env", "unknown verifiers environment 'vf_no_such_env'"),
        (
            "verifiers:vf_missing_dependency",
            "is installed but cannot be imported: no module named 'vf_no_such_dependency'",
        ),
        ("verifiers:vf_addition?n=x", "config refused n: Input should be a valid integer"),
        ("verifiers:vf_addition?bogus=1", "config refused bogus: Extra inputs"),
        ("verifiers:vf_addition?skip=40", "no tasks"),
        ("verifiers:vf_own_env", "bundles its own environment OwnEnv"),
        ("verifiers:vf_own_harness", "ships its own harness 'vf_own_harness'"),
        ("verifiers:vf_tools", "offers tools through MCP tool servers"),
        ("verifiers:vf_sandbox_reward", "no reward that scores without a sandbox runtime"),
        ("verifiers:vf_setup", "overrides setup()"),
        ("verifiers:vf_image", "task 0 runs in a container image"),
        ("verifiers:vf_messages", "conversation \\(user, assistant, user\\); without --apply-chat"),
        ("verifiers:vf_infinite", "the taskset is infinite; give limit=N"),
    ],
)
def test_what_does_not_fit_is_refused_in_one_line(packages, spec, message):
    with pytest.raises(UserError, match=message) as caught:
        load_train_prompts(DataConfig(prompt_data=spec))
    assert "\n" not in str(caught.value)


def test_with_the_chat_template_the_prompt_is_the_tasks_messages(packages):
    """--apply-chat-template: the system prompt is a system message and a conversation prompt
    is taken whole; the rubric's trace holds the same messages, only the reply sampled."""
    cfg = DataConfig(prompt_data='verifiers:vf_addition?limit=2&system="Add."')
    chat = DataConfig(prompt_data=cfg.prompt_data, apply_chat_template=True)
    plain, templated = load_train_prompts(cfg)[1], load_train_prompts(chat)[1]
    assert plain.messages is None and plain.text == "Add.\n\n10+18="
    assert templated.messages == [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "10+18="},
    ]
    assert (templated.text, templated.label) == ("10+18=", plain.label)
    assert task_reward(chat)(templated.text, "82", templated.label) == 1.5

    conversation = DataConfig(prompt_data="verifiers:vf_messages", apply_chat_template=True)
    prompt = load_train_prompts(conversation)[0]
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "user"]
    assert prompt.text == "c"
    task = vfenv.load_tasks(parse_verifiers_spec("verifiers:vf_messages"))[0]
    trace = vfenv.one_turn_trace(task, "d")
    assert [(n.message.role, n.sampled) for n in trace.nodes] == [
        ("user", False),
        ("assistant", False),
        ("user", False),
        ("assistant", True),
    ]
    assert trace.last_reply == "d" and trace.num_turns == 1


def test_an_infinite_taskset_with_a_limit_a_failing_and_a_hanging_rubric(packages):
    assert len(load_train_prompts(DataConfig(prompt_data="verifiers:vf_infinite?limit=2"))) == 2
    cfg = DataConfig(prompt_data="verifiers:vf_broken")
    prompt = load_train_prompts(cfg)[0]
    with pytest.raises(
        UserError, match="rubric of task 0 \\(BrokenTask\\) failed: .*ValueError: rubric exploded"
    ):
        task_reward(cfg)(prompt.text, "1", prompt.label)
    slow = DataConfig(prompt_data="verifiers:vf_slow")
    prompt = load_train_prompts(slow)[0]
    with pytest.raises(UserError, match="rubric of task 0 \\(SlowTask\\) ran past its scoring"):
        task_reward(slow)(prompt.text, "1", prompt.label)


def test_without_verifiers_one_line_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "verifiers" or m.startswith("verifiers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers -> ImportError
    vfenv.load_tasks.cache_clear()
    with pytest.raises(UserError, match=r"pip install 'mileage\[verifiers\]'"):
        load_train_prompts(DataConfig(prompt_data="verifiers:vf_addition"))


def test_training_on_a_taskset_resumes_exactly(tmp_path, cli, builtin_model, packages):
    """2 rollouts straight == 1 rollout, exit, resume 1, on the built-in model, rewarded by the
    taskset's rubric and evaluated on a held-out slice of it (skip=32); a bad environment id
    exits 2 with one line."""
    env = {"PYTHONPATH": os.pathsep.join([str(packages), os.environ.get("PYTHONPATH", "")])}
    args = [
        "train",
        *builtin_train_args("--prompt-data", "verifiers:vf_addition?limit=32"),
        *("--num-rollout", "2", "--save-interval", "1", "--rollout-shuffle"),
        *("--eval-prompt-data", "held", "verifiers:vf_addition?skip=32&limit=8"),
        *("--eval-interval", "1"),
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = cli(*args, "--save", straight, "--load", straight, env=env)
    assert first.returncode == 0, first.stderr
    part = cli(
        *args, "--save", resumed, "--load", resumed, "--debug-exit-after-rollout", "1", env=env
    )
    assert part.returncode == 0 and "stopped after rollout 0" in part.stdout + part.stderr
    rest = cli(*args, "--save", resumed, "--load", resumed, env=env)
    assert rest.returncode == 0, rest.stderr

    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    # the held-out set is scored by its tasks' rubric: "eval/held" is its mean reward
    evals = {r["rollout_id"]: r["eval/held"] for r in records if "eval/held" in r}
    assert len(evals) >= 2 and all(0 <= v <= 1.5 for v in evals.values()), records
    records = [r for r in records if r.get("rollout_id", 0) >= 0]
    # the rubric's weighted sum: 1.5 correct and short, 0.5 short, 0 otherwise; the built-in
    # model gets some sums right, so the rewards vary within groups and both rollouts train
    assert all(0 < r["reward_mean"] < 1.5 for r in records), records
    assert all(r["grad_norm"] > 0 for r in records), records
    a, b = list_checkpoints(straight), list_checkpoints(resumed)
    assert [r["name"] for r in a] == [r["name"] for r in b] == ["iter_0000000", "iter_0000001"]
    assert a[0]["model_digest"] != a[1]["model_digest"]
    for x, y in zip(a, b, strict=True):
        assert (x["model_digest"], x["optimizer_digest"]) == (
            y["model_digest"],
            y["optimizer_digest"],
        )
    resumed_records = [
        json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()
    ]
    assert {r["rollout_id"]: r["eval/held"] for r in resumed_records if "eval/held" in r} == evals
    resumed_records = [r for r in resumed_records if r.get("rollout_id", 0) >= 0]
    assert [r["prompt_indices"] for r in resumed_records] == [r["prompt_indices"] for r in records]
    assert [r["reward_mean"] for r in resumed_records] == [r["reward_mean"] for r in records]

    bad = cli("train", "--prompt-data", "verifiers:vf_no_such_env", "--save", tmp_path / "x")
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "unknown verifiers environment" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "x").exists()
    tools = "tests/multiturn_tools.py:tool"
    multi = cli(
        *(*args, "--generate-execute-tool-function-path", tools, "--save", tmp_path / "y"),
        env=env,
    )
    assert multi.returncode == 2 and multi.stderr.strip().count("\n") == 0, multi.stderr
    assert "rubric scores one-turn answers" in multi.stderr and not (tmp_path / "y").exists()


def test_a_task_whose_judge_is_a_model_is_scored_through_it_and_journaled(
    packages, tmp_path, monkeypatch
):
    judge = StandIn(tmp_path, "verdict")  # verifiers' reference judge: yes when it matches
    monkeypatch.setenv("MILEAGE_TEST_JUDGE_KEY", "unused")
    plugged = {"id": "reference", "base_url": judge.url, "model": "stand-in-judge"}
    plugged["api_key_var"] = "MILEAGE_TEST_JUDGE_KEY"
    spec = f"verifiers:vf_addition?limit=3&task={json.dumps({'judges': [plugged]})}"
    try:
        cfg = DataConfig(prompt_data=spec)
        first = load_train_prompts(cfg)[0]  # 03+05=8 -> "8"
        reward = task_reward(cfg)
        assert reward.journaled  # its rewards are recorded with the rollout (rewards.journaled)
        # correct (1) + short (0.5) + the judge's verdict (weight 1)
        assert reward.score_batch([(first.text, "8", first.label)] * 3) == [2.5] * 3
        assert reward(first.text, "9", first.label) == 0.5
        assert not task_reward(DataConfig(prompt_data="verifiers:vf_addition?limit=3")).journaled
    finally:
        judge.stop()
    # the judge gone: retried, then one line naming the task
    with pytest.raises(UserError) as caught:
        reward(first.text, "8", first.label)
    message = str(caught.value)
    assert message.startswith("the verifiers rubric of task 0 (AddTask) failed: ")
    assert message.endswith("(attempt 3 of 3: its judges)") and "\n" not in message

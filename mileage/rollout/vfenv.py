"""verifiers (prime-rl's environment library, 0.4.0) tasksets as prompt data, scored by each
task's own rubric.

A taskset is named where a prompt file would be:
`--prompt-data 'verifiers:TASKSET_ID?limit=N&skip=M&KEY=VALUE'`. TASKSET_ID is what verifiers
calls the environment id of a single-agent run (`vf-eval TASKSET_ID`): an installed package
exporting one `vf.Taskset` subclass (a hub id `owner/name@version` imports as `name`, as verifiers
does it). `skip` and `limit` are verifiers' own select views (the first `skip` tasks are left out,
then `limit` are taken: all of a finite taskset by default); every other key is a field of the
taskset's config (values are read as JSON when they parse, else as strings) and is validated by
the config's own pydantic model.

What mileage runs of it: each task's prompt is answered by the policy in one turn (with
--apply-chat-template its messages, the system prompt first, go through the chat template; else
the system prompt is folded in front of the user prompt, as verifiers folds it for harnesses
without a separate system prompt), and the task's `@vf.reward` functions (and config-plugged rewards) score a
`vf.Trace` holding that conversation; the reward is the trace's weighted sum, as in verifiers.
That is verifiers' `null` harness on a task without tools. What does not fit, and is refused at
start with the reason: a taskset that bundles its own `Env` or harness, tasks with tool servers
(`toolsets`), container tasks, and tasks with `setup`/`finalize` hooks or rewards that need a
sandbox runtime. docs/verifiers.md says why (verifiers 0.4.0 drives turns from a harness program
in a sandbox, over HTTP, not from hooks a trainer can call).

Judges plugged into the task config (`?task={"judges": [{"id": "reference", "base_url": ...}]}`,
verifiers' `reference`, `rubric` and `decision` judges or an installed one) score over the network
with verifiers' own client, after the task's rewards, at most MAX_CONCURRENT_SCORES tasks at once,
each within the task's scoring timeout; a failing judge call (verifiers raises rather than score
the model 0) is retried JUDGE_ATTEMPTS times in all, then stops the run in one line.

Exact resume: a task's state is its data (`idx` and fields, hashed into the task key the prompt's
label carries) plus the sample's response; without judges the reward is recomputed from them, so
a resumed run scores the same trajectories the same way. With judges the scorer is `journaled`:
its rewards are recorded with the rollout and read back by a rerun (`rewards.journaled`), so a
judge that would now answer otherwise does not change the resumed run.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from mileage.errors import UserError

PREFIX = "verifiers:"
INSTALL = "pip install 'mileage[verifiers]'"
# verifiers' own select views; every other key goes to the taskset's config
VIEW_KEYS = ("limit", "skip")
MAX_CONCURRENT_SCORES = 32  # tasks scored at once (each may call its judges)
JUDGE_ATTEMPTS = 3  # tries of a task with judges whose scoring failed


def is_verifiers_spec(text: str | None) -> bool:
    return bool(text) and text.startswith(PREFIX)


@dataclass(frozen=True)
class VerifiersSpec:
    taskset: str
    limit: int | None = None
    skip: int = 0
    options: tuple[tuple[str, str], ...] = ()  # (key, JSON text): hashable, order-free

    def config_data(self) -> dict[str, Any]:
        return {"id": self.taskset, **{k: json.loads(v) for k, v in self.options}}

    @property
    def name(self) -> str:
        """The metric name of an evaluation set of it: the package name, without owner/version."""
        return self.taskset.rsplit("/", 1)[-1].split("@", 1)[0]

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in (("skip", self.skip), ("limit", self.limit)) if v]
        parts += [f"{k}={v}" for k, v in self.options]
        return PREFIX + self.taskset + ("?" + "&".join(parts) if parts else "")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_verifiers_spec(text: str, flag: str = "--prompt-data") -> VerifiersSpec:
    """`verifiers:ID?limit=N&skip=M&key=value` -> VerifiersSpec; a malformed part is a UserError."""
    body = text[len(PREFIX) :]
    taskset, _, query = body.partition("?")
    if not taskset.strip():
        raise UserError(f"{flag} {text!r}: name a verifiers environment, e.g. verifiers:gsm8k")
    fields: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, sep, raw = part.partition("=")
        if not sep or not key:
            raise UserError(f"{flag} {text!r}: {part!r} is not KEY=VALUE")
        if key == "id":
            raise UserError(f"{flag} {text!r}: the environment id goes before '?', not as id=")
        fields[key] = _value(raw)
    views = {key: fields.pop(key) for key in VIEW_KEYS if key in fields}
    for key, value in views.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"{flag} {text!r}: {key} must be a non-negative integer")
    if views.get("limit") == 0:
        raise UserError(f"{flag} {text!r}: limit must be positive")
    options = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in fields.items()))
    return VerifiersSpec(taskset, views.get("limit"), views.get("skip", 0), options)


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise UserError(f"verifiers: prompt data needs verifiers 0.4: {INSTALL}") from None
    return vf


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _load_taskset(spec: VerifiersSpec, flag: str):
    vf = _verifiers()
    from pydantic import ValidationError
    from verifiers.v1.utils import loaders

    try:
        config_type = loaders.taskset_config_type(spec.taskset)
    except ModuleNotFoundError as exc:
        module = spec.name.replace("-", "_").lower()
        # verifiers re-raises any ModuleNotFoundError of the import as "not found"; the original
        # (its cause) names the module that is missing: the package's, or one it imports
        missing = getattr(exc.__cause__, "name", None) or exc.name
        if missing and missing.split(".")[-1] != module:
            raise UserError(
                f"{flag}: verifiers environment {spec.taskset!r} is installed but cannot be "
                f"imported: no module named {missing!r}"
            ) from None
        raise UserError(
            f"{flag}: unknown verifiers environment {spec.taskset!r}: no installed package "
            f"{module!r} (install the environment's package first)"
        ) from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise UserError(
            f"{flag}: {spec.taskset!r} is not a verifiers taskset: {_one_line(exc)}"
        ) from None
    try:
        config = config_type.model_validate(spec.config_data())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise UserError(
            f"{flag} {spec}: the taskset's config refused {where}: {first['msg']}"
        ) from None
    _refuse_what_does_not_fit(vf, loaders, spec, flag)
    try:
        return loaders.load_taskset(config)
    except Exception as exc:  # noqa: BLE001 - any failure here is the taskset's own code
        raise UserError(f"{flag} {spec}: the taskset failed to load: {_one_line(exc)}") from None


def _refuse_what_does_not_fit(vf, loaders, spec: VerifiersSpec, flag: str) -> None:
    """Tasksets whose rollouts need verifiers' harness programs, sandboxes or tool servers."""
    why = "mileage answers each task in one turn of its own engine (docs/verifiers.md)"
    env_class = loaders.environment_class(spec.taskset)
    if env_class is not vf.SingleAgentEnv:
        raise UserError(
            f"{flag}: {spec.taskset!r} bundles its own environment {env_class.__name__} (agents "
            f"driven through verifiers' harness programs); {why}"
        )
    harness = loaders.default_harness_id(spec.taskset)
    if harness != "bash":  # "bash" is verifiers' fallback when the taskset ships no harness
        raise UserError(
            f"{flag}: {spec.taskset!r} ships its own harness {harness!r}, which drives the turns "
            f"from a program in a sandbox; {why}"
        )


def _check_task(vf, task, flag: str, spec: VerifiersSpec) -> None:
    """Refuse a task that mileage could not play or score the way verifiers would."""
    task_cls = type(task)
    name = task_cls.__name__
    if task_cls.NEEDS_CONTAINER:
        raise UserError(f"{flag} {spec}: task {name} runs in a container; not supported")
    if task_cls.toolsets(task.config):
        raise UserError(
            f"{flag} {spec}: task {name} offers tools through MCP tool servers (toolsets), "
            "which only verifiers' harness programs call; write a --custom-generate-function-path "
            "or use --generate-execute-tool-function-path (docs/verifiers.md)"
        )
    for hook in ("setup", "finalize", "stage_verifier"):
        if getattr(task_cls, hook) is not getattr(vf.Task, hook):
            raise UserError(
                f"{flag} {spec}: task {name} overrides {hook}(), which prepares a sandbox "
                "runtime; mileage scores without one"
            )
    offline = [fn for fn in task.hooks("reward") if "runtime" not in _required_params(fn)]
    if not offline:
        raise UserError(
            f"{flag} {spec}: task {name} has no reward that scores without a sandbox runtime "
            "(every @vf.reward asks for `runtime`)"
        )


def _required_params(fn) -> set[str]:
    import inspect

    return {
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is inspect.Parameter.empty
    }


def _checked_messages(task) -> list:
    """The task's prompt as verifiers messages, its system prompt first (as a harness that emits
    it separately sends them); text content only."""
    vf = _verifiers()
    data = task.data
    if data.prompt is None:
        raise UserError(f"task {data.idx} has no prompt (the user opens the conversation)")
    if isinstance(data.prompt, str):
        messages = [vf.UserMessage(content=data.prompt)]
    else:
        messages = list(data.prompt)
    if data.system_prompt:
        messages.insert(0, vf.SystemMessage(content=data.system_prompt))
    if any(m.content is not None and not isinstance(m.content, str) for m in messages):
        raise UserError(f"task {data.idx}: its prompt has image or multi-part content")
    if not messages or messages[-1].role != "user":
        raise UserError(f"task {data.idx}: its prompt does not end with a user message")
    return messages


def prompt_text(task) -> str:
    """The task's prompt as one text, the system prompt folded in front as verifiers folds it
    for a harness without a separate system prompt (`Harness.resolve_prompt`)."""
    messages = _checked_messages(task)
    roles = [m.role for m in messages]
    if set(roles[:-1]) - {"system"}:
        raise UserError(
            f"task {task.data.idx}: its prompt is a conversation ({', '.join(roles)}); without "
            "--apply-chat-template only [system,] user text prompts are taken"
        )
    return "\n\n".join(m.content for m in messages if m.content)


def prompt_messages(task) -> list[dict[str, Any]]:
    """The task's prompt as chat messages (OpenAI wire dicts) for the chat template."""
    from verifiers.v1.dialects.chat import message_to_wire

    return [message_to_wire(m) for m in _checked_messages(task)]


@lru_cache(maxsize=8)
def load_tasks(spec: VerifiersSpec, flag: str = "--prompt-data") -> tuple[Any, ...]:
    """The tasks of `spec` in the taskset's order (cached: train, eval and scorer share them)."""
    vf = _verifiers()
    taskset = _load_taskset(spec, flag)
    if type(taskset).toolsets(taskset.config):
        raise UserError(
            f"{flag} {spec}: the taskset shares MCP tool servers (Taskset.toolsets), which only "
            "verifiers' harness programs call; see docs/verifiers.md"
        )
    if spec.limit is None and not taskset.bounded:
        raise UserError(f"{flag} {spec}: the taskset is infinite; give limit=N")
    view = taskset.skip(spec.skip) if spec.skip else taskset
    if spec.limit is not None:
        view = view.take(spec.limit)
    try:
        tasks = tuple(view)
    except Exception as exc:  # noqa: BLE001 - the taskset's own load() failed
        raise UserError(f"{flag} {spec}: the taskset failed to load: {_one_line(exc)}") from None
    if not tasks:
        raise UserError(f"{flag} {spec}: no tasks (skip={spec.skip} passes them all)")
    seen: set[str] = set()
    checked: set[tuple[type, int]] = set()
    for task in tasks:
        if task.data.image:
            raise UserError(f"{flag} {spec}: task {task.data.idx} runs in a container image")
        # what is checked depends on the task's class and config, which tasks usually share
        kind = (type(task), id(task.config))
        if kind not in checked:
            _check_task(vf, task, flag, spec)
            checked.add(kind)
        if task.key in seen:
            raise UserError(
                f"{flag} {spec}: two tasks share the key {task.key[:12]}...; verifiers requires "
                "task keys unique within a taskset"
            )
        seen.add(task.key)
    return tasks


class VerifiersScorer:
    """Reward `fn(prompt, response, label)` whose label is a task's key: the task's own rubric
    scores a one-turn `vf.Trace` of the prompt and the response."""

    def __init__(self) -> None:
        self._tasks: dict[str, Any] = {}
        self.journaled = False  # True once a task plugs judges (a model over the network)

    def add(self, tasks: tuple[Any, ...]) -> None:
        for task in tasks:
            self._tasks[task.key] = task
            self.journaled = self.journaled or bool(task.config.judges)

    def __call__(self, prompt: str, response: str, label: str) -> float:
        return self.score_batch([(prompt, response, label)])[0]

    def score_batch(self, items: list[tuple[str, str, str]]) -> list[float]:
        """All of a rollout's samples concurrently (verifiers' rewards are coroutines)."""

        async def gather() -> list[float]:
            bound = asyncio.Semaphore(MAX_CONCURRENT_SCORES)

            async def one(item: tuple[str, str, str]) -> float:
                async with bound:
                    return await self._score(*item)

            return await asyncio.gather(*(one(item) for item in items))

        return asyncio.run(gather())

    async def _score(self, prompt: str, response: str, label: str) -> float:
        task = self._tasks.get(label)
        if task is None:
            raise UserError(
                "the verifiers scorer can only grade prompts of its verifiers: environment; set "
                "--rm-type to grade other prompt data"
            )
        attempts = JUDGE_ATTEMPTS if task.config.judges else 1
        limit = task.data.timeout.scoring  # the task's own scoring deadline (None: no limit)
        for attempt in range(1, attempts + 1):
            trace = one_turn_trace(task, response)
            try:
                async with asyncio.timeout(limit):
                    await task.score(trace)
                return float(trace.reward)
            except TimeoutError:
                failure = f"ran past its scoring timeout of {limit:g} s"
            except Exception as exc:  # noqa: BLE001 - the rubric is the environment's code
                failure = f"failed: {_one_line(exc)}"
            if attempt < attempts:
                await asyncio.sleep(0.2 * 2 ** (attempt - 1))
        tries = f" (attempt {attempts} of {attempts}: its judges)" if attempts > 1 else ""
        raise UserError(
            f"the verifiers rubric of task {task.data.idx} ({type(task).__name__}) {failure}{tries}"
        )


def check_one_turn(reward_fn: object, generates_turns: bool) -> None:
    """A verifiers rubric scores a one-turn answer (`trace.last_reply`): a multi-turn generate
    function's response (model turns and tool outputs decoded as one text) would be scored as
    one reply, so the combination is refused rather than scored wrongly."""
    if generates_turns and isinstance(reward_fn, VerifiersScorer):
        raise UserError(
            "a verifiers task's rubric scores one-turn answers; with --custom-generate-function-"
            "path or --generate-execute-tool-function-path give the reward with --custom-rm-path "
            "(docs/verifiers.md)"
        )


def one_turn_trace(task, response: str):
    """A finished `vf.Trace` of `task`: its prompt messages, then `response` as the model's turn."""
    vf = _verifiers()
    from verifiers.v1.graph import MessageNode

    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
    )
    messages = [*_checked_messages(task), vf.AssistantMessage(content=response)]
    for i, message in enumerate(messages):
        trace.nodes.append(
            MessageNode(
                parent=i - 1 if i else None,
                message=message,
                sampled=i == len(messages) - 1,
            )
        )
    trace.ok = True
    trace.stop("agent_completed")
    return trace

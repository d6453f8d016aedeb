"""Evaluation as miles runs it: named datasets, several samples per prompt, pass@k.

Each `--eval-prompt-data NAME PATH` dataset is evaluated with `--n-samples-per-eval-prompt`
answers per prompt and logged as

    eval/NAME                  mean reward (miles' key)
    eval/NAME/pass@k           unbiased pass@k (Chen et al. 2021), k = 1, 2, 4, ... and n
    eval/NAME/truncated_ratio  answers cut off by --eval-max-response-len
    eval/NAME/response_len     mean answer length in tokens
    eval/NAME/tool_use_rate    share of answers that called a tool (multi-turn runs only)

and, with exactly one dataset, `eval_reward`: its mean reward, also written as `eval_accuracy`
(the key `mileage plot`, the recipes and older tools read; despite its name, the mean reward).
An answer is solved when its reward is >= 1: pass@1 is the share of answers solved, and the one
to read when rewards are not 0/1 (a rubric's weights can make the mean reward 1.0 while half
the answers are wrong). The progress line and `summary` say "reward" and "solved" for them.

Sampled evaluation at rollout N of dataset NAME draws from `SamplingSeed(seed, N,
"eval/NAME")`: a pure function of the run's seed, the rollout and the dataset, so a resumed run
evaluates exactly as the uninterrupted one did, and never the numbers training samples with.

A run with a generate function or the tool loop evaluates through it too: an answer may call the
tools like a training sample (its reward is then scored on the whole trajectory). Evaluation
trains nothing and is not resumed halfway, so its tool calls are not journaled.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mileage.config import option
from mileage.errors import UserError
from mileage.rollout.data import EvalSet
from mileage.rollout.engines.base import Engine, SamplingParams, SamplingSeed
from mileage.rollout.journal import ToolJournal
from mileage.rollout.rewards import RewardFn, score_all
from mileage.rollout.rollout import PromptEncoder, RolloutConfig, Sample
from mileage.rollout.sizes import check_eval_memory, context_length, length_problem, prompt_over
from mileage.seeding import derive_seed

if TYPE_CHECKING:
    from mileage.rollout.agent import Agent

# an answer with at least this reward counts as solved (as for the rollouts' `accuracy`)
CORRECT = 1.0


@dataclass
class EvalConfig:
    n_samples_per_eval_prompt: int = option(1, "answers sampled per evaluation prompt")
    eval_temperature: float | None = option(
        None,
        "evaluation sampling temperature (default: greedy with one answer per prompt, "
        "--rollout-temperature with more)",
    )
    eval_top_p: float | None = option(None, "evaluation nucleus mass (default: --rollout-top-p)")
    eval_max_response_len: int | None = option(
        None, "max new tokens per evaluation answer (default: --rollout-max-response-len)"
    )
    log_passrate: bool = option(
        False, "log pass@k of each training rollout's groups as passrate/pass@k"
    )

    def sampling(self, rollout: RolloutConfig) -> SamplingParams:
        """The evaluation's sampling parameters; unset ones are the rollout's (as in miles)."""
        temperature = self.eval_temperature
        if temperature is None:
            # one greedy answer is the exact held-out accuracy mileage has always measured;
            # several answers per prompt only make sense sampled
            temperature = (
                0.0 if self.n_samples_per_eval_prompt == 1 else rollout.rollout_temperature
            )
        return SamplingParams(
            max_new_tokens=self.eval_max_response_len or rollout.rollout_max_response_len,
            temperature=temperature,
            top_p=self.eval_top_p if self.eval_top_p is not None else rollout.rollout_top_p,
        )


def check_eval_lengths(
    config: dict,
    encode: PromptEncoder,
    eval_sets: list[EvalSet],
    cfg: EvalConfig,
    rollout: RolloutConfig,
) -> None:
    """Refuse, before the run, an evaluation prompt that cannot fit the model's context with
    the evaluation's response length after it (named by the flag it comes from)."""
    max_new_tokens = cfg.sampling(rollout).max_new_tokens
    flag = "--eval-max-response-len" if cfg.eval_max_response_len else "--rollout-max-response-len"
    problem = length_problem(config, 0, max_new_tokens, flag)
    if problem:
        raise UserError(problem)
    if eval_sets:
        largest = max(len(s.prompts) for s in eval_sets)
        check_eval_memory(largest, cfg.n_samples_per_eval_prompt, max_new_tokens)
    context = context_length(config)
    if context is None:
        return
    for eval_set in eval_sets:
        texts = [p.text for p in eval_set.prompts]
        over = prompt_over(texts, encode, context - max_new_tokens)
        if over:
            index, count = over
            where = f"evaluation prompt {index}"
            if len(eval_sets) > 1:
                where += f" (dataset {eval_set.name})"
            raise UserError(length_problem(config, count, max_new_tokens, flag, where))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from `c` correct of `n` answers: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct answer
    # exact integers, one rounding in the division
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


def pass_rates(rewards: list[float], group_size: int) -> dict[str, float]:
    """pass@k averaged over groups of `group_size` consecutive answers to one prompt."""
    if not rewards or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    correct = [
        sum(r >= CORRECT for r in rewards[i : i + group_size])
        for i in range(0, len(rewards), group_size)
    ]
    return {
        f"pass@{k}": sum(pass_at_k(group_size, c, k) for c in correct) / len(correct)
        for k in pass_ks(group_size)
    }


def eval_seed(seed: int, rollout_id: int, name: str) -> SamplingSeed:
    """Where dataset `name`'s evaluation at `rollout_id` draws from (never training's numbers)."""
    return SamplingSeed(seed, rollout_id, f"eval/{name}")


def sample_answers(
    engine: Engine,
    encode: PromptEncoder,
    eval_set: EvalSet,
    params: SamplingParams,
    n_samples: int,
    reward_fn: RewardFn,
    seed: SamplingSeed | None,
    score: Callable[[list[Sample], int], None] | None = None,
    agent: Agent | None = None,
) -> list[Sample]:
    """`n_samples` scored answers per prompt of `eval_set`, those of one prompt contiguous;
    `score(samples, n)` sets their rewards when given (a reward of the whole sample, --group-rm),
    else `reward_fn(prompt, response, label)`."""
    if agent is not None and agent.multi_turn:
        return multi_turn_answers(agent, engine, eval_set, params, n_samples, seed)
    expanded = [p for p in eval_set.prompts for _ in range(n_samples)]
    completions = engine.generate(
        [encode(p.text) for p in expanded], params, seed, group_size=n_samples
    )
    decode = encode.tokenizer.decode
    texts = [decode(c.response_ids, skip_special_tokens=True) for c in completions]
    samples = [
        Sample(p, c.prompt_ids, c.response_ids, c.logprobs, t, 0.0, c.finished, c.weight_version)
        for p, c, t in zip(expanded, completions, texts, strict=True)
    ]
    if score is not None:
        score(samples, n_samples)
        return samples
    rewards = score_all(reward_fn, [(s.prompt.text, s.response, s.prompt.label) for s in samples])
    for sample, reward in zip(samples, rewards, strict=True):
        sample.reward = reward
    return samples


def multi_turn_answers(
    agent: Agent,
    engine: Engine,
    eval_set: EvalSet,
    params: SamplingParams,
    n_samples: int,
    seed: SamplingSeed | None,
) -> list[Sample]:
    """The answers of the run's generate function or tool loop, scored by the run's reward."""
    evaluator = copy.copy(agent)
    evaluator.journal = ToolJournal(None)  # in memory: never mixed with training's slots
    # the agent keys each sample's seed on (seed, rollout id, position, index): an evaluation
    # seed derived from the dataset's keeps it off the numbers training draws
    run_seed = 0 if seed is None else derive_seed(seed.seed, seed.purpose, seed.rollout_id)
    rollout_id = 0 if seed is None else seed.rollout_id
    return evaluator.generate(
        engine, eval_set.prompts, params, n_samples, run_seed, rollout_id, lambda: []
    )


def tool_use_rate(samples: list[Sample]) -> float:
    """The share of samples that called a tool at least once."""
    return sum(s.used_tools() for s in samples) / len(samples)


def evaluate(
    engine: Engine,
    encode: PromptEncoder,
    eval_sets: list[EvalSet],
    cfg: EvalConfig,
    rollout: RolloutConfig,
    reward_fn: RewardFn,
    seed: int,
    rollout_id: int,
    score: Callable[[list[Sample], int], None] | None = None,
    agent: Agent | None = None,
) -> dict[str, float]:
    """The evaluation metrics of the current weights, as record keys (see the module doc)."""
    params = cfg.sampling(rollout)
    n = cfg.n_samples_per_eval_prompt
    metrics: dict[str, float] = {}
    for eval_set in eval_sets:
        # greedy decoding draws nothing: no seed, so a remote engine may batch it freely
        sampling_seed = None if params.greedy else eval_seed(seed, rollout_id, eval_set.name)
        samples = sample_answers(
            engine, encode, eval_set, params, n, reward_fn, sampling_seed, score, agent
        )
        rewards = [s.reward for s in samples]
        key = f"eval/{eval_set.name}"
        metrics[key] = sum(rewards) / len(rewards)
        metrics |= {f"{key}/{name}": v for name, v in pass_rates(rewards, n).items()}
        metrics[f"{key}/truncated_ratio"] = sum(not s.finished for s in samples) / len(samples)
        metrics[f"{key}/response_len"] = sum(len(s.response_ids) for s in samples) / len(samples)
        if agent is not None and agent.multi_turn:
            metrics[f"{key}/tool_use_rate"] = tool_use_rate(samples)
    if len(eval_sets) == 1:
        metrics["eval_reward"] = metrics[f"eval/{eval_sets[0].name}"]
        metrics["eval_accuracy"] = metrics["eval_reward"]  # its older name (module doc)
    return metrics


def rollout_passrate(samples: list[Sample], group_size: int) -> dict[str, float]:
    """`--log-passrate`: pass@k of a training rollout's groups, as miles' passrate/pass@k."""
    rates = pass_rates([s.reward for s in samples], group_size)
    return {f"passrate/{name}": value for name, value in rates.items()}


def summary(metrics: dict[str, float]) -> str:
    """One line of each dataset's mean reward, share solved (pass@1) and pass@n when n > 1;
    a dataset is named when there are several."""
    datasets = [k for k in metrics if k.startswith("eval/") and k.count("/") == 1]
    parts = []
    for key in datasets:
        text = f"reward {metrics[key]:.3f} solved {metrics[f'{key}/pass@1']:.3f}"
        passes = [k for k in metrics if k.startswith(f"{key}/pass@")]
        if len(passes) > 1:
            text += f" (pass@{passes[-1].rsplit('@', 1)[1]} {metrics[passes[-1]]:.3f})"
        parts.append(text if len(datasets) == 1 else f"{key[5:]} {text}")
    return "; ".join(parts)

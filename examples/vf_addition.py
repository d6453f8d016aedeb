"""A verifiers 0.4 taskset that mileage can train on offline: two-digit addition in the built-in
model's format (`07+45=` -> `25`, the sum written least-significant digit first).

It is a module named `vf_addition` exporting one `vf.Taskset` subclass, as an environment
package installed with `prime env install` would be; putting `examples/` on `PYTHONPATH` stands in
for installing it. From the checkout, with the `verifiers` extra installed
(`.venv/bin/pip install -e '.[verifiers]'`):

    PYTHONPATH=examples .venv/bin/mileage train --prompt-data 'verifiers:vf_addition?limit=2000' \\
        --eval-prompt-data held 'verifiers:vf_addition?skip=2000&limit=200' --eval-interval 10 \\
        --num-rollout 40 --lr 1e-4 --save runs/vf --load runs/vf

The built-in model is the policy (no `--hf-checkpoint`); the reward is this taskset's rubric:
`correct` (1 for the exact reversed sum) plus `short` at weight 0.1 (the answer is at most three
characters), summed by verifiers' weights. `length` is a metric: computed, not rewarded. The sums
are a fixed function of the task index, so the taskset is finite (`size` tasks) and every run
sees the same ones; nothing is downloaded.
"""

from __future__ import annotations

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: str = ""


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.1)
    async def short(self, trace) -> float:
        return float(len(trace.last_reply.strip()) <= 3)

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class AdditionConfig(vf.TasksetConfig):
    size: int = 10_000  # tasks (at most 10000 different pairs); `?size=N` in the spec sets it


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self):
        for i in range(self.config.size):
            # a fixed walk over the 100 x 100 pairs (7919 is prime to 10000): tasks 0-9999 are
            # all different sums, so a `skip` past the training tasks is a true held-out set
            a, b = divmod((7919 * i + 11) % 10_000, 100)
            data = AdditionData(prompt=f"{a:02d}+{b:02d}=", answer=str(a + b)[::-1])
            yield AdditionTask(data, self.config.task)


__all__ = ["AdditionTaskset"]

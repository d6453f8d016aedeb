"""A user's whole rollout for `--rollout-function-path tests/user_rollout.py:rollout` (loaded by
path, as users do): its own filter. It keeps the groups whose rewards differ, draws further
prompts from the data source for the groups it dropped (at most three draws), and fills what is
still missing with the dropped groups, in the order drawn. So the data position it leaves behind
depends on what the policy sampled, and a resumed run is exact only if that position is saved.
"""

from __future__ import annotations

from mileage.rollout.sample import Sample


def rollout(ctx, rollout_id: int, data_source, evaluation: bool = False) -> list[Sample]:
    n = ctx.config.rollout.n_samples_per_prompt
    want = ctx.config.rollout.rollout_batch_size
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    for _ in range(3):
        samples = ctx.generate(data_source.next_batch(want - len(kept)))
        for start in range(0, len(samples), n):
            group = samples[start : start + n]
            (kept if len({s.reward for s in group}) > 1 else dropped).append(group)
        if len(kept) >= want:
            break
    groups = (kept + dropped)[:want]
    return [s for group in groups for s in group]

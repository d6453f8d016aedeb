"""PPO: which checkpoint's critic/ a run loads, the critic's part of `plan_start`'s decision.

Called only by `plan.plan_start`, whose table holds the rows (tests/test_ppo_plan.py): a resume
takes the critic committed with the actor (same rollout, same model), a fresh start or
--finetune takes --critic-load, else a --finetune checkpoint's own critic, else none (the
actor's weights and a fresh value head).
"""

from __future__ import annotations

import os

from mileage.checkpoint.layout import CRITIC_DIR, TRACKER, DirState, config_differences
from mileage.checkpoint.sources import Source, native_source
from mileage.errors import UserError


def plan_critic(
    critic_load: DirState | None,
    model_config: dict | None,
    source: Source,
    resumable: bool,
    reasons: list[str],
) -> str | None:
    """PPO: the checkpoint whose critic/ the run loads (None: a fresh critic). A resume pairs
    the actor with the critic of the same checkpoint, which was committed with it.
    `critic_load`: the --critic-load directory's state (None when the flag is unset)."""
    critic_meta = source.info.critic_meta if source.info is not None else None
    if resumable:
        if critic_meta is None:
            raise UserError(
                f"{source.path} holds no critic (it was saved without --advantage-estimator ppo), "
                f"so PPO cannot resume from it; pass --finetune to start a fresh critic from its "
                f"weights, or another --load"
            )
        check_critic(critic_meta, source.path, model_config, source.iteration)
        if critic_load is not None:
            reasons.append(f"--critic-load ignored: a resume takes the critic of {source.path}")
        return source.path
    if critic_load is not None:
        state = critic_load
        if not state.exists:
            raise UserError(f"--critic-load {state.path} does not exist")
        if not state.tracker.exists:
            raise UserError(
                f"--critic-load {state.path} has no {TRACKER}: give the --save directory of a "
                f"PPO run"
            )
        critic = native_source(state, None, "--critic-load")
        if critic.info.critic_meta is None:
            raise UserError(
                f"--critic-load: {critic.path} holds no critic/ (give the --save directory of a "
                f"PPO run)"
            )
        check_critic(critic.info.critic_meta, critic.path, model_config, None)
        reasons.append(f"critic weights from --critic-load: {critic.reason}")
        return critic.path
    if critic_meta is not None:  # --finetune from a PPO checkpoint keeps its critic's weights
        check_critic(critic_meta, source.path, model_config, None)
        return source.path
    return None


def check_critic(meta: dict, path: str, model_config: dict | None, rollout: int | None) -> None:
    where = os.path.join(path, CRITIC_DIR)
    if rollout is not None and meta.get("rollout_id") != rollout:
        raise UserError(
            f"{where} was saved at rollout {meta.get('rollout_id')} but the actor at {rollout}: "
            f"actor and critic are not one commit; refusing to pair them"
        )
    if model_config is not None and "model_config" in meta:
        diffs = config_differences(meta["model_config"], model_config)
        if diffs:
            raise UserError(
                f"{where} is a critic of a different model than --hf-checkpoint "
                f"({'; '.join(diffs)})"
            )

"""`python -m mileage.testing.resave TRAIN_FLAGS`: load the checkpoint that `mileage train`
would resume from (--load), exactly as it resumes it, and save it again into --save at this
process's world size (also under torchrun) without training.

The saved tensors must equal the loaded ones bit for bit, whatever the two world sizes: the
distributed tests compare `ckpt ls` digests and tensors of the original and the re-saved copy.
"""

from __future__ import annotations

import sys

from mileage.checkpoint.plan import RESUME
from mileage.cli.main import build_parser
from mileage.components import build_run, checkpoint_state, restore
from mileage.distributed import env
from mileage.errors import UserError
from mileage.preflight import preflight
from mileage.run_config import RunConfig


def resave(cfg: RunConfig) -> int:
    with env.session():
        pre = preflight(cfg)
        if pre.plan.action != RESUME or not cfg.checkpoint.save:
            raise UserError("resave needs --load with a checkpoint to resume and a new --save")
        say = print if env.is_main() else (lambda text: None)
        run = build_run(cfg, pre, say)
        restore(run, say)
        rollout_id = pre.plan.start_rollout_id - 1
        run.writer.save(rollout_id, checkpoint_state(run, rollout_id))
        run.writer.wait()
        say(f"re-saved rollout {rollout_id} at world size {env.world_size()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
        return resave(RunConfig.from_args(args))
    except UserError as exc:
        print(f"mileage: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())

"""Train briefly and check where the parameters, the batch and the optimizer state lived.

    python scripts/gpu_devices.py --expect cuda -- <mileage train flags>
    torchrun --nproc-per-node 2 scripts/gpu_devices.py --expect cuda -- <flags>

Runs `mileage train` in this process (every rank under torchrun), records the device of every
batch the actor trains on, and after the run checks every parameter and optimizer-state tensor
of the policy (and of the reference and critic, when there are). It exits 1 with one line per
rank when anything was not on the expected device type, so `scripts/gpu_check.sh` fails when a
"GPU" run actually trained on the CPU. `--expect cpu` is what the CPU tests run, so the script
itself is tested on machines without a GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch


def local_device(tensor: torch.Tensor) -> torch.device:
    """The device of a tensor, or of this rank's shard of a DTensor."""
    return tensor.to_local().device if hasattr(tensor, "to_local") else tensor.device


def tensors_of(run) -> dict[str, list[torch.Tensor]]:
    """What must live on the device, by kind."""
    found = {"parameters": list(run.model.parameters()), "optimizer state": []}
    optimizers = [run.actor.optimizer]
    if run.actor.reference is not None:
        found["reference parameters"] = list(run.actor.reference.parameters())
    if run.actor.critic is not None:
        found["critic parameters"] = list(run.actor.critic.model.parameters())
        optimizers.append(run.actor.critic.optimizer)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            # AdamW keeps its `step` counter on the CPU unless capturable; the moments matter
            found["optimizer state"] += [
                v for k, v in state.items() if torch.is_tensor(v) and k != "step"
            ]
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", choices=("cuda", "cpu"), required=True)
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    train_args = [a for a in args.train_args if a != "--"]

    import mileage.cli.train as train_cli
    from mileage.cli.main import build_parser
    from mileage.distributed import env
    from mileage.run_config import RunConfig

    cfg = RunConfig.from_args(build_parser().parse_args(["train", *train_args]))
    runs, batches = [], []
    build_run = train_cli.build_run

    def recording_build_run(*a, **kw):
        run = build_run(*a, **kw)
        train_rollout = run.actor.train_rollout

        def recording_train_rollout(batch, *b, **kwb):
            batches.append(batch.input_ids.device)
            return train_rollout(batch, *b, **kwb)

        run.actor.train_rollout = recording_train_rollout
        runs.append(run)
        return run

    train_cli.build_run = recording_build_run
    code = train_cli.train_command(cfg)
    if code != 0:
        print(f"gpu_devices: mileage train exited {code}", file=sys.stderr)
        return code
    if not runs or not batches:
        print("gpu_devices: the run trained nothing (is it already complete?)", file=sys.stderr)
        return 1
    found = tensors_of(runs[0])
    found_devices = {kind: {local_device(t) for t in ts} for kind, ts in found.items()}
    found_devices["batch"] = set(batches)
    who = f"rank {env.rank()}"
    wrong = {
        kind: sorted(map(str, devices))
        for kind, devices in found_devices.items()
        if not devices or any(d.type != args.expect for d in devices)
    }
    if wrong:
        for kind, devices in wrong.items():
            print(
                f"gpu_devices: {who}: {kind} on {devices or 'nothing'}, expected {args.expect}",
                file=sys.stderr,
            )
        return 1
    counts = ", ".join(f"{len(found[k])} {k}" for k in found)
    places = sorted({str(d) for ds in found_devices.values() for d in ds})
    print(f"gpu_devices: {who}: {counts} and {len(batches)} batches all on {', '.join(places)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

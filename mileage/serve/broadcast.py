"""`mileage serve`'s weight transfer over a collective, SGLang's API for it:

- `POST /init_weights_update_group` (`master_address`, `master_port`, `rank_offset`,
  `world_size`, `group_name`, `backend`): join the trainer's process group, with gloo (this
  server runs on the CPU). A new trainer (a rerun after a kill) replaces the old one's group.
- `POST /update_weights_from_distributed` (`names`, `dtypes`, `shapes`, `group_name`, optional
  `weight_version`): receive the named tensors by broadcast from the trainer's rank 0 and load
  them. An update may take several calls (buckets); each loads its tensors, and the call with
  a `weight_version` ends the update: it is refused unless every tensor of the model arrived
  since the last completed update.

`--rollout-weight-sync broadcast` is the client (`mileage/rollout/engines/broadcast.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from mileage.models.tensors import model_tensors
from mileage.serve.requests import version_label


class WeightUpdateError(ValueError):
    """A request the server cannot parse (HTTP 400)."""


def _int_field(body: dict, key: str, low: int, high: int) -> int:
    value = body.get(key)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # SGLang's clients may send a port as a string
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise WeightUpdateError(f"{key}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _tensor_specs(names, dtypes, shapes) -> list[tuple[str, torch.dtype, list[int]]]:
    """What each broadcast tensor will be, checked before joining the collective (a malformed
    spec cannot be received, and a receive cannot be undone)."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise WeightUpdateError("names, dtypes and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError("names, dtypes and shapes must have one entry per tensor")
    specs = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        kind = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(name, str):
            raise WeightUpdateError(f"names[{i}]: expected a tensor name, got {name!r}")
        if not isinstance(kind, torch.dtype):
            raise WeightUpdateError(f"dtypes[{i}]: expected a torch dtype name, got {dtype!r}")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise WeightUpdateError(f"shapes[{i}]: expected a list of sizes, got {shape!r}")
        specs.append((name, kind, shape))
    return specs


class BroadcastEndpoints:
    """The weight-update groups of one `EngineServer` (`server`: its lock, model and version)."""

    def __init__(self, server: Any):
        self.server = server
        self.groups: dict = {}  # weight-update process groups by name
        self.pending: set[str] = set()  # tensors of an update whose last bucket is still to come

    def init_group(self, body: dict) -> dict:
        from mileage.rollout.engines.broadcast import join_group

        address, name = body.get("master_address"), body.get("group_name")
        if not (isinstance(address, str) and address and isinstance(name, str) and name):
            raise WeightUpdateError("master_address and group_name must be non-empty strings")
        port = _int_field(body, "master_port", 1, 65535)
        world_size = _int_field(body, "world_size", 2, 1 << 20)
        # rank 0 is the trainer's: it hosts the group's store
        rank = _int_field(body, "rank_offset", 1, world_size - 1)
        backend = str(body.get("backend", "gloo"))
        if backend != "gloo":
            return {
                "success": False,
                "message": f"mileage serve runs on the CPU: gloo, not {backend}",
            }
        try:
            group = join_group(address, port, rank, world_size, backend, name, 600.0)
        except (RuntimeError, OSError, ValueError) as exc:  # ValueError: a name already taken
            return {"success": False, "message": f"joining {name} failed: {exc}"}
        # a new trainer (a rerun after a kill) replaces the old one's group: one trainer at a time
        with self.server.lock:
            self.groups = {name: group}
            self.pending.clear()  # buckets of an update the old trainer never finished
        return {"success": True, "message": f"joined {name} as rank {rank} of {world_size}"}

    def update(self, body: dict) -> dict:
        import torch.distributed as dist

        specs = _tensor_specs(body.get("names"), body.get("dtypes"), body.get("shapes"))
        version = body.get("weight_version")
        version = None if version is None else version_label(version, "weight_version")
        group_name = body.get("group_name")
        group = self.groups.get(group_name) if isinstance(group_name, str) else None
        if group is None:
            raise WeightUpdateError(f"no weight-update group {group_name!r}")
        with self.server.lock:
            self.server.lora.drop_all()  # full weights: the plain model's names, no adapter on top
            received = {}
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=dtype)
                dist.broadcast(tensor, src=0, group=group)  # every tensor, even a bad one
                received[name] = tensor
            params = self.server.engine.model.state_dict()
            problems = [f"{name}: unknown" for name in received if name not in params]
            problems += [
                f"{name}: shape {list(value.shape)}, the model's is {list(params[name].shape)}"
                for name, value in received.items()
                if name in params and params[name].shape != value.shape
            ]
            # an update may come in several calls (buckets), as SGLang allows: each call loads
            # its tensors; the one with a weight_version ends the update, and must complete it
            done = body.get("weight_version") is not None
            if done:
                arrived = self.pending | set(received)
                missing = sorted(set(model_tensors(self.server.engine.model)) - arrived)
                problems += [f"{name}: not sent" for name in missing]
            if problems:
                self.pending.clear()  # the update failed: the next starts from scratch
                return {"success": False, "message": "; ".join(problems[:3])}
            with torch.no_grad():
                for name, value in received.items():
                    params[name].copy_(value)  # casts to the model's dtype, as SGLang loads
            self.pending |= set(received)
            if done:
                self.pending.clear()
                self.server.weight_version = version
        return {"success": True, "message": f"loaded {len(received)} tensors"}

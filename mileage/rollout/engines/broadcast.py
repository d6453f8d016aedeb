"""Weights to SGLang servers over a collective instead of through the disk.

SGLang's protocol (`--rollout-weight-sync broadcast`), the one miles and verl use on GPUs:
1. once, `POST /init_weights_update_group` to every server with the trainer's address, a free
   port, the world size (the trainer plus every server's workers, from `GET /get_server_info`'s
   `tp_size`), each server's first rank and a group name; every server joins a process group
   rendezvousing at that address while the trainer joins it as rank 0;
2. per update, `POST /update_weights_from_distributed` with the tensors' names, dtypes and
   shapes (and the weight version); each server then receives the tensors in that order from
   rank 0, while the trainer broadcasts them.
NCCL when the trainer's weights are on a GPU, gloo on the CPU: `mileage serve` implements the
server side with gloo, so the path is tested on this machine end to end; on GPUs it is the same
code with NCCL (docs/engines.md says what has been run where).

The group is separate from torchrun's default group (the trainer is always its rank 0), built
the way SGLang's and verl's helpers build theirs, so the servers' side needs nothing of ours.
A collective cannot skip a member: a server that fails mid-update stops the run (exit 2), and
rerunning the command starts over from the last checkpoint with a new group.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mileage.errors import UserError
from mileage.models.tensors import model_tensors
from mileage.rollout.engines.http import BadReply, ServerPool, describe, get_json, post_json
from mileage.rollout.engines.launch import free_port

GROUP_NAME = "mileage_weights"


def join_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout: float,
) -> dist.ProcessGroup:
    """Join the process group that rendezvouses at tcp://address:port (rank 0 hosts the store).

    Works with or without a default group (the trainer may run under torchrun, a server never
    does); registered like `new_group`'s groups, so `dist.broadcast(..., group=g)` works.
    """
    from torch.distributed import distributed_c10d as c10d

    limit = timedelta(seconds=timeout)
    store, _, _ = next(
        c10d.rendezvous(f"tcp://{address}:{port}", rank=rank, world_size=world_size, timeout=limit)
    )
    store.set_timeout(limit)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=limit
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def update_request(tensors: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
    return {
        "names": list(tensors),
        "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": GROUP_NAME,
        "flush_cache": True,
        "weight_version": str(version),
    }


def check_reply(reply: Any) -> None:
    if not isinstance(reply, dict) or not reply.get("success"):
        message = reply.get("message") if isinstance(reply, dict) else reply
        raise BadReply(f"the server refused: {message}")


class BroadcastWeights:
    """The trainer's side: rank 0 of one group with every server's workers."""

    def __init__(self, pool: ServerPool, sync_timeout: float, address: str):
        self.pool = pool
        self.timeout = sync_timeout
        self.address = address
        self.group: dist.ProcessGroup | None = None

    def _posts(self, path: str, payloads: dict[str, dict]) -> dict[str, Any]:
        """POST to every server at once (each reply comes only when the collective is done);
        returns the futures, so the trainer can take its part in the collective meanwhile."""
        pool = ThreadPoolExecutor(max_workers=len(payloads), thread_name_prefix="weights")
        futures = {
            url: pool.submit(post_json, url + path, p, self.timeout) for url, p in payloads.items()
        }
        pool.shutdown(wait=False)
        return futures

    def _results(self, futures: dict[str, Any], what: str) -> None:
        errors = []
        for url, future in futures.items():
            try:
                check_reply(future.result(timeout=self.timeout))
            except Exception as exc:  # noqa: BLE001 - every failure becomes the one line below
                errors.append(f"{url}: {describe(exc)}")
        if errors:
            raise UserError(
                f"sglang rollout: {what} failed ({'; '.join(errors)}); the last checkpoint is "
                "untouched: rerun the same command once the servers are healthy"
            )

    def connect(self, device: torch.device) -> None:
        sizes = {}
        for url in self.pool.urls:
            try:
                info = get_json(url + "/get_server_info", self.timeout)
                sizes[url] = int(info.get("tp_size", 1))
            except (OSError, BadReply, ValueError, AttributeError) as exc:
                raise UserError(f"sglang rollout: {url}/get_server_info: {describe(exc)}") from None
        world_size = 1 + sum(sizes.values())
        port = free_port()
        backend = "nccl" if device.type == "cuda" else "gloo"
        payloads, offset = {}, 1
        for url, size in sizes.items():
            payloads[url] = {
                "master_address": self.address,
                "master_port": port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": GROUP_NAME,
                "backend": backend,
            }
            offset += size
        futures = self._posts("/init_weights_update_group", payloads)
        try:
            self.group = join_group(
                self.address, port, 0, world_size, backend, GROUP_NAME, self.timeout
            )
        except (RuntimeError, OSError) as exc:
            raise UserError(
                f"sglang rollout: the weight-update group on {self.address}:{port} did not form "
                f"({exc}); check --rollout-weight-sync-address"
            ) from None
        self._results(futures, "joining the weight-update group")

    def send(self, model: torch.nn.Module, version: int) -> None:
        if self.group is None:
            self.connect(next(model.parameters()).device)
        tensors = {name: t.detach().contiguous() for name, t in model_tensors(model).items()}
        request = update_request(tensors, version)
        futures = self._posts(
            "/update_weights_from_distributed", dict.fromkeys(self.pool.urls, request)
        )
        try:
            for tensor in tensors.values():
                dist.broadcast(tensor, src=0, group=self.group)
        except (RuntimeError, OSError) as exc:
            raise UserError(
                f"sglang rollout: broadcasting the weights of version {version} failed ({exc}); "
                "the last checkpoint is untouched: rerun the same command once the servers are "
                "healthy"
            ) from None
        self._results(futures, f"loading the weights of version {version}")

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):  # the servers may be gone already
                dist.destroy_process_group(self.group)
            self.group = None

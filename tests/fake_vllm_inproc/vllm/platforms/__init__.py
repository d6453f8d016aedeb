"""The fake vLLM's platform: sleep mode available when $FAKE_VLLM_SLEEP=1 (as on a CUDA GPU)."""

from __future__ import annotations

import os


class _Platform:
    device_type = "cpu"

    def is_sleep_mode_available(self) -> bool:
        return os.environ.get("FAKE_VLLM_SLEEP") == "1"


current_platform = _Platform()

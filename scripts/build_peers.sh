#!/usr/bin/env bash
# `make peers`: the peer servers bench.llm_peer compares against, built into $PEERS_DIR (git-ignored):
#   $PEERS_DIR/build/bin/llama-server   llama.cpp's OpenAI-compatible server (CPU, native ISA)
#   $PEERS_DIR/convert-venv/bin/python  a venv for llama.cpp's HF -> GGUF converter
#   $PEERS_DIR/llama.cpp                the vendored llama.cpp tree (convert_hf_to_gguf.py, gguf-py)
# from the llama-cpp-python sdist's vendored llama.cpp (PyPI is the one source reachable here).
# Idempotent: a stamp names the version; re-running with it present only prints the paths.
#
# The converter's venv has its own transformers (< 5: with 5.x AutoConfig renormalizes the MiMo
# config and the converter fails) and numpy; torch, which it needs only to read tensors, comes from
# the project's venv through a .pth line placed after the venv's own packages, so a second torch
# (several GB) is not installed and the project's venv is left as it is.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-.peers}
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=0.3.36
STAMP="$PEERS_DIR/.built-llama-cpp-$VERSION"

if [ -f "$STAMP" ]; then
    echo "peers: llama.cpp $VERSION already built in $PEERS_DIR"
    exit 0
fi
mkdir -p "$PEERS_DIR"
PEERS_DIR=$(cd "$PEERS_DIR" && pwd)

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
command -v make >/dev/null || need_apt+=(make)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "peers: installing ${need_apt[*]} with apt"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}"
fi

SDIST_DIR="$PEERS_DIR/sdist"
mkdir -p "$SDIST_DIR"
if [ ! -f "$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz" ]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SDIST_DIR"
fi
rm -rf "$SDIST_DIR/llama_cpp_python-$VERSION" "$PEERS_DIR/llama.cpp"
tar -xzf "$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$SDIST_DIR"
mv "$SDIST_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp" "$PEERS_DIR/llama.cpp"
rm -rf "$SDIST_DIR/llama_cpp_python-$VERSION"

# Only the server, static, no network at build or run time (no curl, no prebuilt web UI download).
cmake -S "$PEERS_DIR/llama.cpp" -B "$PEERS_DIR/build" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
cmake --build "$PEERS_DIR/build" --target llama-server -j"$(nproc)"
test -x "$PEERS_DIR/build/bin/llama-server"

VENV="$PEERS_DIR/convert-venv"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "transformers==4.57.6" "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21,<5"
project_site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# appended after the venv's own site-packages: its transformers and numpy win, torch comes from ours
echo "$project_site" > "$venv_site/zz-epd-torch.pth"
"$VENV/bin/python" -c 'import torch, transformers, numpy; print("converter venv:", "torch", torch.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__)'

touch "$STAMP"
echo "peers: llama-server at $PEERS_DIR/build/bin/llama-server, converter venv at $VENV"

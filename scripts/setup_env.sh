#!/usr/bin/env bash
# Creates the virtual environment and installs epd with its test extras, then swaps pillow for
# pillow-simd (torchvision pulls pillow in; pillow-simd provides the same `PIL` module with SIMD
# resize kernels). Called by the Makefile only when pyproject.toml or this script changed.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
PIP="$VENV/bin/pip"

# WebP decoding needs libwebp's headers when pillow-simd is built from source.
if [ ! -e /usr/include/webp/decode.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing libwebp-dev for the pillow-simd build"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libwebp-dev) >/dev/null 2>&1 \
        || echo "setup: WARNING could not install libwebp-dev; WebP support depends on the pillow build"
fi

# The web page's browser test drives Debian's Chromium (no browser downloads are possible here).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing chromium for the browser test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
        || echo "setup: WARNING could not install chromium; the browser test will be skipped"
fi

# Mooncake's engine.so (the cross-node KV transport) links libibverbs even for TCP.
if [ ! -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing libibverbs1 for the Mooncake KV transport"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) >/dev/null 2>&1 \
        || echo "setup: WARNING could not install libibverbs1; the mooncake KV transport is unavailable"
fi

# The shared cache tier: `epd serve --store local` and the tests start Debian's redis-server on
# loopback (a free port; Debian's own service on 6379 is not used).
if [ ! -x /usr/bin/redis-server ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing redis-server for the shared cache tier"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1 \
        || echo "setup: WARNING could not install redis-server; --store local and its tests are unavailable"
fi

"$PIP" install -q -e '.[test]'

# torchaudio is the tests' reference for the audio features (MiMo-V2.5's processor calls its
# MelSpectrogram); epd does not use it. No torchaudio wheel matches our torch, and its pins would
# replace torch, so it comes without its dependencies: the pure-Python transforms the tests call
# run on our torch. (`/health` "paths" says epd's own log-mel runs.)
if ! "$VENV/bin/python" -c "import torchaudio" >/dev/null 2>&1; then
    "$PIP" install -q --no-deps "torchaudio==2.11.0"
fi

# pillow -> pillow-simd. AVX2 where the CPU has it; on failure keep pillow and say so. Any pip
# install above may have brought pillow back (torchvision depends on it), overwriting PIL/: then
# both are removed and pillow-simd is installed again (from pip's wheel cache after the first build).
if "$PIP" show -q pillow >/dev/null 2>&1 || ! "$PIP" show -q pillow-simd >/dev/null 2>&1; then
    cflags="-O3"
    if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then cflags="-O3 -mavx2"; fi
    "$PIP" uninstall -q -y pillow pillow-simd >/dev/null 2>&1 || true
    if ! CC="cc $cflags" "$PIP" install -q --no-binary pillow-simd pillow-simd; then
        echo "setup: WARNING pillow-simd failed to build; reinstalling pillow (slower resize)" >&2
        "$PIP" install -q pillow
    fi
fi
"$VENV/bin/python" -c "import PIL; print('setup: PIL', PIL.__version__)"
"$VENV/bin/python" -c "import media_io.preprocess._patchify" 2>/dev/null \
    || echo "setup: WARNING the C patchify kernel did not build (no C compiler?); preprocessing uses the slower numpy path" >&2
"$VENV/bin/python" -c "import llm_core.kernels._paged_attention, llm_core.kernels._moe, llm_core.kernels._rms_norm, llm_core.kernels._decoder_layer" 2>/dev/null \
    || echo "setup: WARNING the LLM's C kernels (attention, MoE, RMSNorm, decoder layer) did not build (no C compiler?); its CPU path uses the slower torch ops" >&2
"$VENV/bin/python" -c "import media_io._jpeg" 2>/dev/null \
    || echo "setup: WARNING the libjpeg decoder did not build (no libjpeg headers? apt install libjpeg-dev); JPEGs decode through Pillow" >&2

#!/usr/bin/env bash
# `make gpu-wheels`: the wheels `make gpu-check` installs on the GPU machine the device tool lends.
#
# That machine has no network and its own Python 3.12 with torch, Triton, transformers, aiohttp,
# pytest, ... but not these of our dependencies: uhashring, starlette, uvicorn, python-multipart
# and PyAV. This downloads them here (where PyPI is reachable) as cp312 manylinux x86_64 wheels,
# one pinned version each (the versions our venv is tested with), into .gpu-wheels/ (git-ignored:
# a device call names it in `carry`). Everything that travels with the tree must stay under
# 64 MiB, so PyAV (~35 MB) goes in only if the total stays under LIMIT_MIB. nvidia-dali is far over
# that limit and is never carried: DALI's GPU path is checked only where DALI is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${DEST:-.gpu-wheels}
PYTHON=${PYTHON:-python3}
LIMIT_MIB=${LIMIT_MIB:-56} # leaves the tree itself (~2 MiB) and a margin inside the 64 MiB

SMALL=(uhashring==2.5 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34)
LARGE=(av==18.1.0)

# pip matches manylinux_2_N exactly: name the usual N (as the device tool's README says).
TARGET=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

download() { # $1: folder, rest: requirements
    local dir=$1
    shift
    "$PYTHON" -m pip download -q --disable-pip-version-check "${TARGET[@]}" -d "$dir" "$@" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
    for req in "$@"; do # pip's exit status is lost in the pipe: check each wheel is there
        local name=${req%%==*}
        local version=${req#*==}
        if ! ls "$dir"/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1; then
            echo "gpu-wheels: no wheel of $req for cp312 manylinux x86_64" >&2
            return 1
        fi
    done
}

mib() { # total size of the given files in MiB, one decimal
    du -cb "$@" | tail -1 | awk '{printf "%.1f", $1 / 1048576}'
}

rm -rf "$DEST" "$DEST.tmp"
mkdir -p "$DEST" "$DEST.tmp"
download "$DEST" "${SMALL[@]}"
download "$DEST.tmp" "${LARGE[@]}"
small=$(mib "$DEST"/*.whl)
with_large=$(mib "$DEST"/*.whl "$DEST.tmp"/*.whl)
if awk -v t="$with_large" -v l="$LIMIT_MIB" 'BEGIN { exit !(t <= l) }'; then
    mv "$DEST.tmp"/*.whl "$DEST"/
else
    echo "gpu-wheels: WARNING ${LARGE[*]} left out: ${with_large} MiB with it, over LIMIT_MIB=${LIMIT_MIB}" >&2
fi
rm -rf "$DEST.tmp"

for whl in "$DEST"/*.whl; do
    printf '  %8s MiB  %s\n' "$(mib "$whl")" "$(basename "$whl")"
done
echo "gpu-wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(mib "$DEST"/*.whl) MiB in $DEST (small ones alone: ${small} MiB)"
echo "gpu-wheels: a device call carries them with carry: [\"$DEST\"]; make gpu-check installs them there"

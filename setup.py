"""The C extensions; everything else about the package is in pyproject.toml.

All are optional: when one cannot be built (no C compiler, no libjpeg headers) the install still
succeeds and media_io uses its pure-Python paths, which give the same results:

- ``media_io.preprocess._patchify``: normalize + patchify in one pass (else: the numpy path, same bits);
- ``media_io._jpeg``: JPEG decode through libjpeg into reused buffers (else: Pillow's decoder);
- ``llm_core.kernels._paged_attention``: CPU paged attention over the KV pools (else: the torch path,
  same results to float32 rounding);
- ``llm_core.kernels._moe``: CPU MoE experts and routing in one call each (else: the torch paths, same
  results to float32 rounding);
- ``llm_core.kernels._rms_norm``: CPU RMSNorm fused with the residual add (else: torch's, same results to
  float32 rounding);
- ``llm_core.kernels._decoder_layer``: a whole CPU decoder layer in one call, from the three above and
  torch's own sgemm (else: the model's modules, the same bits for MoE layers);
- ``epd_common._mkl_cpu``: lets MKL run its AVX-512 code on AMD CPUs that have it (else: its AVX2 code,
  ~half the float32 GEMM speed there).
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

# The files each extension is built from live in one table (epd_common/native.py), which the
# runtime uses too: every build embeds their hash (EPD_SOURCE_HASH, exported as SOURCE_HASH), so
# a stale .so left from older sources is detected at import and not used.
_spec = importlib.util.spec_from_file_location(
    "_epd_native", Path(__file__).parent / "epd_common" / "native.py"
)
assert _spec is not None and _spec.loader is not None
native = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native)


def extension(name: str, **kwargs: object) -> Extension:
    """``name`` built from its table entry (first file the source, the rest its headers)."""
    source, *headers = native.EXTENSIONS[name]
    return Extension(
        name,
        sources=[source],
        depends=headers,
        define_macros=[("EPD_SOURCE_HASH", f'"{native.source_hash(name, Path(__file__).parent)}"')],
        optional=True,
        **kwargs,
    )


setup(
    ext_modules=[
        extension("media_io.preprocess._patchify", extra_compile_args=["-O3"]),
        # no implicit FMA: the rotary products must round like torch's (explicit FMAs stay)
        extension("llm_core.kernels._paged_attention", extra_compile_args=["-O3", "-ffp-contract=off"]),
        extension("llm_core.kernels._moe", extra_compile_args=["-O3"]),
        extension("llm_core.kernels._rms_norm", extra_compile_args=["-O3"]),
        extension(
            "llm_core.kernels._decoder_layer",
            libraries=["dl"],  # dlopen/dlsym (part of libc from glibc 2.34 on)
            extra_compile_args=["-O3", "-ffp-contract=off"],
        ),
        extension("media_io._jpeg", libraries=["jpeg"], extra_compile_args=["-O3"]),
        # loaded before torch on AMD CPUs with AVX-512 (epd_common/mkl_dispatch.py)
        extension("epd_common._mkl_cpu"),
    ]
)

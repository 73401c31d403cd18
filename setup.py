"""The C extensions; everything else about the package is in pyproject.toml.

All are optional: when one cannot be built (no C compiler, no libjpeg headers) the install still
succeeds and media_io uses its pure-Python paths, which give the same results:

- ``media_io.preprocess._patchify``: normalize + patchify in one pass (else: the numpy path, same bits);
- ``media_io._jpeg``: JPEG decode through libjpeg into reused buffers (else: Pillow's decoder);
- ``llm_core._paged_attention``: CPU paged attention over the KV pools (else: the torch path,
  same results to float32 rounding);
- ``llm_core._moe``: CPU MoE experts and routing in one call each (else: the torch paths, same
  results to float32 rounding);
- ``llm_core._rms_norm``: CPU RMSNorm fused with the residual add (else: torch's, same results to
  float32 rounding);
- ``llm_core._decoder_layer``: a whole CPU decoder layer in one call, from the three above and
  torch's own sgemm (else: the model's modules, the same bits for MoE layers).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "media_io.preprocess._patchify",
            sources=["media_io/preprocess/_patchify.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "llm_core._paged_attention",
            sources=["llm_core/_paged_attention.c"],
            depends=["llm_core/_kernels.h", "llm_core/_paged_attention.h"],
            # no implicit FMA: the rotary products must round like torch's (explicit FMAs stay)
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "llm_core._moe",
            sources=["llm_core/_moe.c"],
            depends=["llm_core/_kernels.h", "llm_core/_gemm.h", "llm_core/_moe.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "llm_core._rms_norm",
            sources=["llm_core/_rms_norm.c"],
            depends=["llm_core/_kernels.h", "llm_core/_rms_norm.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "llm_core._decoder_layer",
            sources=["llm_core/_decoder_layer.c"],
            depends=[
                "llm_core/_kernels.h",
                "llm_core/_gemm.h",
                "llm_core/_paged_attention.h",
                "llm_core/_moe.h",
                "llm_core/_pool.h",
                "llm_core/_rms_norm.h",
            ],
            libraries=["dl"],  # dlopen/dlsym (part of libc from glibc 2.34 on)
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "media_io._jpeg",
            sources=["media_io/_jpeg.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)

"""The C extensions; everything else about the package is in pyproject.toml.

Both are optional: when one cannot be built (no C compiler, no libjpeg headers) the install still
succeeds and media_io uses its pure-Python paths, which give the same results:

- ``media_io.preprocess._patchify``: normalize + patchify in one pass (else: the numpy path, same bits);
- ``media_io._jpeg``: JPEG decode through libjpeg into reused buffers (else: Pillow's decoder).
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
            "media_io._jpeg",
            sources=["media_io/_jpeg.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)

"""The one C extension; everything else about the package is in pyproject.toml.

``_patchify`` (normalize + patchify in a single pass) is optional: when it cannot be built (no C
compiler) the install still succeeds and media_io uses its bit-identical numpy path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "media_io.preprocess._patchify",
            sources=["media_io/preprocess/_patchify.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)

from typing_extensions import Buffer

def patchify(
    frames: Buffer,
    lut: Buffer,
    affine: Buffer,
    out: Buffer,
    t: int,
    h: int,
    w: int,
    c: int,
    stride: int,
    patch: int,
    merge: int,
    temporal: int,
    /,
) -> None: ...

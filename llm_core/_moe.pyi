from typing_extensions import Buffer

def moe_experts(
    x: Buffer,
    experts: Buffer,
    weights: Buffer,
    gate_up: Buffer,
    down: Buffer,
    out: Buffer,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    /,
) -> None: ...
def simd() -> str: ...
def set_simd(name: str, /) -> None: ...

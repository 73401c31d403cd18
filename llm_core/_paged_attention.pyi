from typing_extensions import Buffer

def paged_attention(
    q: Buffer,
    k: Buffer,
    v: Buffer,
    page_table: Buffer,
    cu_seqlens_q: Buffer,
    seq_lens: Buffer,
    sinks: Buffer,
    out: Buffer,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    page_size: int,
    window: int,
    scale: float,
    /,
) -> None: ...
def simd() -> str: ...
def set_simd(name: str, /) -> None: ...

"""Functional token-latent attention primitives, without weights (paper Section 3, App. B)."""

from flarepp.ops.attention import (
    FUSED,
    AttentionBackend,
    FusedBackend,
    decode,
    encode,
    encode_with_lse,
    merge_partials,
    set_backend,
    self_attention,
)
from flarepp.ops.norms import HeadNorm, make_norm

__all__ = [
    "FUSED", "AttentionBackend", "FusedBackend", "HeadNorm", "decode", "encode",
    "encode_with_lse", "make_norm", "merge_partials", "self_attention", "set_backend",
]

"""The CPU dtype rule, in one place, for every loader (`models.loading`, `sharding.loading`).

On MLX's CPU backend (no Metal) every target computes in float32: bfloat16
matmuls have no fast CPU path, and the bundled demo pair is stored in
bfloat16. Quantized weights stay as they are, and the drafter follows the
target's activation dtype. The cast is evaluated at once, so a pair loaded
in one thread generates in another (MLX streams are per thread). On Metal,
models keep their stored dtype.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..targets.adapter import token_embedding
from ..targets.families import final_norm


def on_cpu() -> bool:
    return not mx.metal.is_available()


def as_float32(module: nn.Module | None) -> None:
    """Cast floating-point parameters to float32 (quantized weights stay as they are), evaluated now."""
    if module is not None:
        module.set_dtype(mx.float32)
        mx.eval(module.parameters())


def target_float_dtype(model: nn.Module) -> mx.Dtype | None:
    """The target's activation dtype (its final norm's, else its token embedding's), so the drafter
    computes alike."""
    norm = final_norm(model)
    dtype = getattr(getattr(norm, "weight", None), "dtype", None)
    if dtype is None and (embedding := token_embedding(model)) is not None:
        dtype = getattr(embedding, "scales", embedding.weight).dtype  # (a quantized table's scales)
    return dtype


def dtype_name(dtype: mx.Dtype | None) -> str:
    """'float32', 'bfloat16', ... (how commands and the server report what a model computes in)."""
    return str(dtype).rsplit(".", 1)[-1] if dtype is not None else "unknown"

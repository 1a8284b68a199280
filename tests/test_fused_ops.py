"""The drafter's CPU norm and rotary steps compute what the eager mx.fast ops compute."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from dflash_mlx.draft import fused_ops
from dflash_mlx.draft.fused_ops import HeadProjection, rms_norm

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8,
        "long_factor": [1.5] * 8,
    },
}


def eager_heads(rope, x, norm, offset):
    B, L, _ = x.shape
    h = norm(x.reshape(B, L, -1, norm.weight.shape[0]))
    return rope(h.transpose(0, 2, 1, 3), offset=offset)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_heads_are_the_eager_norm_and_rotation_at_every_shape_and_offset(scaling):
    rope = initialize_rope(
        16, base=10000.0, traditional=False, scaling_config=SCALINGS[scaling], max_position_embeddings=512
    )
    heads = HeadProjection(rope)
    assert (heads.tables is not None) == (scaling in ("default", "linear"))
    norm = nn.RMSNorm(16, eps=1e-6)
    norm.weight = mx.random.uniform(0.5, 1.5, (16,), key=mx.random.key(0))
    for rows in (1, 5, 9):
        x = mx.random.normal((2, rows, 3 * 16), key=mx.random.key(rows))
        # 1020 + 9 rows crosses the first table's end: the tables grow
        for offset in (0, 37, 300, 1020, 2 * fused_ops.TABLE_STEP + 5):
            got, want = heads(x, norm, offset), eager_heads(rope, x, norm, offset)
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), (rows, offset)
            if scaling == "default":
                assert mx.array_equal(got, want).item(), (rows, offset)


def test_partial_rotary_dims_and_per_row_offsets():
    rope = nn.RoPE(8, base=500.0)  # rotates the first 8 of 16 dims
    heads, norm = HeadProjection(rope), nn.RMSNorm(16)
    x = mx.random.normal((3, 4, 32), key=mx.random.key(2))
    assert mx.array_equal(heads(x, norm, 70), eager_heads(rope, x, norm, 70)).item()
    offsets = mx.array([3, 90, 1500], mx.int32)  # batched drafting: one position per row
    assert mx.array_equal(heads(x, norm, offsets), eager_heads(rope, x, norm, offsets)).item()


def test_compiled_steps_read_the_current_weights_not_the_first_ones():
    rope = initialize_rope(16, base=10000.0, traditional=False, scaling_config=None, max_position_embeddings=512)
    heads, norm = HeadProjection(rope), nn.RMSNorm(16)
    x = mx.random.normal((1, 4, 32), key=mx.random.key(1))
    first, first_norm = heads(x, norm, 3), rms_norm(norm, x[..., :16])
    norm.weight = norm.weight * 3.0  # replaced, as training, set_dtype or loading weights do
    assert mx.allclose(heads(x, norm, 3), first * 3.0).item()
    assert mx.allclose(rms_norm(norm, x[..., :16]), first_norm * 3.0).item()
    assert mx.array_equal(rms_norm(norm, x[..., :16]), norm(x[..., :16])).item()


def test_bfloat16_heads_keep_their_dtype_and_the_eager_values():
    rope = nn.RoPE(16, base=10000.0)
    heads, norm = HeadProjection(rope), nn.RMSNorm(16)
    norm.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 5, 32), key=mx.random.key(3)).astype(mx.bfloat16)
    got = heads(x, norm, 11)
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, eager_heads(rope, x, norm, 11)).item()

"""mlx-lm's quantized KV cache (`kv_bits`) under DFlash, converted exactly when mlx-lm converts it.

mlx-lm's decoding quantizes every `KVCache` once it holds `quantized_kv_start`
positions, right after the forward that got it there (`maybe_quantize_kv_cache`
after each step of `generate_step`), so that forward still read the cache in
full precision and every later one reads it quantized: the position of a row
decides how the cache it reads is stored. DFlash keeps that rule: before every
target forward, `convert` quantizes the caches mlx-lm would have quantized
after the previous one (they hold the same committed positions then; the
first forward of a fresh cache is never quantized, as mlx-lm's first is
not), and `rows_allowed` keeps a verify whose rows start before the
conversion point from reaching it (mlx-lm computes those later rows with the
quantized cache). Only the caches mlx-lm converts are converted (those with
`to_quantized`: the KV caches of attention layers; the recurrent state of a
hybrid target stays as it is). mlx-lm cannot quantize a sliding-window
(rotating) cache, so such targets are refused (`problem`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache
from mlx_lm.models.cache import RotatingKVCache

from .rollback import layer_caches

BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes (affine)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVQuantization:
    """`kv_bits`, `kv_group_size`, `quantized_kv_start` as `mlx_lm.generate` takes them."""

    bits: int
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START

    @property
    def first_quantized(self) -> int:
        """The first position a forward reads from a quantized cache (position 0 never is)."""
        return max(self.start, 1)

    def convert(self, cache: list) -> None:
        """Quantize (in the list, as mlx-lm does) the caches that hold `start` positions or more."""
        maybe_quantize_kv_cache(cache, self.first_quantized, self.group_size, self.bits)

    def rows_allowed(self, position: int) -> int | None:
        """How many rows a forward starting at `position` may feed (None: any number)."""
        return self.first_quantized - position if position < self.first_quantized else None

    def problem(self, cache: list) -> str | None:
        """Why mlx-lm cannot quantize this target's caches, or None."""
        if any(type(c) is RotatingKVCache for c in layer_caches(cache)):
            return (
                "kv_bits: mlx-lm cannot quantize this target's sliding-window (RotatingKVCache) caches "
                "(its own decoding fails there too); leave the KV cache unquantized"
            )
        return None


def kv_quantization(
    kv_bits: int | None, kv_group_size: int = 64, quantized_kv_start: int | None = DEFAULT_QUANTIZED_KV_START
) -> KVQuantization | None:
    """The settings, checked (None: no quantization); errors name the argument and what it takes."""
    if kv_bits is None:
        return None
    if isinstance(kv_bits, bool) or kv_bits not in BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, BITS))} (or None), got {kv_bits!r}.")
    if isinstance(kv_group_size, bool) or kv_group_size not in GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {kv_group_size!r}.")
    start = DEFAULT_QUANTIZED_KV_START if quantized_kv_start is None else quantized_kv_start
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"quantized_kv_start must be an integer >= 0, got {quantized_kv_start!r}.")
    return KVQuantization(kv_bits, kv_group_size, start)

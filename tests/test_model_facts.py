"""`models.facts.read_facts`: the one walk the block cap and the calibration key read a model with."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_mlx.models.block_size import capped_block_size, min_quantized_bits
from dflash_mlx.models.facts import facts_read_once, read_facts


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = [nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 32)]
        self.norm = nn.RMSNorm(32)


def reference(model):
    arrays = [a for _, a in tree_flatten(model.parameters())]
    floats = sorted({str(a.dtype) for a in arrays if mx.issubdtype(a.dtype, mx.floating)})
    return sum(a.size for a in arrays), tuple(floats)


def test_counts_dtypes_and_the_smallest_quantized_width_as_mlx_lists_them():
    model = Tiny()
    facts = read_facts(model)
    assert (facts.parameters, facts.float_dtypes, facts.bits) == (*reference(model), None)
    model.embed.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, m: p == "layers.0")
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: p == "layers.2")
    facts = read_facts(model)  # packed uint32 weights count as arrays, not as float dtypes
    assert (facts.parameters, facts.float_dtypes) == reference(model)
    assert facts.float_dtypes == ("mlx.core.bfloat16", "mlx.core.float32") and facts.bits == 4
    assert min_quantized_bits(model) == 4 and capped_block_size(16, model, None) == 5
    assert capped_block_size(16, Tiny(), None) == 16


def test_a_generations_setup_reads_each_model_once_and_a_later_one_sees_a_change():
    model = Tiny()
    with facts_read_once():
        first = read_facts(model)
        nn.quantize(model, group_size=32, bits=4)  # (not done during a real setup: shows the memo holds)
        assert read_facts(model) is first and first.bits is None
        assert read_facts(Tiny()) is not first  # another model: its own walk
    assert read_facts(model).bits == 4  # the next setup walks the model again
    assert capped_block_size(16, model, None) == 5

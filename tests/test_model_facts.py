"""`models.facts.read_facts`: what the block cap and the calibration key read of a model, walked once
per model and again after any change in place."""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_mlx.models.block_size import capped_block_size, min_quantized_bits
from dflash_mlx.models.facts import ModelFacts, read_facts


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


def test_facts_are_read_once_until_the_model_changes_in_place():
    model = Tiny()
    first = read_facts(model)
    assert read_facts(model) is first  # unchanged: not walked again
    assert read_facts(Tiny()) is not first  # another model: its own walk
    nn.quantize(model, group_size=32, bits=4)  # leaf modules replaced
    assert read_facts(model).bits == 4 and capped_block_size(16, model, None) == 5
    model = Tiny()
    read_facts(model)
    model.embed.set_dtype(mx.bfloat16)  # arrays replaced
    assert read_facts(model).float_dtypes == ("mlx.core.bfloat16", "mlx.core.float32")
    model.layers.append(nn.Linear(32, 32))  # a list grew
    assert (read_facts(model).parameters, read_facts(model).float_dtypes) == reference(model)
    model.layers[3] = nn.Linear(32, 8)  # a list item replaced
    assert read_facts(model).parameters == reference(model)[0]
    model.norm.bias = mx.zeros((32,))  # an entry added to a module
    assert read_facts(model).parameters == reference(model)[0]
    del model.norm["bias"]
    model.norm["extra"] = mx.zeros((5,), mx.float16)  # one entry removed, another added: same length
    assert read_facts(model) == ModelFacts(*reference(model), None)
    model.load_weights([("embed.weight", mx.zeros((64, 32), mx.float16))], strict=False)
    assert read_facts(model) == ModelFacts(*reference(model), None)


def test_the_memo_keeps_neither_the_model_nor_replaced_weights_alive():
    model = Tiny()
    read_facts(model)
    old = weakref.ref(model.layers[0].weight)
    nn.quantize(model, group_size=32, bits=4)
    gc.collect()
    assert old() is None  # before any new read: the memo held the old weight weakly
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None

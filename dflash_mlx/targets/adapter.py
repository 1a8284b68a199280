"""Running an mlx-lm target with hidden-state capture and exact rollback.

`TargetAdapter` runs the target's own forward through a view of it
(`capture.layer_view`: the layers the drafter reads are `Tap`s, Gated DeltaNet
modules `gated_delta.Recording`s), returning the logits plus the outputs of
the decoder layers the drafter reads, concatenated along the hidden axis
(with `final=True`, followed by the target's final hidden state, its final
norm's output as its own forward computes it, and each row's token
embedding: what a multi-token-prediction head reads, `proposers.mtp`).
`verify` also returns a `VerifyRecord`, which `rollback.rollback(cache, record,
keep)` consumes to keep the accepted prefix in every cache: per cache type
(`rollback.CACHE_KINDS`), or, for recurrent layers without a recording forward,
by putting the caches back and feeding the kept rows again. It also lends the
drafter the target's token embedding and output head. What a family does
differently lives in `families`; a target DFlash cannot run is refused when
its adapter is made (`target_problem`, which loading calls).

Tensor-sharded targets (mlx-lm's `shard()`, see `dflash_mlx.sharding`) run
as they are: their layers and their own forward exchange partial sums, so the
captured hidden states are the full residual stream on every rank; the
drafter's head gathers a vocabulary-sharded head as mlx-lm's forward does, and
`group` names the ranks, None when the target is not sharded.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from .capture import LayerListError, Tap, layer_view, with_child
from .families import family_of, final_norm, model_family, text_model
from .gated_delta import Recording, gated_delta_child
from .rollback import VerifyRecord, arrays_states, check_caches, layer_caches, undo

HEAD_NAMES = ("lm_head", "output")  # a text model's untied output head, by mlx-lm's names
FINAL = "final"  # the tap on the final norm (`final=True`)


class UnsupportedTargetError(ValueError):
    """The target cannot run DFlash (its layers, embedding or caches); the message says why."""


def token_embedding(model: nn.Module) -> nn.Module | None:
    """The target's input token embedding: its only Embedding outside the layer lists, or the one
    named embed_tokens (gemma's per-layer tables are others)."""
    found: list[tuple[str, nn.Module]] = []
    stack, seen = [text_model(model)], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, child in module.items():
            if isinstance(child, (nn.Embedding, nn.QuantizedEmbedding)):
                found.append((name, child))
            elif isinstance(child, nn.Module):
                stack.append(child)
    named = [m for name, m in found if name == "embed_tokens"]
    if len(named) == 1 or len(found) == 1:
        return named[0] if named else found[0][1]
    return None


def embedding_shape(embedding: nn.Module) -> tuple[int, int]:
    """(vocabulary, hidden size) of an Embedding or QuantizedEmbedding."""
    if isinstance(embedding, nn.QuantizedEmbedding):
        return embedding.num_embeddings, embedding.dims
    return tuple(embedding.weight.shape)


def target_problem(model: nn.Module) -> str | None:
    """Why DFlash cannot run this target (before any weight is needed), or None."""
    try:
        TargetAdapter(model)
    except UnsupportedTargetError as e:
        return str(e)
    return None


class TargetAdapter:
    """A target model seen through the interface the engine and drafter need."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = (), final: bool = False):
        """`layer_ids`: the decoder layers whose outputs the features hold; `final`: the features end with
        the final hidden state and the token embedding of each row (`reads_final` proposers)."""
        self.model = model
        self.family_name = family = model_family(model)
        self.family = family_of(model)
        self.text = text_model(model)
        self.layers = list(getattr(model, "layers", None) or [])
        if not self.layers or any(layer is None for layer in self.layers):
            raise UnsupportedTargetError(
                f"Target model ({family}): no decoder layers in model.layers (a "
                "pipeline-parallel target holds only its stage's; not supported)."
            )
        self.embedding = token_embedding(model)
        if self.embedding is None:
            raise UnsupportedTargetError(f"Target model ({family}): no single token embedding found for the drafter.")
        self.lm_head = next((self.text[n] for n in HEAD_NAMES if isinstance(self.text.get(n), nn.Module)), None)
        bad = [i for i in layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"Target layer ids {bad} are out of range for a target with {len(self.layers)} layers.")
        self.layer_ids = tuple(layer_ids)
        self.group = tensor_group(model)
        self._capture_slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(self.layer_ids):
            self._capture_slots.setdefault(layer, []).append(slot)
        cache = make_prompt_cache(model)
        try:
            check_caches(cache, family)
        except ValueError as e:
            raise UnsupportedTargetError(str(e)) from e
        self.gated_delta_layers = {i for i, layer in enumerate(self.layers) if gated_delta_child(layer)}
        arrays = sum(type(c) is ArraysCache for c in layer_caches(cache))
        self.refeeds = arrays > len(self.gated_delta_layers)  # recurrent layers without a recording forward
        self._local = threading.local()
        replacements = {}
        for i in sorted(self.gated_delta_layers | set(self._capture_slots)):
            layer = self.layers[i]
            if i in self.gated_delta_layers:
                name = gated_delta_child(layer)
                layer = with_child(layer, name, Recording(layer[name], self._recording))
            replacements[i] = Tap(layer, i, self._seen) if i in self._capture_slots else layer
        self.final = final
        taps = {}
        if final:
            norm = final_norm(model)
            if norm is None:
                raise UnsupportedTargetError(f"Target model ({family}): no final norm (model.norm) to read.")
            taps[id(norm)] = Tap(norm, FINAL, self._seen_final)
        try:
            self.view = layer_view(model, replacements, taps) if replacements or taps else model
        except LayerListError as e:
            raise UnsupportedTargetError(f"Target model ({family}): {e}.") from e

    @property
    def vocab_size(self) -> int:
        return embedding_shape(self.embedding)[0]

    @property
    def hidden_size(self) -> int:
        return embedding_shape(self.embedding)[1]

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    def embed(self, ids: mx.array) -> mx.array:
        """The drafter's input embedding: the table times the target's `embed_scale`
        attribute where mlx-lm defines one (as the upstream MLX reference does)."""
        table = self.embedding
        inner = getattr(self.text, "model", None)
        scale = getattr(table, "embed_scale", getattr(inner, "embed_scale", 1.0))
        h = table(ids)
        return h if scale == 1.0 else h * scale

    def head(self, hidden: mx.array) -> mx.array:
        """The raw output head (tied embedding or lm_head), as the drafter uses it."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
            group = getattr(self.text, "sharding_group", None)  # a vocabulary-sharded head (mlx-lm's qwen3_5)
            return logits if group is None else gather_last_axis(logits, group)
        return self.embedding.as_linear(hidden)

    def forward(self, ids: mx.array, cache: list, logits: bool = True) -> tuple[mx.array | None, mx.array | None]:
        """Run ids [B, L]; return (logits [B, L, V], captured features [B, L, n*H] or None).

        Both are lazy; `logits=False` (a prefill chunk) returns None for the logits.
        """
        logits, features, _ = self._forward(ids, cache, None, logits)
        return logits, features

    def verify(
        self, ids: mx.array, cache: list, logits: bool = True
    ) -> tuple[mx.array | None, mx.array | None, VerifyRecord]:
        """`forward` (`logits` as there), plus the record `rollback(cache, record, keep)` needs to keep a prefix."""
        return self._forward(ids, cache, VerifyRecord(rows=ids.shape[1]), logits)

    def _forward(self, ids: mx.array, cache: list, record: VerifyRecord | None, head: bool = True):
        captured: list[mx.array | None] = [None] * len(self.layer_ids)
        states = arrays_states(cache) if record is not None and self.refeeds else None
        local = self._local
        local.captured, local.record, local.final = captured, record, None
        try:
            out = self.view(ids, cache=cache)
        finally:
            final, local.captured, local.record, local.final = local.final, None, None, None
        if self.final:
            if final is None:
                raise UnsupportedTargetError(
                    f"Target model ({self.family_name}): its forward did not call its final norm (model.norm)."
                )
            captured += [final, self.embed(ids).astype(final.dtype)]
        if states and any(id(c) not in record.gdn for c, _ in states):
            record.refeed = self._refeed(ids, cache, record, states)
        if any(c is None for c in captured):
            missing = [self.layer_ids[s] for s, c in enumerate(captured) if c is None]
            raise UnsupportedTargetError(
                f"Target model ({self.family_name}): its forward did not call layers {missing} through model.layers."
            )
        features = mx.concatenate(captured, axis=-1) if captured else None
        return (out if head else None), features, record

    def _refeed(self, ids: mx.array, cache: list, record: VerifyRecord, states: list):
        def refeed(keep: int) -> None:
            undo(cache, record, states)
            if keep:
                self.forward(ids[:, :keep], cache, logits=False)

        return refeed

    def _recording(self) -> VerifyRecord | None:
        return getattr(self._local, "record", None)

    def _seen_final(self, _, out) -> None:
        if getattr(self._local, "captured", None) is not None:
            self._local.final = out

    def _seen(self, i: int, out) -> None:
        captured = getattr(self._local, "captured", None)
        if captured is not None:
            h = self.family.capture(out if isinstance(out, mx.array) else out[0])
            for slot in self._capture_slots[i]:
                captured[slot] = h


def tensor_group(model: nn.Module):
    """The group a tensor-sharded target (mlx-lm's `shard()`) is split over, or None.

    Every family's `shard()` splits the first layer: its sharded linears carry
    the group, and the modules mlx-lm shards in place carry `sharding_group`.
    """
    group = vars(text_model(model)).get("sharding_group")  # an attribute mlx-lm's shard() sets, not a child
    if group is not None:
        return group
    stack = [model.layers[0]]
    pop, push = stack.pop, stack.append
    while stack:  # the layer's modules, walked directly (cheaper than `Module.modules()`)
        module = pop()
        if isinstance(module, _SHARDED):
            return module.group
        group = vars(module).get("sharding_group")
        if group is not None:
            return group
        for value in module.values():
            if isinstance(value, nn.Module):
                push(value)
            elif isinstance(value, (list, tuple)):
                stack.extend(v for v in value if isinstance(v, nn.Module))
    return None


_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)

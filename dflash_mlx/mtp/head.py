"""A target's MTP heads as one module: per stage, the input projection, its norms, the family's own
decoder layer, the final norm and (where the family has one) its own output head.

`MTPHead.forward(stage, hidden, embedding, cache)` runs one stage over rows of
(h[t], embed(x[t+1])) pairs and returns the layer's output before the final
norm; `feedback` is what a chained step feeds back (`layouts`: before or after
the final norm, as vLLM's module for the family returns it); `logits` applies
the final norm and the stage's head, or the target's (`TargetAdapter.head`).
The decoder layer is the target family's own mlx-lm class, run with its own
cache (`make_cache`: the cache the target gives a layer of that kind) and the
family's own mask convention (`create_attention_mask`). `checkpoint` builds it
from a checkpoint; `train.mtp` trains one.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from .layouts import MTPLayout


class MTPStage(nn.Module):
    def __init__(self, projection, embedding_norm, hidden_norm, layer, final_norm, head=None):
        super().__init__()
        self.projection = projection
        self.embedding_norm = embedding_norm
        self.hidden_norm = hidden_norm
        self.layer = layer
        self.final_norm = final_norm
        if head is not None:
            self.head = head


class MTPHead(nn.Module):
    """The stages of a target's MTP heads (`stages[i]`: MTP layer i) and how its family runs them."""

    def __init__(self, stages: list[MTPStage], layout: MTPLayout, family: str, template: int, empty_cache):
        """`template`: the index of the target layer the stages' decoder layers are built like; `empty_cache`:
        an empty cache of that layer's kind (each stage gets a copy)."""
        super().__init__()
        self.stages = stages
        self._layout, self._family, self._template, self._empty = layout, family, template, empty_cache

    @property
    def layout(self) -> MTPLayout:
        return self._layout

    @property
    def family(self) -> str:
        return self._family

    @property
    def template(self) -> int:
        return self._template

    @property
    def config(self):
        """What calibration keys and prompt-cache files record of it (`models.facts`)."""
        return SimpleNamespace(model_type=f"{self._family}_mtp", num_hidden_layers=len(self.stages))

    def make_cache(self) -> list:
        return [copy.deepcopy(self._empty) for _ in self.stages]

    def forward(self, stage: int, hidden: mx.array, embedding: mx.array, cache=None) -> mx.array:
        """Stage `stage` over rows [B, L, H] of hidden states and next-token embeddings (its cache holding
        the rows before them; None: a causal pass over the rows alone): its output before the final norm."""
        s = self.stages[stage]
        e, h = s.embedding_norm(embedding), s.hidden_norm(hidden)
        x = s.projection(mx.concatenate([h, e] if self._layout.hidden_first else [e, h], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        return s.layer(x, mask, cache)

    def feedback(self, stage: int, out: mx.array) -> mx.array:
        """What the next chained step takes as its hidden state."""
        return self.stages[stage].final_norm(out) if self._layout.normed_feedback else out

    def logits(self, stage: int, out: mx.array, target) -> mx.array:
        """Logits of a stage's output rows (before its final norm): its own head, else the target's."""
        s = self.stages[stage]
        normed = s.final_norm(out)
        head = s.get("head")
        return head(normed) if head is not None else target.head(normed)

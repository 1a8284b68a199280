"""The DSpark drafter as MLX modules: DFlash's context-conditioned backbone plus its Markov and confidence heads.

The backbone is DFlash's (`draft.model`): `fc` + `hidden_norm` fuse the
target's hidden states of committed positions into context rows whose keys and
values every layer caches (`DraftContextCache`); a block [anchor, mask, ...]
attends to them and to itself, bidirectionally (or causally and over a sliding
window for DFlash-lineage heads). What DSpark changes:

- its layers: qwen3 (qwen3_5-flavoured: a gated `q_proj`), or gemma4 (one
  projection for keys and values, values RMS-normed, sandwich norms and a
  layer scalar, GELU);
- its own embedding and head, or the target's where the checkpoint ships none;
- a head over a reduced draft vocabulary, mapped to target ids by `d2t`;
- the Markov head: row i's logits get `markov_w2(markov_w1[previous token])`,
  the previous token being the anchor for the first row and the draft chosen
  at row i - 1 after it, so a block is drafted left to right
  (`proposers.dspark`);
- the confidence head: an estimate of each row's chance of acceptance.

Module names match the checkpoints' tensor names, so weights load one to one.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

from .dspark_config import DSparkConfig
from .fused_ops import HeadProjection, rms_norm
from .model import DFlashDraftModel, DraftAttention, DraftLayer, TargetHooks


class DSparkAttention(DraftAttention):
    """DFlash's block attention with DSpark's variants: gated queries, keys as values, normed values, sinks."""

    def __init__(self, config: DSparkConfig, layer: int):
        nn.Module.__init__(self)
        dim, head_dim, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scale = config.scale
        self.gated, self.k_eq_v, self.norm_values = config.gated_q, config.k_eq_v, config.v_norm
        self.eps = config.rms_norm_eps
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        if config.attention_sink:
            self.attention_sink_bias = mx.zeros((self.n_heads,))
        self.window = config.sliding_window if config.layer_is_sliding(layer) else None
        self.causal = config.layer_is_causal(layer)

    def _queries(self, x: mx.array) -> tuple[mx.array, mx.array | None]:
        q = self.q_proj(x)
        if not self.gated:
            return q, None
        B, L, _ = x.shape
        q, gate = mx.split(q.reshape(B, L, self.n_heads, -1), 2, axis=-1)  # [q, gate] per head
        return q.reshape(B, L, -1), gate.reshape(B, L, -1)

    def _sinks(self) -> mx.array | None:
        return self.get("attention_sink_bias")

    def _keys_values(self, x: mx.array, heads: HeadProjection, offset: int) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k = self.k_proj(x)
        v = (k if self.k_eq_v else self.v_proj(x)).reshape(B, L, self.n_kv_heads, -1)
        if self.norm_values:
            v = mx.fast.rms_norm(v, None, self.eps)
        return heads(k, self.k_norm, offset), v.transpose(0, 2, 1, 3)


class MLP(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = nn.gelu_approx if config.activation == "gelu_approx" else nn.silu

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DSparkLayer(DraftLayer):
    """A qwen-style layer (two norms), or gemma4's (sandwich norms, a layer scalar)."""

    def __init__(self, config: DSparkConfig, layer: int):
        nn.Module.__init__(self)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DSparkAttention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
            self.post_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
            self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache, heads: HeadProjection, context: mx.array | None = None) -> mx.array:
        if not self.sandwich:
            return super().__call__(x, cache, heads, context)
        attended = self.self_attn(rms_norm(self.input_layernorm, x), cache, heads, context)
        h = x + rms_norm(self.post_attention_layernorm, attended)
        fed = self.mlp(rms_norm(self.pre_feedforward_layernorm, h))
        return (h + rms_norm(self.post_feedforward_layernorm, fed)) * self.layer_scalar


class MarkovHead(nn.Module):
    """The previous token's low-rank bias on a row's logits: markov_w2(markov_w1[previous])."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)  # previous tokens are target ids
        self.markov_w2 = nn.Linear(config.markov_rank, config.out_vocab_size, bias=False)

    def __call__(self, previous: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return self.proj(features)[..., 0]


class DSparkDraftModel(nn.Module):
    """A DSpark drafter (see the module docstring). `block_size` is this package's block: the widest verify,
    the anchor and `config.max_drafts` drafts."""

    def __init__(self, config: DSparkConfig, own_embedding: bool = True, own_head: bool = True):
        super().__init__()
        self.config = config
        H = config.hidden_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [DSparkLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        if own_head:
            self.lm_head = nn.Linear(H, config.out_vocab_size, bias=False)
        if config.markov_rank > 0:
            self.markov_head = MarkovHead(config)
        self.confidence_with_markov = config.confidence_with_markov and config.markov_rank > 0
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(H + (config.markov_rank if self.confidence_with_markov else 0))
        self.rope = initialize_rope(
            config.rope_dims or config.head_dim,
            base=config.rope_theta,
            traditional=config.rope_traditional,
            scaling_config=config.rope_scaling,
        )
        self.heads = HeadProjection(self.rope)
        self._draft_to_target = self._target_to_draft = None  # a reduced head's id tables (not parameters)

    # the context: DFlash's, on this drafter's layers
    make_cache = DFlashDraftModel.make_cache
    fuse_context = DFlashDraftModel.fuse_context
    extend_context = DFlashDraftModel.extend_context

    @property
    def block_size(self) -> int:
        return self.config.max_drafts + 1

    def block_width(self, count: int) -> int:
        """Slots the backbone runs to draft `count` tokens: the checkpoint's whole block (each row of a
        bidirectional block sees all of them), or for a causal block only up to the last row read."""
        if not self.config.causal:
            return self.config.block_size
        return min(self.config.block_size, self.config.logits_start + max(1, count))

    def embed(self, block_ids: mx.array, target: TargetHooks) -> mx.array:
        if "embed_tokens" in self:
            h = self.embed_tokens(block_ids)
            return h if self.config.embed_scale == 1.0 else h * self.config.embed_scale
        return target.embed(block_ids)

    def hidden_states(
        self, block_ids: mx.array, cache, target: TargetHooks, features: mx.array | None = None
    ) -> mx.array:
        """Final normed hidden states of every block slot. `features` (target features of positions committed
        right before the block) are ingested by the same forward."""
        h = self.embed(block_ids, target)
        context = None if features is None else self.fuse_context(features)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c, self.heads, context)
        return rms_norm(self.norm, h)

    def head_logits(self, hidden: mx.array, target: TargetHooks) -> mx.array:
        """The head's logits over the draft vocabulary (softcapped where the checkpoint says so), without the
        Markov bias."""
        logits = self.lm_head(hidden) if "lm_head" in self else target.head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def markov_bias(self, previous: mx.array) -> mx.array | float:
        """The Markov head's bias [..., draft vocabulary] for previous tokens (target ids); 0 without one."""
        return self.markov_head(previous) if "markov_head" in self else 0.0

    def confidence(self, hidden: mx.array, previous: mx.array) -> mx.array | None:
        """Each row's estimated chance of acceptance (sigmoid of the confidence head), from its hidden state
        and (where the head reads it) the previous token's Markov embedding; None without the head."""
        if "confidence_head" not in self:
            return None
        if self.confidence_with_markov:
            hidden = mx.concatenate([hidden, self.markov_head.markov_w1(previous)], axis=-1)
        return mx.sigmoid(self.confidence_head(hidden))

    # -- the draft vocabulary ----------------------------------------------------------------------

    def set_draft_map(self, offsets: np.ndarray) -> None:
        """A reduced head's `d2t` table: target id = draft id + offsets[draft id] (distinct target ids)."""
        ids = np.arange(offsets.size) + offsets.reshape(-1).astype(np.int64)
        vocab = self.config.vocab_size
        if offsets.size != self.config.out_vocab_size or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"'d2t' must map the {self.config.out_vocab_size} draft ids into 0..{vocab - 1}")
        inverse = np.full(vocab, -1, np.int64)
        inverse[ids] = np.arange(ids.size)
        if (inverse >= 0).sum() != ids.size:
            raise ValueError("'d2t' maps two draft ids to one target id")
        self._draft_to_target = mx.array(ids, mx.int32)
        self._target_to_draft = mx.array(inverse, mx.int32)

    def to_target(self, draft_ids: mx.array) -> mx.array:
        return draft_ids if self._draft_to_target is None else self._draft_to_target[draft_ids]

    def widen(self, rows: mx.array, fill: float) -> mx.array:
        """Rows over the draft vocabulary as rows over the target's (`fill` at ids the head cannot draft)."""
        if self._draft_to_target is None:
            return rows
        inverse = self._target_to_draft
        picked = mx.take(rows, mx.maximum(inverse, 0), axis=-1)
        return mx.where(inverse >= 0, picked, mx.array(fill, rows.dtype))

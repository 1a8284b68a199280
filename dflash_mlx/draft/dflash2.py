"""DFlash 2 additions: grouped dynamic causal convolution and the candidate selector.

Spec section 4. Every draft layer wraps its attention and its MLP in a
`GroupedDynamicConv` (a 2-tap-style causal convolution over the block whose
kernel is a learned base plus a per-row, per-group part predicted from the
input). The `CandidateSelector` replaces independent per-row choices: it walks
the block left to right over each row's top-k candidates, scoring a candidate
by its logit plus a low-rank predecessor/successor compatibility term.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import DraftConfig
from .fused_ops import HeadProjection, rms_norm
from ..sampling import row_keys
from .model import DFlashDraftModel, DraftContextCache, DraftLayer


def causal_group_conv(z: mx.array, base: mx.array, dynamic: mx.array, group_size: int) -> mx.array:
    """sum_j (base[j] + dynamic[t, j, group(c)]) * z[t - j], zero before the first row.

    z [B, L, H], base [K, H], dynamic [B, L, K, G].
    """
    B, L, H = z.shape
    groups = H // group_size
    zg = z.reshape(B, L, groups, group_size)
    out = mx.zeros_like(zg)
    for j in range(base.shape[0]):
        shifted = zg if j == 0 else mx.concatenate([mx.zeros_like(zg[:, :j]), zg[:, :-j]], axis=1)
        tap = base[j].reshape(1, 1, groups, group_size).astype(z.dtype) + dynamic[:, :, j, :, None]
        out = out + tap * shifted
    return out.reshape(B, L, H)


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}.")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, u: mx.array) -> tuple[mx.array, mx.array]:
        dynamic = self.kernel_projection(u).reshape(*u.shape[:-1], 2, self.kernel_size, self.groups)
        first = causal_group_conv(u, self.base_kernel[0], dynamic[..., 0, :, :], self.group_size)
        return first, dynamic[..., 1, :, :]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return causal_group_conv(y, self.base_kernel[1], dynamic, self.group_size)


class DFlash2Layer(DraftLayer):
    def __init__(self, config: DraftConfig, layer: int):
        super().__init__(config, layer)
        H, K, G = config.hidden_size, config.conv_kernel_size, config.conv_group_size
        self.attention_conv = GroupedDynamicConv(H, K, G)
        self.mlp_conv = GroupedDynamicConv(H, K, G)

    def __call__(
        self, x: mx.array, cache: DraftContextCache, heads: HeadProjection, context: mx.array | None = None
    ) -> mx.array:
        u, dynamic = self.attention_conv.prepare(rms_norm(self.input_layernorm, x))
        h = x + self.attention_conv.finish(self.self_attn(u, cache, heads, context), dynamic)
        u, dynamic = self.mlp_conv.prepare(rms_norm(self.post_attention_layernorm, h))
        return h + self.mlp_conv.finish(self.mlp(u), dynamic)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)

    def select(self, hidden: mx.array, logits: mx.array, anchor, temperature: float = 0.0, key=None):
        """Walk blocks: hidden [..., g, H], logits [..., g, V], anchor [...] ->
        (path [..., g], candidates [..., g, k], q [..., g, k] or None).

        Greedy takes the best score per row; sampling draws from softmax(score / T)
        (temperature only) and returns those rows as the draft distribution q,
        which lives on each row's candidates.
        """
        candidates = mx.argpartition(-logits, self.top_k - 1, axis=-1)[..., : self.top_k]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        projected = self.hidden_projection(hidden)  # [..., g, R]
        successors = self.successor_codebook(candidates)  # [..., g, k, R]
        predecessor = mx.array(anchor).reshape(hidden.shape[:-2])
        steps = hidden.shape[-2]
        by_position = key is not None and key.ndim == 2  # a seeded call's per-row keys (`sampling.row_keys`)
        keys = row_keys(key, steps)
        path, q_rows = [], []
        for t in range(steps):
            pair = self.predecessor_codebook(predecessor) * projected[..., t, :]
            scores = unary[..., t, :] + mx.sum(successors[..., t, :, :] * pair[..., None, :], axis=-1)
            if temperature > 0:
                q = mx.softmax(scores.astype(mx.float32) / temperature, axis=-1)
                if by_position:  # the noise the target draws this position with, at the candidates
                    noise = mx.random.gumbel(logits.shape[-1:], key=keys[t])[candidates[..., t, :]]
                    choice = mx.argmax(scores.astype(mx.float32) / temperature + noise, axis=-1)
                else:
                    choice = mx.random.categorical(mx.log(q), axis=-1, key=keys[t])
                q_rows.append(q)
            else:
                choice = mx.argmax(scores, axis=-1)
            predecessor = mx.take_along_axis(candidates[..., t, :], choice[..., None], axis=-1)[..., 0]
            path.append(predecessor)
        path = mx.stack(path, axis=-1).astype(mx.int32)
        return path, candidates, (mx.stack(q_rows, axis=-2) if q_rows else None)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2 drafter: v1 with convolution-wrapped sublayers and a candidate selector."""

    layer_class = DFlash2Layer

    def __init__(self, config: DraftConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
        )

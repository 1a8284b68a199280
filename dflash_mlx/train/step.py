"""One optimisation step of drafter training, and the optimizer with its schedule.

`StepRunner` draws the step's batch (`batches.step_batch`, replay pool
included), gets the target's features, computes the weighted block loss and
the drafter's gradients, clips them and updates the drafter (only the
drafter: the target, its embedding and head are frozen). When the batch has
more block rows than one logits chunk holds (`--loss-chunk-rows`, by default
about 128 MB of float32 logits), the loss runs in chunks
(`chunked_loss.chunked_step`); otherwise in one graph. Both give the same loss
and gradients.

The drafter's attention keeps batch x heads x (anchors x b) x (L + anchors x b)
probabilities per layer for the backward pass, which dominates at long
sequences. So the anchors of a step are processed `--anchor-chunk` at a time
(by default as many as keep those probabilities near 1 GB): each group of
blocks gets its own forward and backward pass and the gradients are summed,
weighted by the group's share of the blocks. Blocks never see each other, so
this is the same loss and the same gradients (tested).

`--max-memory-gb` lowers both budgets (`memory_budgets`); the trainer stops
after the first step if MLX's peak went beyond it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn
from mlx.utils import tree_map

from ..targets.adapter import TargetAdapter
from .batches import Sequence, step_batch
from .chunked_loss import LOGIT_ELEMENTS_PER_CHUNK, auto_chunk_rows, chunked_step
from .features import FeatureStore
from .loss import accepted_prefix, block_loss, row_weights
from .model_forward import training_logits
from .options import TrainOptions

ATTENTION_BYTES = 1 << 30  # budget of the drafter's kept attention probabilities per anchor group


def auto_anchor_chunk(
    drafter, batch: int, anchors: int, block: int, context: int, budget: int = ATTENTION_BYTES
) -> int:
    """Anchors per group so that the kept attention probabilities stay near `budget` bytes."""
    cfg = drafter.config
    keys = context + anchors * block
    per_anchor = 2 * 4 * batch * cfg.num_attention_heads * block * keys * cfg.num_hidden_layers
    return max(1, min(anchors, int(budget) // max(per_anchor, 1)))


def memory_budgets(max_memory_gb: float | None) -> tuple[int, int]:
    """(logit elements per chunk, attention bytes per anchor group): the defaults, or
    an eighth and a quarter of `--max-memory-gb` when that is smaller."""
    if max_memory_gb is None:
        return LOGIT_ELEMENTS_PER_CHUNK, ATTENTION_BYTES
    limit = max_memory_gb * 1e9
    return min(LOGIT_ELEMENTS_PER_CHUNK, int(limit / 8 / 4)), min(ATTENTION_BYTES, int(limit / 4))


def _add(total, grads, scale):
    scaled = tree_map(lambda g: g * scale, grads)
    return scaled if total is None else tree_map(lambda a, b: a + b, total, scaled)


def make_optimizer(options: TrainOptions) -> optim.AdamW:
    """AdamW; linear warmup over `warmup` of the steps, then cosine decay to 0."""
    options = options.resolved()
    warmup = round(options.warmup * options.steps)
    decay = optim.cosine_decay(options.lr, max(options.steps - warmup, 1))
    schedule = decay
    if warmup > 0:
        schedule = optim.join_schedules([optim.linear_schedule(0.0, options.lr, warmup), decay], [warmup])
    return optim.AdamW(learning_rate=schedule, weight_decay=options.weight_decay)


class StepRunner:
    """One optimisation step on a batch: features, loss, gradients, clipping, update."""

    def __init__(
        self,
        drafter,
        target: TargetAdapter,
        store: FeatureStore,
        optimizer,
        options: TrainOptions,
        num_replay: int = 0,
    ):
        self.drafter, self.target, self.store, self.optimizer = drafter, target, store, optimizer
        self.options = options
        self.num_replay = num_replay
        self.replay_per_batch = 0
        if num_replay:
            self.replay_per_batch = min(
                max(1, round(options.replay_ratio * options.batch_size)), options.batch_size - 1
            )
        self.weights = row_weights(options.block_size, options.loss_decay)
        logit_elements, self.attention_bytes = memory_budgets(options.max_memory_gb)
        self.chunk_rows = options.loss_chunk_rows or auto_chunk_rows(target.vocab_size, logit_elements)
        self.loss_and_grad = nn.value_and_grad(drafter, self._loss)

    def _loss(self, features, block_ids, anchors, targets, valid):
        logits = training_logits(self.drafter, self.target, features, block_ids, anchors)
        loss, blocks = block_loss(logits, targets, valid, self.weights)
        prefix = accepted_prefix(mx.stop_gradient(logits), targets, valid)
        block_valid = valid.any(axis=-1)
        tau = (prefix * block_valid).sum() / mx.maximum(blocks, 1.0)
        return loss, tau

    def _group(self, features, block_ids, anchors, targets, valid):
        """(loss, tau, grads) of some blocks, the logits chunked when their rows exceed one chunk."""
        if targets.size <= self.chunk_rows:
            (loss, tau), grads = self.loss_and_grad(features, block_ids, anchors, targets, valid)
            return loss, tau, grads
        return chunked_step(
            self.drafter, self.target, features, block_ids, anchors, targets, valid, self.weights, self.chunk_rows
        )

    def anchor_group(self, batch: int, anchors: int, context: int) -> int:
        """Anchors per forward/backward group: `--anchor-chunk`, else as the attention budget allows."""
        o = self.options
        return o.anchor_chunk or auto_anchor_chunk(
            self.drafter, batch, anchors, o.block_size, context, self.attention_bytes
        )

    def loss_and_grads(self, features, batch):
        """(loss, tau, grads) of a batch: its anchors in groups, each group's rows in chunks."""
        B, K = batch.anchors.shape
        b = self.options.block_size
        group = self.anchor_group(B, K, features.shape[1])
        if group >= K:
            return self._group(features, batch.block_ids, batch.anchors, batch.targets, batch.valid)
        per_group = batch.valid.any(axis=-1).astype(mx.float32)
        total = max(per_group.sum().item(), 1.0)
        loss = tau = grads = None
        for start in range(0, K, group):
            sl = slice(start, start + group)
            share = per_group[:, sl].sum().item() / total
            if share == 0:
                continue
            part = self._group(
                features,
                batch.block_ids[:, start * b : (start + group) * b],
                batch.anchors[:, sl],
                batch.targets[:, sl],
                batch.valid[:, sl],
            )
            loss = part[0] * share if loss is None else loss + part[0] * share
            tau = part[1] * share if tau is None else tau + part[1] * share
            grads = _add(grads, part[2], share)
            mx.eval(loss, tau, grads)
        return loss, tau, grads

    def __call__(self, step: int, sequences: list[Sequence], mask_id: int, pad_id: int) -> dict[str, float]:
        o = self.options
        indices, batch = step_batch(
            step,
            sequences,
            batch_size=o.batch_size,
            anchors_per_seq=o.anchors_per_seq,
            block_size=o.block_size,
            mask_id=mask_id,
            seed=o.seed,
            pad_id=pad_id,
            num_replay=self.num_replay,
            replay_per_batch=self.replay_per_batch,
        )
        features = self.store.batch_features(indices, batch, [sequences[i] for i in indices])
        loss, tau, grads = self.loss_and_grads(features, batch)
        grads, grad_norm = optim.clip_grad_norm(grads, o.grad_clip)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, loss, tau, grad_norm)
        lr = self.optimizer.learning_rate.item()  # the rate this update used
        return {
            "loss": loss.item(),
            "tau": tau.item(),
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens": batch.tokens,
            "replay_sequences": sum(i >= len(sequences) - self.num_replay for i in indices) if self.num_replay else 0,
        }

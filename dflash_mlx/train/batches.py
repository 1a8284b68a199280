"""Training batches: which sequences each step uses, random anchors, packed blocks.

A training sequence is a prompt followed by the target's own response. Each
step takes `batch_size` sequences and, per sequence, up to `anchors` random
anchor positions in the response (spec section 7). A block is the clean anchor
token followed by b - 1 mask tokens; its row k (k >= 1) must predict the token
k places after the anchor. All blocks of one sequence are packed into one query
sequence of K * b rows (see `dflash_mlx.train.masks` for who sees what).

Anchors are stratified: the response is cut into `anchors` equal spans and one
anchor is drawn in each, so a long response is covered end to end (a block at
a deep position sees the whole long context before it) instead of by chance.

With a replay set (`--replay`), the last `num_replay` sequences form a second
pool and every batch takes `replay_per_batch` of its sequences from it, each
pool in its own per-epoch order.

Everything a step draws is a pure function of (seed, step): the sequence order
of each epoch and the anchors. A resumed run therefore replays exactly the
batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Sequence:
    """Token ids of prompt + response; anchors come from the response part."""

    ids: tuple[int, ...]
    prompt_len: int

    @property
    def anchor_range(self) -> range:
        """Anchor positions: response tokens that still have a next token."""
        return range(self.prompt_len, len(self.ids) - 1)


@dataclass
class TrainBatch:
    """One step's arrays. B sequences, K blocks each, block size b, padded length L."""

    ids: mx.array  # [B, L] int32: the sequences, right-padded (the target's input)
    lengths: list[int]  # real length of each sequence
    block_ids: mx.array  # [B, K * b] int32: [anchor, mask * (b - 1)] per block
    anchors: mx.array  # [B, K] int32: anchor positions (0 for padding blocks)
    targets: mx.array  # [B, K, b - 1] int32: the tokens rows 1..b-1 must predict
    valid: mx.array  # [B, K, b - 1] bool: False past a sequence's end / for padding blocks

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def batches_per_epoch(num_sequences: int, batch_size: int) -> int:
    return max(1, num_sequences // batch_size)


def step_position(step: int, num_sequences: int, batch_size: int) -> tuple[int, int]:
    """(epoch, batch index within the epoch) of 0-based `step`."""
    per_epoch = batches_per_epoch(num_sequences, batch_size)
    return divmod(step, per_epoch)


def step_indices(step: int, num_sequences: int, batch_size: int, seed: int, stream: int = 0) -> list[int]:
    """Sequence indices used by 0-based `step`: a fresh permutation every epoch."""
    epoch, i = step_position(step, num_sequences, batch_size)
    order = np.random.default_rng([seed, 0, epoch] if stream == 0 else [seed, 3, stream, epoch])
    order = order.permutation(num_sequences)
    return [int(j) for j in order[i * batch_size : (i + 1) * batch_size]]


def mixed_step_indices(
    step: int, num_sequences: int, batch_size: int, seed: int, num_replay: int = 0, replay_per_batch: int = 0
) -> list[int]:
    """Indices of `step` when the last `num_replay` sequences are a replay pool.

    `batch_size - replay_per_batch` come from the first pool, `replay_per_batch`
    from the replay pool (each pool has its own epochs).
    """
    if num_replay == 0 or replay_per_batch == 0:
        return step_indices(step, num_sequences, batch_size, seed)
    num_new = num_sequences - num_replay
    new = step_indices(step, num_new, batch_size - replay_per_batch, seed)
    old = step_indices(step, num_replay, replay_per_batch, seed, stream=1)
    return new + [num_new + j for j in old]


def sample_anchors(rng: np.random.Generator, seq: Sequence, count: int) -> list[int]:
    """Up to `count` distinct anchor positions, sorted: one in each of `count` equal spans."""
    positions = seq.anchor_range
    n = len(positions)
    if n <= count:
        return list(positions)
    edges = np.ceil(np.linspace(0, n, count + 1)).astype(np.int64)  # spans of >= 1 position
    picked = edges[:-1] + (rng.random(count) * (edges[1:] - edges[:-1])).astype(np.int64)
    return [positions[int(i)] for i in picked]


def make_batch(
    seqs: list[Sequence],
    anchors: list[list[int]],
    block_size: int,
    mask_id: int,
    pad_id: int = 0,
    blocks_per_seq: int | None = None,
) -> TrainBatch:
    """Pack the blocks at `anchors[i]` of each sequence `seqs[i]`."""
    b = block_size
    K = blocks_per_seq or max(len(a) for a in anchors)
    L = max(len(s.ids) for s in seqs)
    B = len(seqs)
    ids = np.full((B, L), pad_id, np.int32)
    block_ids = np.full((B, K, b), mask_id, np.int32)
    anchor_arr = np.zeros((B, K), np.int32)
    targets = np.zeros((B, K, b - 1), np.int32)
    valid = np.zeros((B, K, b - 1), bool)
    for i, (seq, points) in enumerate(zip(seqs, anchors)):
        if len(points) > K:
            raise ValueError(f"sequence {i} has {len(points)} anchors, more than {K}.")
        row = np.asarray(seq.ids, np.int32)
        ids[i, : len(row)] = row
        for j, p in enumerate(points):
            if not seq.prompt_len <= p < len(row) - 1:
                raise ValueError(f"anchor {p} is outside the response of sequence {i}.")
            block_ids[i, j, 0] = row[p]
            anchor_arr[i, j] = p
            following = row[p + 1 : p + b]
            targets[i, j, : len(following)] = following
            valid[i, j, : len(following)] = True
    return TrainBatch(
        ids=mx.array(ids),
        lengths=[len(s.ids) for s in seqs],
        block_ids=mx.array(block_ids.reshape(B, K * b)),
        anchors=mx.array(anchor_arr),
        targets=mx.array(targets),
        valid=mx.array(valid),
    )


def step_batch(
    step: int,
    sequences: list[Sequence],
    *,
    batch_size: int,
    anchors_per_seq: int,
    block_size: int,
    mask_id: int,
    seed: int,
    pad_id: int = 0,
    num_replay: int = 0,
    replay_per_batch: int = 0,
) -> tuple[list[int], TrainBatch]:
    """The sequence indices and the batch of 0-based `step` (deterministic in seed, step)."""
    indices = mixed_step_indices(step, len(sequences), batch_size, seed, num_replay, replay_per_batch)
    rng = np.random.default_rng([seed, 1, step])
    seqs = [sequences[i] for i in indices]
    anchors = [sample_anchors(rng, s, anchors_per_seq) for s in seqs]
    return indices, make_batch(seqs, anchors, block_size, mask_id, pad_id)


def build_sequences(
    prompts: list[list[int]], responses: list[list[int]], max_length: int
) -> tuple[list[Sequence], int]:
    """Prompt + response sequences cut to `max_length`; drop those with no anchor.

    Returns (sequences, number dropped): a sequence needs at least two response
    tokens inside `max_length` (an anchor and one token to predict).
    """
    kept, dropped = [], 0
    for prompt, response in zip(prompts, responses):
        ids = tuple(prompt) + tuple(response)
        seq = Sequence(ids=ids[:max_length], prompt_len=len(prompt))
        if len(seq.anchor_range) >= 1:
            kept.append(seq)
        else:
            dropped += 1
    return kept, dropped

"""Loading a pair with the target tensor-sharded over a distributed group.

`load_sharded(choice, group)` checks, on every rank at once (`group.agree`),
before any weight is read: that dflash-mlx can run the target
(`targets.adapter.target_problem`) and mlx-lm can shard it (`targets.families.shard_problem`: its heads and
hidden sizes divide by the group size), and that every rank holds the same
model files (`fingerprint`: names, sizes and the first and last MiB of each
file, hashed, compared across ranks). Then the target goes through mlx-lm's
`sharded_load(tensor_group=group)`, the drafter is loaded whole on every
rank (it is small) and checked against the target as on one machine, and
the ranks agree on a random seed, so sampled runs without a seed stay in
lockstep. Pipeline sharding is refused with an explanation.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import mlx.core as mx

from ..draft.load import load_draft, resolve_model_dir
from ..models.dtype import as_float32, on_cpu, target_float_dtype
from ..targets.adapter import UnsupportedTargetError, target_problem
from ..targets.families import shard_problem
from .group import ShardError, agree, broadcast, same_everywhere, world

SHARD_MODES = ("tensor", "pipeline")
EDGE_BYTES = 1 << 20  # hashed from each end of every file
METADATA = ["*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


def check_shard_mode(shard: str | None) -> None:
    if shard is None or shard == "tensor":
        return
    if shard == "pipeline":
        raise ValueError(
            "shard='pipeline' is not supported: the drafter reads hidden states of target layers that a "
            "pipeline spreads over different ranks, and DFlash's verify would wait on every stage in turn. "
            "Use shard='tensor' (every rank computes every layer on a slice of the heads)."
        )
    raise ValueError(f"shard: expected None, 'tensor' or 'pipeline', got {shard!r}.")


def fingerprint(directory: Path) -> bytes:
    """A cheap digest of a model directory: each file's name, size and first and last MiB."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(directory)}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(EDGE_BYTES))
            if size > 2 * EDGE_BYTES:
                f.seek(size - EDGE_BYTES)
                digest.update(f.read(EDGE_BYTES))
    return digest.digest()


def _preflight(choice, ranks: int) -> bytes:
    """This rank's checks before loading; returns the fingerprint of its model files."""
    from mlx_lm.utils import load_model

    target_dir = resolve_model_dir(choice.target, "target model", METADATA)
    model, _ = load_model(target_dir, lazy=True, strict=False)  # lazy: no weight is read
    problem = target_problem(model)
    if problem is not None:
        raise UnsupportedTargetError(f"{choice.target}: {problem}")
    problem = shard_problem(model, ranks)
    if problem is not None:
        raise UnsupportedTargetError(f"{choice.target}: cannot tensor-shard over {ranks} ranks: {problem}")
    digest = fingerprint(target_dir)
    if choice.draft is not None:
        digest += fingerprint(resolve_model_dir(choice.draft))
    return hashlib.sha256(digest).digest()


def _load_target(choice, group):
    from mlx_lm.utils import sharded_load

    model, tokenizer = sharded_load(str(choice.target), tensor_group=group)
    if on_cpu():
        as_float32(model)
    return model, tokenizer


def load_sharded(
    choice, group: mx.distributed.Group | None = None, *, draft_bits: int | None = None, draft_group_size: int = 64
):
    """(model, tokenizer, drafter or None) on every rank of `group` (default: `mx.distributed.init()`)."""
    group = group or world()
    digest = agree(group, _preflight, choice, group.size())
    differ = same_everywhere(group, digest)
    if differ:
        raise ShardError(
            f"rank {differ[0]}'s model files differ from rank 0's ({choice.target}"
            f"{', ' + str(choice.draft) if choice.draft else ''}): every machine needs the same "
            "copy of the target and the drafter.",
            differ[0],
            group,
        )
    model, tokenizer = agree(group, _load_target, choice, group)
    drafter = None
    if choice.draft is not None:
        drafter = agree(
            group,
            load_draft,
            choice.draft,
            model,
            bits=draft_bits,
            group_size=draft_group_size,
            dtype=target_float_dtype(model),
            target_name=choice.label,
        )
    seed = broadcast(group, random.getrandbits(31).to_bytes(4, "little") if group.rank() == 0 else None)
    mx.random.seed(int.from_bytes(seed, "little"))
    return model, tokenizer, drafter

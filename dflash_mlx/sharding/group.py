"""The distributed group of a sharded run and the collectives its ranks agree through.

The ranks run in lockstep, so a step that can fail on one rank only (a
missing file, a model that does not divide) must not leave the others
waiting in a collective: `agree(group, fn)` runs a step on every rank and
then exchanges whether it failed (one small all_gather), so all ranks raise
together, the leader with the first failing rank's message. `broadcast`
sends the leader's bytes to every rank; `same_everywhere` compares a digest
across ranks. These control collectives run on the CPU stream, as mlx-lm's
own synchronisation does, after the generation streams have finished what
they were given (`_quiesce`): a verify still in flight (the engine queues
the next step before it reads the current one) does its own collectives,
and two collectives in flight on different streams could pair up
differently on different ranks.
"""

from __future__ import annotations

import mlx.core as mx

MESSAGE_BYTES = 2048  # an error message, as utf-8, cut to this


class ShardError(RuntimeError):
    """A sharded run cannot go on (raised on every rank; `rank` is the rank that failed)."""

    def __init__(self, message: str, rank: int = 0, group=None):
        super().__init__(message)
        self.rank = rank
        self.group = group  # every rank of it raised this error (see `raised_everywhere`)


def raised_everywhere(error: BaseException):
    """The group whose every rank raised `error` (through `agree` or a comparison), else None."""
    return getattr(error, "group", None) if isinstance(error, Exception) else None


def barrier(group) -> None:
    """Wait until every rank of `group` gets here (e.g. rank 0 printed the error all ranks exit on)."""
    if group is not None and group.size() > 1:
        _quiesce()
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def world() -> mx.distributed.Group:
    """The group `mlx.launch` started this process in (a group of one without it)."""
    return mx.distributed.init()


def is_leader(group: mx.distributed.Group | None) -> bool:
    """Whether this process prints, serves and writes files (rank 0, or not sharded)."""
    return group is None or group.rank() == 0


def _quiesce() -> None:
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


def _as_ints(data: bytes, size: int) -> mx.array:
    values = list(data[:size]) + [0] * (size - min(len(data), size))
    return mx.array(values, dtype=mx.int32)


def _gather(group, row: mx.array) -> list[list[int]]:
    _quiesce()
    out = mx.distributed.all_gather(row[None], group=group, stream=mx.cpu)
    return out.tolist()


def agree(group: mx.distributed.Group | None, fn, *args, **kwargs):
    """fn(*args, **kwargs) on every rank; if it raised on any rank, raise on every rank.

    The failing rank re-raises its own exception; the others raise `ShardError`
    with its message ("rank N: ..."), so the leader can print one clear line.
    """
    if group is None or group.size() == 1:
        return fn(*args, **kwargs)
    error, result = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        error = e
    text = b"" if error is None else (str(error).strip("'\"") or type(error).__name__).encode()[: MESSAGE_BYTES - 1]
    flag = b"" if error is None else b"\x01" + text
    rows = _gather(group, _as_ints(flag, MESSAGE_BYTES))
    if error is not None:
        try:
            error.group = group  # (see `raised_everywhere`)
        except AttributeError:
            pass
        raise error
    for rank, row in enumerate(rows):
        if row[0] == 1:
            message = bytes(v for v in row[1:] if v).decode(errors="replace")
            raise ShardError(f"rank {rank}: {message}", rank, group)
    return result


def broadcast(group: mx.distributed.Group | None, data: bytes | None) -> bytes:
    """The leader's `data` on every rank (the others pass None)."""
    if group is None or group.size() == 1:
        return data or b""
    leader = group.rank() == 0
    _quiesce()
    n = mx.array([len(data) if leader else 0], dtype=mx.int32)
    n = int(mx.distributed.all_sum(n, group=group, stream=mx.cpu).item())
    if n == 0:
        return b""
    payload = _as_ints(data if leader else b"", n)
    payload = mx.distributed.all_sum(payload, group=group, stream=mx.cpu)
    return bytes(payload.tolist())


def broadcast_floats(group: mx.distributed.Group | None, values: list[float] | None, count: int) -> list[float]:
    """The leader's `count` floats on every rank (float32: what a cost curve needs)."""
    if group is None or group.size() == 1:
        return list(values or [])
    mine = values if group.rank() == 0 else [0.0] * count
    _quiesce()
    return mx.distributed.all_sum(mx.array(mine, dtype=mx.float32), group=group, stream=mx.cpu).tolist()


def same_everywhere(group: mx.distributed.Group | None, digest: bytes) -> list[int]:
    """The ranks whose `digest` differs from the leader's (empty: all equal)."""
    if group is None or group.size() == 1:
        return []
    rows = _gather(group, _as_ints(digest, len(digest)))
    return [rank for rank, row in enumerate(rows) if row != rows[0]]

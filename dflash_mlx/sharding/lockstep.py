"""The proof that the ranks of a sharded run generated the same tokens.

Ranks decide everything alike (same logits after the sharded layers' sums,
same seeds, the same calibration, broadcast from rank 0), so no decision is
exchanged while generating. Should they still diverge (a rank seeded
differently, a nondeterministic kernel), their outputs would silently
differ: `check_lockstep` compares a digest of each rank's tokens at the end
of every sharded generation (one small all_gather) and raises on every rank.
Ranks that diverge so far that their collectives no longer match (one rank
verifying while another has finished) fail or stall in MLX's backend
before this check is reached: it catches what would otherwise go unnoticed.
"""

from __future__ import annotations

import hashlib
import struct

from .group import ShardError, same_everywhere


class LockstepError(ShardError):
    """The ranks of a sharded run generated different tokens."""


def check_lockstep(group, tokens: list[int]) -> None:
    if group is None or group.size() == 1:
        return
    digest = hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).digest()
    differ = same_everywhere(group, digest)
    if differ:
        raise LockstepError(
            f"The ranks diverged: rank {differ[0]} generated other tokens than rank 0 ({len(tokens)} tokens "
            "here). Every rank must make the same calls with the same arguments and seeds.",
            differ[0],
            group,
        )

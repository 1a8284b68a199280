"""Several drafters for one target, one of them drafting each generation (`RatedChoice`).

A target with a registered drafter whose checkpoint also keeps its own MTP
heads has two: the block policy picks one per generation by expected rate
(`policy.adaptive.choose_source`: each member's acceptance history over its
cost curve) and `activate`s it. The target captures what every member reads
(the union of their layers; the final hidden state if one reads it), and each
member is handed its own columns. Until a generation's member is chosen (a
batch row prefills before its policy is made) every member is fed; from then
on only the chosen one, so a member that sat a generation out starts the next
with the positions it never saw skipped (drafts get worse, output does not
change). Everything else (`name`, `drafter`, `draft_logits`, `batch_key`,
the context a batch reads, ...) is the active member's.
"""

from __future__ import annotations

import mlx.core as mx

from .base import reads_features, source_name


class RatedChoice:
    """`members[active]` drafts; `activate(i)` chooses the member of the next (or the current) generation."""

    def __init__(self, members: list, active: int = 0):
        if len(members) < 2:
            raise ValueError("a RatedChoice needs at least two members")
        self.members = list(members)
        self.active = active
        self.layer_ids = tuple(dict.fromkeys(i for m in members for i in m.layer_ids))
        self.reads_final = any(getattr(m, "reads_final", False) for m in members)
        self.block_size = max(m.block_size for m in members)
        self.target = None
        self._chosen = False  # `activate` chose the next generation's member before it started
        self._decided = False  # this generation's member is chosen: only it is fed
        self._columns: list[mx.array | None] | None = None

    @property
    def current(self):
        return self.members[self.active]

    @property
    def name(self) -> str:
        return source_name(self.current)

    @property
    def source(self) -> str:
        """How commands name it: each member's drafter (a checkpoint's path or repo id, or its source name)."""
        names = []
        for m in self.members:
            drafter = getattr(m, "drafter", None)
            names.append(str(getattr(m, "source", None) or getattr(drafter, "source", None) or source_name(m)))
        return " + ".join(names)

    @property
    def drafter(self):
        """The active member's drafter (calibration keys and acceptance histories are per member)."""
        return getattr(self.current, "drafter", self.current)

    def activate(self, index: int) -> None:
        """Draft with member `index`: in this generation where it is still undecided (every member was fed), else
        from the next one on."""
        undecided = self.target is not None and not self._decided
        self.active, self._decided = index, True
        self._chosen = not undecided

    def fork(self, context: bool = False) -> RatedChoice:
        other = RatedChoice([m.fork(context) for m in self.members], self.active)
        other._chosen, other._decided = self._chosen, self._decided
        if context:
            other.target, other._columns = self.target, self._columns
        return other

    def with_active(self, index: int) -> RatedChoice:
        """An independent copy drafting with member `index` (how the policy times that member)."""
        trial = self.fork()
        trial.activate(index)
        return trial

    def start(self, target, prompt: mx.array, reused: int = 0) -> None:
        self.target, self._decided, self._chosen = target, self._chosen, False
        self._columns = self._columns or self._member_columns(target.hidden_size)
        for i in self._fed():
            self.members[i].start(target, prompt, reused)

    def add_context(self, features: mx.array) -> None:
        for i in self._fed():
            if reads_features(self.members[i]):
                self.members[i].add_context(mx.take(features, self._columns[i], axis=-1))

    def state(self) -> list:
        return [a for i in self._fed() for a in self.members[i].state()]

    def propose(self, anchor: mx.array, position: int, count: int, *, sampling=None, key=None):
        self._decided = True
        return self.current.propose(anchor, position, count, sampling=sampling, key=key)

    @property
    def draft_logits(self):
        """The active member's `draft_logits` (an AttributeError where it has none, as for an MTP head)."""
        self._decided = True
        return self.current.draft_logits

    def __getattr__(self, name: str):
        if name.startswith("__") or "members" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.current, name)

    def _fed(self) -> list[int]:
        return [self.active] if self._decided else list(range(len(self.members)))

    def _member_columns(self, hidden: int) -> list[mx.array | None]:
        """Each member's feature columns within the union the target captures."""
        slots = {layer: s for s, layer in enumerate(self.layer_ids)}
        final = len(self.layer_ids) * hidden
        columns = []
        for m in self.members:
            blocks = [range(slots[i] * hidden, (slots[i] + 1) * hidden) for i in m.layer_ids]
            if getattr(m, "reads_final", False):
                blocks.append(range(final, final + 2 * hidden))
            columns.append(mx.array([c for b in blocks for c in b], mx.int32) if blocks else None)
        return columns

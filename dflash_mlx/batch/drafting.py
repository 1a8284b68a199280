"""A batch's drafts: every row's plan (`planner.CyclePlanner.plan_at`) turned into drafts of one width.

Rows whose drafter proposers share a `batch_key` (`proposers.base`: DFlash v1
proposers of one drafter) draft in one forward over their contexts read as
one batch (`draft_logits_together`); each row then chooses its drafts from
its own logits as its own call would (argmax, a sample of q, or under its
grammar). Other rows draft one by one through their planner (a span source's
span, a proposer without the hooks). Drafts only decide how many tokens a
verify accepts, never which, so every row's output is what it is alone. A
row whose grammar fails while drafting (`faulted`) drafts nothing and leaves
after the step; the other rows are untouched.
"""

from __future__ import annotations

from collections import defaultdict

import mlx.core as mx

from ..planner import Plan
from ..proposers.base import Proposal
from ..structured.constraint import GrammarFault


def propose_rows(rows: list, plans: list[Plan], count: int) -> list[Proposal | None]:
    """Every drafting row's proposal after its anchor: `count` drafter tokens, or its span as long as it is
    (None for a plain row). rows: `engine.BatchRow`s, plans: theirs."""
    groups: dict = defaultdict(list)
    for i, plan in enumerate(plans):
        key = getattr(plan.source, "batch_key", None) if plan.width > 1 and not plan.spans else None
        groups[key() if callable(key) else None].append(i)
    out: list[Proposal | None] = [None] * len(rows)
    for key, members in groups.items():
        if key is not None and len(members) > 1:
            for i, proposal in zip(members, _together([rows[i] for i in members], count)):
                out[i] = proposal
            continue
        for i in members:
            row, plan = rows[i], plans[i]
            anchor = mx.array([row.anchor], mx.int32)
            out[i] = faulted(row, row.planner.draft, plan, anchor, row.position, None if plan.spans else count)
    return out


def _together(rows: list, count: int) -> list[Proposal]:
    """Proposals of rows whose proposers draft together: one forward, then each row's choice."""
    proposers = [r.session.proposer for r in rows]
    logits = proposers[0].draft_logits_together(proposers, [r.anchor for r in rows], [r.position for r in rows], count)
    if all(r.acceptor.draft_settings is None and r.acceptor.constraint is None for r in rows):
        # greedy drafts: one argmax for all rows
        for r in rows:
            r.acceptor.next_key()  # (the keys a row draws stay those of its own proposer calls)
        best = mx.argmax(logits, axis=-1).astype(mx.int32)
        return [Proposal(tokens=best[i]) for i in range(len(rows))]
    return [faulted(r, r.planner.drafts_from_logits, logits[i], r.position) for i, r in enumerate(rows)]


def faulted(row, stage, *args):
    """`stage(*args)`, one row's own grammar work; None when its grammar fails there (`row.fault` is set: the
    row leaves after this step, the others go on)."""
    try:
        return stage(*args)
    except GrammarFault as e:
        row.fault = e
        return None

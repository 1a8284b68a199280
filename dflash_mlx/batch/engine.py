"""Batched DFlash: the rows of several requests drafted, verified in one target forward, accepted apart.

`BatchDecoder` holds active rows. A row joins with its own session (its
prompt prefilled alone, through the single-request engine, which also gives
its first token), its own `Acceptor` (sampler settings, logits processors,
seed) and its limits; its caches then move into the batch's (`ragged_cache`).
Each `step()`: the rows' blocks are drafted (one drafter forward for all, see
`drafting`),
the target verifies all rows in one forward ([B, b] ids, per-row positions
and masks), each row's acceptor judges its own rows, and each row keeps its
own accepted prefix (a ragged KV row is shortened; a Gated DeltaNet row is
replayed over its kept rows). A row that stops (a stop token, its
max_tokens) leaves: its caches go back to its session, which a prompt cache
can keep. A row whose grammar fails (`structured.GrammarFault`: a limit
of the grammar library met mid-output) leaves at that step with its `fault`
and no tokens; the other rows go on. The output of every row is what it
would be served alone.

Every row of a step verifies the same block b: the decoder's fixed block,
or with a `block_choice.BatchBlockChoice` the b that maximises the batch's
expected tokens per second (plain batched decoding, b = 1, included); a row
alone in the batch plans as a single request does (`_alone`: its planner's
`plan`, its `policy.adaptive` policy choosing among plain decoding, its
drafter and its span sources; its acceptance estimate it also brings to the
batch). A row may fix its own block (`max_block`): a batch of such rows
verifies the largest, and a row's drafts past its own block are ignored; a
row needing fewer tokens takes its cut at acceptance. A step is widened to
draft a run of tokens a row's grammar forces (`structured`). What each row
drafts at the step's width is its `planner.CyclePlanner`'s, the same one the
single-request loop asks: a span source's span (copy-aware drafting, `lookup`;
a suffix index across requests, `suffix`: a point mass up to its block, the
slots past it ignored) where one is expected to commit more tokens than its
drafter's block at that width (a row with a fixed block: wherever a source
offers one), else its drafter's drafts (`drafting`: rows of one drafter in one
forward). A step runs in named parts: its width
(`_width`), the drafts (`_draft`), the verify, the verdicts (`_verdicts`),
each row's share (`_take`), what the policies learn (`_learn`) and the caches
cut back (`_cut`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ..acceptance import Acceptor
from ..engine import speculative_cycles
from ..models.block_size import check_block_size
from ..policy.adaptive import AdaptiveBlock, adaptive_policy, choose_source
from ..policy.calibration import cost_model
from ..planner import CyclePlanner, Plan
from ..policy.base import FixedBlock
from ..policy.estimate import AcceptanceEstimate
from ..sampling import log_softmax
from ..session import Session
from ..targets.rollback import rollback
from .block_choice import BatchBlockChoice
from .drafting import faulted, propose_rows
from .prefill import prefill_together
from .ragged_cache import batch_layer, batch_problem, keep_rows, unbatch_layer


@dataclass
class BatchRow:
    """One request in the batch."""

    uid: int
    session: Session
    acceptor: Acceptor
    max_tokens: int  # -1: no limit
    stop_tokens: frozenset
    max_block: int  # this row's largest block
    fixed: bool  # the caller fixed it (`insert(max_block=...)`)
    estimate: AcceptanceEstimate  # its drafts' acceptance (for the block choice)
    policy: AdaptiveBlock | None = None  # its single-request policy (the block while it is alone)
    planner: CyclePlanner | None = None  # its sources (drafter, span source), acceptor and limits
    anchor: int = 0  # the last committed token, not yet fed
    position: int = 0  # the anchor's position
    committed: int = 0
    finish: str | None = None
    fault: Exception | None = None  # its grammar failed (`structured.GrammarFault`): it leaves at this step


@dataclass
class RowTokens:
    """What one step committed for one row."""

    uid: int
    tokens: list[int]
    logprobs: mx.array  # [len(tokens), V], lazy
    drafted: int
    block_size: int
    finish: str | None  # "stop", "length" or None
    source: str = "target"  # what drafted its accepted drafts: a source's name
    fault: Exception | None = None  # the row's grammar failed: it left with no tokens ("error")


class BatchDecoder:
    """Rows of one target (and one drafter kind) decoded together; see the module docstring."""

    def __init__(self, target, block_size: int, choice: BatchBlockChoice | None = None):
        """`block_size`: every step's block, or with `choice` the largest (a row's default cap)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        problem = batch_problem(target.model)
        if problem:
            raise ValueError(problem[0].upper() + problem[1:] + ".")
        self.target = target
        self.block_size = block_size
        self.choice = choice
        self.rows: list[BatchRow] = []
        self._cache: list | None = None  # the batch's caches while rows are in it
        self._next_uid = 0
        self._costs: dict = {}  # (max block, sampled, drafter) -> the single-request cost model of this setup

    # -- rows joining and leaving ---------------------------------------------------------------

    def insert(
        self,
        session: Session,
        prompt: mx.array,
        acceptor: Acceptor,
        *,
        max_tokens: int,
        stop_tokens=(),
        prefill_step_size: int = 2048,
        max_block: int | None = None,
        lookup: bool = False,
        suffix=None,
    ) -> RowTokens:
        """Prefill a request alone and add it to the batch; returns its first token.

        `max_block` fixes this row's block (default: the decoder's block, or its choice): a step
        verifies that block when every row fixes one (the largest), else the decoder's choice, and
        a row's drafts past its own block are ignored. `lookup`: its drafting steps may verify a lookup
        span where its context has a match; `suffix` (a `proposers.suffix.SuffixIndex`): a span from
        what earlier generations produced, and it records this one (see the module docstring)."""
        if session.model is not self.target.model:
            raise ValueError("The session was made for another target model.")
        self._unbatch()
        cycles = speculative_cycles(
            session.target,
            prompt,
            session.proposer,
            max_tokens=1,
            block_size=1,
            prefill_step_size=prefill_step_size,
            acceptor=acceptor,
            stop_tokens=stop_tokens,
            session=session,
        )
        first = next(cycles)
        cycles.close()
        return self._add_row(
            session,
            prompt,
            acceptor,
            max_tokens,
            stop_tokens,
            first.tokens,
            first.logprobs,
            first.stopped,
            max_block,
            lookup,
            suffix,
        )

    def insert_many(self, requests: list[tuple], *, stop_tokens=(), prefill_step_size: int = 2048) -> list[RowTokens]:
        """`insert` for several (session, prompt, acceptor, max_tokens[, max_block[, lookup[, suffix]]]) at
        once: fresh sessions are prefilled together in one forward (`prefill`), the others alone; results
        in request order."""
        requests = [tuple(r) + (None, False, None)[len(r) - 4 :] for r in requests]
        together = [
            k
            for k, (session, prompt, *_) in enumerate(requests)
            if self.prefills_together(session, prompt.size, prefill_step_size)
        ]
        if len(together) < 2:
            return [
                self.insert(
                    s,
                    p,
                    a,
                    max_tokens=m,
                    stop_tokens=stop_tokens,
                    prefill_step_size=prefill_step_size,
                    max_block=cap,
                    lookup=look,
                    suffix=suffix,
                )
                for s, p, a, m, cap, look, suffix in requests
            ]
        for session, *_ in requests:
            if session.model is not self.target.model:
                raise ValueError("The session was made for another target model.")
        self._unbatch()
        chosen = [requests[k] for k in together]
        firsts = prefill_together(
            self.target, [r[0] for r in chosen], [r[1].tolist() for r in chosen], [r[2] for r in chosen]
        )
        results: dict[int, RowTokens] = {}
        for k, (token, logprobs) in zip(together, firsts):
            session, prompt, acceptor, max_tokens, cap, look, suffix = requests[k]
            stopped = token in stop_tokens
            results[k] = self._add_row(
                session, prompt, acceptor, max_tokens, stop_tokens, [token], logprobs, stopped, cap, look, suffix
            )
        for k, (session, prompt, acceptor, max_tokens, cap, look, suffix) in enumerate(requests):
            if k not in results:
                results[k] = self.insert(
                    session,
                    prompt,
                    acceptor,
                    max_tokens=max_tokens,
                    stop_tokens=stop_tokens,
                    prefill_step_size=prefill_step_size,
                    max_block=cap,
                    lookup=look,
                    suffix=suffix,
                )
        return [results[k] for k in range(len(requests))]

    @staticmethod
    def prefills_together(session, prompt_tokens: int, prefill_step_size: int) -> bool:
        """Whether `insert_many` prefills this request in one forward with the other such requests
        (a fresh session and a prompt of one chunk), not alone."""
        return not session.tokens and 2 <= prompt_tokens <= prefill_step_size

    def _add_row(
        self,
        session,
        prompt,
        acceptor,
        max_tokens,
        stop_tokens,
        tokens,
        logprobs,
        stopped,
        max_block=None,
        lookup=False,
        suffix=None,
    ) -> RowTokens:
        if session.proposer is not None:
            check_block_size(max_block, session.proposer, "max_block")
        elif max_block is not None and max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block}.")
        cap = self.block_size if max_block is None else max_block
        if session.proposer is None:
            cap = 1
        fixed = max_block is not None or self.choice is None
        policy = None
        if not fixed and cap > 1:  # alone, a row chooses as `stream_generate` does (carrying history)
            sampled = not acceptor.settings.greedy
            cap = choose_source(self.target, session.proposer, cap, sampled=sampled)  # (a RatedChoice: its member)
            key = (cap, sampled, id(getattr(session.proposer, "drafter", None)))
            if key not in self._costs:  # (looking a model up reads the models' facts)
                self._costs[key] = cost_model(self.target, session.proposer, cap, sampled=sampled)
            policy = adaptive_policy(
                self.target,
                session.proposer,
                cap,
                carry=True,
                cost=self._costs[key],
                sampled=sampled,
            )
        row = BatchRow(
            self._next_uid,
            session,
            acceptor,
            max_tokens,
            frozenset(stop_tokens),
            cap,
            fixed,
            policy.estimate if policy else AcceptanceEstimate(max(cap - 1, 0)),
            policy,
            anchor=tokens[0],
            position=prompt.size,
            committed=1,
        )
        spans = session.span_sources(
            prompt.tolist(), acceptor, lookup=lookup and cap > 1, suffix=suffix if cap > 1 else None
        )
        for source in spans:  # (the first token, committed to the acceptor already)
            source.commit(list(tokens))
        row.planner = CyclePlanner(
            policy or FixedBlock(cap), session.proposer, acceptor, max_tokens=max_tokens, spans=spans
        )
        self._next_uid += 1
        if not self.rows and self.choice is not None:
            self.choice.reset()
        row.finish = "stop" if stopped else ("length" if max_tokens == 1 else None)
        if row.finish is None:
            self.rows.append(row)
        return RowTokens(row.uid, list(tokens), logprobs, 0, 0, row.finish)

    def remove(self, uid: int) -> None:
        """Take a row out (e.g. its client went away); its session keeps the tokens committed so far."""
        self._unbatch()
        self.rows = [r for r in self.rows if r.uid != uid]

    def _batch(self) -> list:
        if self._cache is None:
            per_row = [r.session.cache for r in self.rows]
            self._cache = [batch_layer([c[j] for c in per_row]) for j in range(len(per_row[0]))]
        return self._cache

    def _unbatch(self) -> None:
        """Move the batch's caches back into the rows' sessions (in place: a caller's list stays its own)."""
        if self._cache is None:
            return
        for i, row in enumerate(self.rows):
            for j, layer in enumerate(self._cache):
                row.session.cache[j] = unbatch_layer(layer, i, row.session.cache[j])
        self._cache = None

    # -- one cycle ------------------------------------------------------------------------------

    def step(self, block_size: int | None = None) -> list[RowTokens]:
        """One draft + verify for every row; the rows that finished leave the batch.

        `block_size` forces this step's block (the batch calibration times each)."""
        if not self.rows:
            return []
        tic = time.perf_counter()
        single = len(self.rows) == 1 and self._cache is None  # one row: its own caches, as served alone
        alone = self._alone(block_size, single)
        if alone is not None:
            b, chosen, plans = alone.width, (alone.width if alone.chosen else None), [alone]
        else:
            b, chosen = self._width(block_size, single)
            plans = [r.planner.plan_at(b, r.max_block, self._drafter_tokens(r, b)) for r in self.rows]
        cache = self.rows[0].session.cache if single else self._batch()
        ids, drafts, probs = self._draft(plans, b)
        logits, features, record = self.target.verify(mx.stack(ids), cache)
        rows, verdicts = self._verdicts(logits, drafts, probs)
        out, keep, accepts, spans = self._take(rows, verdicts, plans, b)
        seconds = None if block_size is not None else time.perf_counter() - tic
        for row, plan, accepted in zip(self.rows, plans, spans):
            if plan.spans:  # (a span source's own estimate; a row alone's span cycle timed as its own)
                row.planner.observe(plan, accepted, seconds if single else None)
        if b == chosen:  # (policies learn from their own blocks)
            self._learn(b, plans, accepts, single, seconds)
        self._cut(cache, record, keep, features, single)
        return out

    def _alone(self, block_size: int | None, single: bool) -> Plan | None:
        """A row alone with a policy of its own plans its cycle as one request does (`CyclePlanner.plan`:
        plain decoding, its drafter or a span source, by rate; widened to a run its grammar forces); else
        None (the batch's width, `_width`, and each row's share of it, `plan_at`)."""
        row = self.rows[0]
        if block_size is not None or not single or row.policy is None:
            return None
        return row.planner.widened(row.planner.plan(row.committed, row.position), row.committed, row.position)

    def _width(self, block_size: int | None, single: bool) -> tuple[int, int]:
        """This step's width and the width its policy chose (narrower where a row's grammar forces a run:
        free drafts)."""
        if block_size is not None:
            return block_size, block_size
        if self.choice is None or all(r.fixed for r in self.rows):
            b = max(r.max_block for r in self.rows)
        else:
            b = self.choice.choose(self.rows)
        return max([b] + [r.planner.forced(r.max_block) for r in self.rows]), b

    @staticmethod
    def _drafter_tokens(row: BatchRow, b: int) -> float | None:
        """What the row's drafter is expected to commit at width b (None for a fixed block: a span fills it)."""
        return None if row.fixed else row.estimate.expected_tokens(min(b, row.max_block))[-1]

    def _draft(self, plans: list[Plan], b: int) -> tuple[list, list, list]:
        """The verify's ids [anchor, drafts] per row, its drafts padded to b - 1 (None at b = 1) and their q
        (None: point masses; the slots past a row's own drafts are ignored at acceptance)."""
        anchors = [mx.array([row.anchor], mx.int32) for row in self.rows]
        if b == 1:
            return anchors, [None] * len(self.rows), [None] * len(self.rows)
        drafts, probs = [], []
        for proposal in propose_rows(self.rows, plans, b - 1):
            tokens = proposal.tokens if proposal is not None else mx.zeros((0,), mx.int32)
            pad = b - 1 - tokens.size
            drafts.append(mx.concatenate([tokens, mx.zeros((pad,), mx.int32)]) if pad else tokens)
            probs.append(proposal.probs if proposal is not None and not pad else None)
        return [mx.concatenate([a, d]) for a, d in zip(anchors, drafts)], drafts, probs

    def _take(self, rows: list, verdicts: list, plans: list[Plan], b: int) -> tuple[list, list[int], list, list]:
        """Each row's share of the step: its tokens (cut at its stop token and max_tokens), committed to its
        session and planner; the rows kept per row, the acceptance its drafter showed (None: a span's) and
        its span's (None: a stop token cut it, or no span). A row whose grammar failed (`fault`) commits
        nothing and leaves."""
        out, keep, accepts, spans = [], [], [], []
        for i, (row, plan) in enumerate(zip(self.rows, plans)):
            values = verdicts[i]
            # (past a row's own drafts the committed token is the target's: argmax, or a sample of its
            # distribution whether the padding there was accepted under q one-hot or replaced)
            accepted = min(values[0], plan.width - 1)
            accepts.append(None if plan.spans or row.fault else accepted)
            tokens = values[1 : accepted + 2]
            room = row.max_tokens - row.committed if row.max_tokens >= 0 else len(tokens)
            tokens = tokens[:room] if row.fault is None else []
            stop = next((k for k, t in enumerate(tokens) if t in row.stop_tokens), None)
            finish = None
            if stop is not None:
                tokens, finish = tokens[: stop + 1], "stop"
            elif row.max_tokens >= 0 and row.committed + len(tokens) >= row.max_tokens:
                finish = "length"
            keep.append(max(len(tokens), 1))
            spans.append(accepted if plan.spans and tokens and stop is None else None)
            if tokens:
                row.session.fed([row.anchor] + tokens[:-1])
                faulted(row, row.planner.commit, tokens)
                row.committed += len(tokens)
                row.position += len(tokens)
                row.anchor = tokens[-1]
            row.finish = "error" if row.fault is not None else finish
            logprobs = log_softmax(rows[i][: len(tokens)]) if tokens else rows[i][:0]
            drafted = min(accepted, len(tokens))
            out.append(
                RowTokens(row.uid, tokens, logprobs, drafted, min(b, row.max_block), row.finish, plan.name, row.fault)
            )
        return out, keep, accepts, spans

    def _learn(self, b: int, plans: list[Plan], accepts: list, single: bool, seconds: float | None) -> None:
        """The step's acceptance (and time) to the policy that chose its width: a row alone's own (its drafter
        or plain step, timed as this path runs it; a span's cycle is its source's, observed with the spans),
        else the batch's."""
        if single and self.rows[0].policy is not None:
            if not plans[0].spans:
                self.rows[0].policy.observe(b, accepts[0], seconds)
        elif self.choice is not None:
            self.choice.observe(self.rows, b, accepts, seconds)

    def _cut(self, cache: list, record, keep: list[int], features, single: bool) -> None:
        """Cut every row's caches back to what it kept, feed its drafter, and let finished rows leave."""
        if single:
            rollback(cache, record, keep[0])
        else:
            keep_rows(cache, record, keep)
        if features is not None:
            for i, row in enumerate(self.rows):
                row.planner.feed(features[i : i + 1, : keep[i]])
        if any(r.finish for r in self.rows):
            self._unbatch()
            self.rows = [r for r in self.rows if r.finish is None]

    def _verdicts(self, logits: mx.array, drafts: list, probs: list) -> tuple[list, list[list[int]]]:
        """Each row's processed verify rows and [accepted, t_0..t_{b-1}] (one host sync for all).

        Greedy rows without logits processors or a grammar are judged together (argmax and the accepted
        prefix over [B, b] at once); the others by their own acceptor (a row whose grammar failed: none)."""
        plain = [r.acceptor.raw_logits and r.acceptor.settings.greedy for r in self.rows]
        rows = [logits[i] if plain[i] else self._processed(r, logits[i], drafts[i]) for i, r in enumerate(self.rows)]
        judged = {}
        together = [i for i, ok in enumerate(plain) if ok]
        if together:
            best = mx.argmax(logits[mx.array(together)] if len(together) < len(plain) else logits, axis=-1)
            best = best.astype(mx.int32)
            if drafts[together[0]] is not None:
                match = (mx.stack([drafts[i] for i in together]) == best[:, :-1]).astype(mx.int32)
                accepted = mx.sum(mx.cumprod(match, axis=1), axis=1, keepdims=True).astype(mx.int32)
            else:
                accepted = mx.zeros((len(together), 1), mx.int32)
            judged["together"] = mx.concatenate([accepted, best], axis=1)
        for i, r in enumerate(self.rows):
            if r.fault is not None:
                judged[i] = mx.zeros((rows[i].shape[0] + 1,), mx.int32)
            elif not plain[i]:
                judged[i] = r.acceptor.verdict(rows[i], drafts[i], probs[i], r.position)
        mx.eval(list(judged.values()))
        values = judged["together"].tolist() if together else []
        verdicts = [None] * len(self.rows)
        for k, i in enumerate(together):
            verdicts[i] = values[k]
        for i in range(len(self.rows)):
            if verdicts[i] is None:
                verdicts[i] = judged[i].tolist()
        return rows, verdicts

    @staticmethod
    def _processed(row: BatchRow, logits: mx.array, drafts: mx.array | None) -> mx.array:
        """The row's verify rows through its processors and grammar (as they are once its grammar failed)."""
        if row.fault is None:
            processed = faulted(row, row.acceptor.process, logits, drafts)
            if processed is not None:
                return processed
        return logits

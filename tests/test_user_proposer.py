"""A proposer of a user's own, written against the documented protocol (`dflash_mlx.proposers.base`).

It keeps per-generation state as a real proposer does: it learns which
continuation to draft only from `start(prompt)` (a table of continuations
keyed by prompt). One request at a time and batched, it must commit what it
knows (every block accepted whole) with mlx-lm's greedy tokens: batched rows
each get their own `fork()`, and a proposer without one is refused there
before anything runs. A user's proposer that samples its drafts with the one
key it is given keeps a seed's text. The example proposer of docs/usage.md runs
as written.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx import batch_generate, stream_batch_generate, stream_generate
from dflash_mlx.proposers import Proposal
from helpers import TINY_VOCAB, prompt_ids, reference, without_eos

BLOCK, MAX_TOKENS = 8, 48
PROMPTS = [prompt_ids(n, seed=40 + n) for n in (3, 7, 12, 18, 25, 33)]  # six lengths
USAGE = Path(__file__).resolve().parent.parent / "docs" / "usage.md"


class TableProposer:
    """Drafts the target's continuation of its prompt, which it looks up at `start` (no fork: see below)."""

    layer_ids = ()
    block_size = BLOCK

    def __init__(self, table: dict[tuple[int, ...], list[int]]):
        self.table = table
        self.continuation: list[int] = []
        self.prompt_length = 0

    def start(self, target, prompt, reused=0):
        ids = tuple(prompt.tolist())
        self.continuation, self.prompt_length = self.table[ids], len(ids)

    def add_context(self, features):
        pass

    def state(self):
        return []

    def propose(self, anchor, position, count, *, sampling=None, key=None):
        at = position - self.prompt_length + 1  # the continuation's index of the first draft
        drafts = self.continuation[at : at + count]
        return Proposal(tokens=mx.array(drafts + [0] * (count - len(drafts)), mx.int32))


class ForkingTableProposer(TableProposer):
    def fork(self, context=False):
        return ForkingTableProposer(self.table)


class SamplingTableProposer(ForkingTableProposer):
    """Samples each draft near the table's token with the key it is given (one MLX key: it does not declare
    `keys_per_row`, so a seeded call passes one key, not one per row)."""

    def propose(self, anchor, position, count, *, sampling=None, key=None):
        table = super().propose(anchor, position, count).tokens
        if sampling is None:
            return Proposal(tokens=table)
        logits = mx.where(mx.arange(TINY_VOCAB)[None] == table[:, None], 4.0, 0.0)
        drafts = mx.random.categorical(logits, key=key).astype(mx.int32)
        return Proposal(tokens=drafts, probs=mx.softmax(logits, axis=-1))


@pytest.fixture(scope="module")
def pair_and_truth(tiny_pair):
    model, tokenizer, _ = tiny_pair("qwen3")
    with without_eos(tokenizer) as tok:
        truth = {tuple(p): [r.token for r in reference(model, tok, p, MAX_TOKENS)] for p in PROMPTS}
        yield model, tok, truth


def per_cycle(responses) -> float:
    cycles = [r.cycle_tokens for r in responses if r.cycle_tokens is not None]
    return sum(cycles) / len(cycles)


def test_a_users_proposer_commits_what_it_knows_one_request_at_a_time(pair_and_truth):
    model, tok, truth = pair_and_truth
    for prompt in PROMPTS:
        proposer = ForkingTableProposer(truth)
        got = list(stream_generate(model, proposer, tok, prompt, max_tokens=MAX_TOKENS, block_size=BLOCK, lookup=False))
        assert [r.token for r in got] == truth[tuple(prompt)]
        assert per_cycle(got) >= 6, per_cycle(got)
        assert {r.source for r in got if r.from_draft} == {"draft"}  # (no `name`: the default)


def test_a_users_sampling_proposer_keeps_the_text_of_a_seed(pair_and_truth):
    model, tok, truth = pair_and_truth
    accepted = 0
    for prompt in PROMPTS[:3]:
        for seed in (0, 1):
            kw = dict(max_tokens=MAX_TOKENS, temperature=0.5, seed=seed)
            plain = [r.token for r in stream_generate(model, None, tok, prompt, **kw)]
            proposer = SamplingTableProposer(truth)
            got = list(stream_generate(model, proposer, tok, prompt, block_size=BLOCK, lookup=False, **kw))
            assert [r.token for r in got] == plain, (prompt, seed)
            accepted += sum(r.from_draft for r in got)
    assert accepted > 0


def test_a_users_proposer_commits_what_it_knows_in_a_batch(pair_and_truth):
    """Each row drafts from its own fork's state: one object serving every row would draft a row from
    the prompt another row started it with."""
    model, tok, truth = pair_and_truth
    rows: dict[int, list] = {i: [] for i in range(len(PROMPTS))}
    stream = stream_batch_generate(
        model,
        ForkingTableProposer(truth),
        tok,
        PROMPTS,
        max_tokens=MAX_TOKENS,
        block_size=BLOCK,
        max_batch=4,
        lookup=False,
    )
    for i, response in stream:
        rows[i].append(response)
    for i, prompt in enumerate(PROMPTS):
        assert [r.token for r in rows[i]] == truth[tuple(prompt)]
        assert per_cycle(rows[i]) >= 6, (i, per_cycle(rows[i]))


def test_a_proposer_without_fork_is_refused_in_batched_decoding(pair_and_truth):
    model, tok, truth = pair_and_truth
    proposer = TableProposer(truth)
    with pytest.raises(TypeError, match=r"TableProposer has no fork\(\)"):
        batch_generate(model, proposer, tok, PROMPTS, max_tokens=MAX_TOKENS, block_size=BLOCK)
    assert proposer.prompt_length == 0  # refused before anything ran
    got = list(stream_generate(model, proposer, tok, PROMPTS[0], max_tokens=8, block_size=BLOCK, lookup=False))
    assert [r.token for r in got] == truth[tuple(PROMPTS[0])][:8]  # one request at a time needs no fork


def test_the_usage_guides_proposer_example_runs_as_written(capsys):
    """docs/usage.md's "Write your own proposer" example, executed unchanged (the bundled demo pair)."""
    section = USAGE.read_text().split("## Write your own proposer", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {"__name__": "usage_example"}
    exec(compile(code, str(USAGE), "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.strip() and len(namespace["replies"].texts) == 2
    bigram = namespace["BigramProposer"]
    model, tokenizer = namespace["model"], namespace["tokenizer"]
    got = list(stream_generate(model, bigram(), tokenizer, namespace["prompt"], max_tokens=64))
    plain = list(stream_generate(model, None, tokenizer, namespace["prompt"], max_tokens=64))
    assert [r.token for r in got] == [r.token for r in plain]
    assert {r.source for r in got if r.from_draft} <= {"bigram", "lookup"}

"""mlx-lm's own prompt caches under the plugin, and the plugin's signatures.

A list from ``mlx_lm.models.cache.make_prompt_cache(model)`` runs DFlash and
is left exactly as mlx-lm's decoding leaves its own list: the same tokens
generated, the same length held, the same next turn, after early stops inside
a draft block (plain KV, ring and Gated DeltaNet caches), after
save / load (a list the drafter never saw) and after trim.
"""

from __future__ import annotations

import inspect
import warnings

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx import mlx_lm as plugin
from dflash_mlx.proposers import Proposal
from helpers import TINY_VOCAB, prompt_ids


def held_length(cache) -> int:
    """Tokens an mlx-lm cache list holds (its first attention cache's offset)."""
    return next(c.offset for c in cache if isinstance(getattr(c, "offset", None), int))


class PositionOracle:
    """Proposes the target's true token at each absolute position (from `truth`), corrupting one
    draft per block so that cycle k accepts `pattern[k % len(pattern)]` drafts."""

    layer_ids: tuple[int, ...] = ()
    block_size = 6

    def __init__(self, pattern=(5, 0, 2, 4, 1, 3)):
        self.truth: dict[int, int] = {}
        self.pattern, self.cycle, self.proposed = list(pattern), 0, 0

    def start(self, target, prompt, reused: int = 0) -> None:
        pass

    def add_context(self, features) -> None:
        pass

    def state(self) -> list:
        return []

    def propose(self, anchor, position, count, *, sampling=None, key=None) -> Proposal:
        tokens = [self.truth.get(position + 1 + i, 0) for i in range(count)]
        keep = self.pattern[self.cycle % len(self.pattern)]
        if keep < count:
            tokens[keep] = (tokens[keep] + 1) % TINY_VOCAB
        self.cycle += 1
        self.proposed += count
        return Proposal(tokens=mx.array(tokens, dtype=mx.int32))


def run(generate, model, tokenizer, ids, cache, stop_after, **kw):
    out = []
    for r in generate(model, tokenizer, ids, max_tokens=40, prompt_cache=cache, **kw):
        out.append(r)
        if len(out) == stop_after:
            break
    return out


def assert_same_turn(model, tokenizer, oracle, ours, theirs, ids, stop_after, **kw):
    """One turn on both lists; the oracle learns mlx-lm's tokens first. Returns the tokens."""
    start = held_length(theirs) + len(ids)
    want = [r.token for r in run(mlx_lm.stream_generate, model, tokenizer, ids, theirs, stop_after, **kw)]
    oracle.truth.update({start + i: t for i, t in enumerate(want)})
    got = run(plugin.stream_generate, model, tokenizer, ids, ours, stop_after, draft_model=oracle, **kw)
    assert [r.token for r in got] == want
    assert held_length(ours) == held_length(theirs) == start + len(want)
    assert got[0].prompt_tokens == len(ids)
    return want


def assert_same_state(ours, theirs):
    """Plain KV caches hold the same rows, Gated DeltaNet caches the same states (ring layouts may differ)."""
    for a, b in zip(ours, theirs):
        if type(a) is mlx_lm_cache.KVCache:
            pairs = [
                (a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]),
                (a.values[..., : a.offset, :], b.values[..., : b.offset, :]),
            ]
        elif type(a) is mlx_lm_cache.ArraysCache:
            pairs = [(x, y) for x, y in zip(a.cache, b.cache) if x is not None]
        else:
            continue
        for x, y in pairs:
            np.testing.assert_allclose(np.array(x), np.array(y), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "llama_sliding"])
def test_an_mlx_lm_cache_list_holds_what_mlx_lm_leaves_in_it(tiny_pair, family, tmp_path):
    model, tokenizer, _ = tiny_pair(family)
    oracle = PositionOracle()
    ours, theirs = mlx_lm_cache.make_prompt_cache(model), mlx_lm_cache.make_prompt_cache(model)
    turns = [(prompt_ids(30, seed=1), 9), (prompt_ids(5, seed=2), 40), (prompt_ids(3, seed=3), 13)]
    for i, (ids, stop_after) in enumerate(turns):  # breaks at 9 and 13 land inside draft blocks
        kw = {"logits_processors": make_logits_processors(repetition_penalty=1.4)} if i == 2 else {}
        assert_same_turn(model, tokenizer, oracle, ours, theirs, ids, stop_after, **kw)
        assert_same_state(ours, theirs)
    assert oracle.proposed > 0
    # Saved and loaded: a list the plugin never saw continues the conversation alike.
    mlx_lm_cache.save_prompt_cache(str(tmp_path / "ours.safetensors"), ours)
    mlx_lm_cache.save_prompt_cache(str(tmp_path / "theirs.safetensors"), theirs)
    ours = mlx_lm_cache.load_prompt_cache(str(tmp_path / "ours.safetensors"))
    theirs = mlx_lm_cache.load_prompt_cache(str(tmp_path / "theirs.safetensors"))
    assert_same_turn(model, tokenizer, oracle, ours, theirs, prompt_ids(4, seed=4), 17)
    assert_same_state(ours, theirs)
    if mlx_lm_cache.can_trim_prompt_cache(ours):
        assert mlx_lm_cache.trim_prompt_cache(ours, 6) == mlx_lm_cache.trim_prompt_cache(theirs, 6) == 6
        assert_same_turn(model, tokenizer, oracle, ours, theirs, prompt_ids(2, seed=5), 11)
        assert_same_state(ours, theirs)
    # mlx-lm's own decoding continues the list DFlash filled, and DFlash continues after it.
    ids = prompt_ids(3, seed=6)
    assert [r.token for r in run(mlx_lm.stream_generate, model, tokenizer, ids, ours, 10)] == [
        r.token for r in run(mlx_lm.stream_generate, model, tokenizer, ids, theirs, 10)
    ]
    assert_same_turn(model, tokenizer, oracle, ours, theirs, prompt_ids(3, seed=7), 15)


def test_the_drafters_context_follows_the_list_across_calls(tiny_pair):
    """A real DFlash drafter (it raises if its context and the anchor's position disagree)."""
    model, tokenizer, draft = tiny_pair("qwen3")
    ours, theirs = mlx_lm_cache.make_prompt_cache(model), mlx_lm_cache.make_prompt_cache(model)
    for ids, stop_after in [(prompt_ids(20, seed=8), 7), (prompt_ids(4, seed=9), 40), (prompt_ids(4, seed=10), 3)]:
        want = [r.token for r in run(mlx_lm.stream_generate, model, tokenizer, ids, theirs, stop_after)]
        got = [r.token for r in run(plugin.stream_generate, model, tokenizer, ids, ours, stop_after, draft_model=draft)]
        assert got == want and held_length(ours) == held_length(theirs)
    assert_same_state(ours, theirs)


def test_caches_dflash_cannot_run_fall_back_to_mlx_lm_with_a_warning(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    bounded = mlx_lm_cache.make_prompt_cache(model, max_kv_size=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [
            r.token
            for r in plugin.stream_generate(
                model, tokenizer, "hello", max_tokens=8, prompt_cache=bounded, draft_model=draft
            )
        ]
    assert any("prompt_cache" in str(w.message) and "falling back" in str(w.message) for w in caught)
    want = [
        r.token
        for r in mlx_lm.stream_generate(
            model, tokenizer, "hello", max_tokens=8, prompt_cache=mlx_lm_cache.make_prompt_cache(model, 64)
        )
    ]
    assert got == want


# --- signatures ---------------------------------------------------------------------------------

TWINS = {
    "load": mlx_lm.load,
    "stream_generate": mlx_lm.stream_generate,
    "generate": mlx_lm.generate,
    "make_prompt_cache": mlx_lm_cache.make_prompt_cache,
}


@pytest.mark.parametrize("name", sorted(TWINS))
def test_every_plugin_function_takes_its_mlx_lm_twins_parameters(name):
    """Same names, kinds, order and defaults; extras only keyword-only (a rename on either side fails)."""
    ours = list(inspect.signature(getattr(plugin, name)).parameters.values())
    theirs = list(inspect.signature(TWINS[name]).parameters.values())
    described = [(p.name, p.kind, p.default) for p in theirs]
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == described
    extra = ours[len(theirs) :]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra), extra
    assert set(plugin.__all__) >= set(TWINS)


def test_load_by_mlx_lms_keyword_names(qwen3_target, qwen3_draft):
    model, tokenizer, config = plugin.load(
        path_or_hf_repo=str(qwen3_target), return_config=True, lazy=False, draft=str(qwen3_draft)
    )
    assert config["model_type"] == "qwen3" and plugin.remembered_draft(model) is not None


class Cancelled(Exception):
    pass


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_prefill_cancelled_by_the_progress_callback_leaves_a_usable_list(tiny_pair, family):
    """A callback that raises stops the prefill after some chunks: a plain KV list goes back to what it
    held before the call; a hybrid list cannot, and keeps the fed chunks as mlx-lm's own list does."""
    model, tokenizer, _ = tiny_pair(family)
    oracle = PositionOracle()
    ours, theirs = mlx_lm_cache.make_prompt_cache(model), mlx_lm_cache.make_prompt_cache(model)
    assert_same_turn(model, tokenizer, oracle, ours, theirs, prompt_ids(12, seed=21), 9)
    before = held_length(ours)

    def cancelling(calls):
        def cancel(done, total):  # mlx-lm's counts: this call's prompt tokens only
            calls.append((done, total))
            if done >= 16:
                raise Cancelled

        return dict(prefill_step_size=8, prompt_progress_callback=cancel)

    ids, ours_calls, theirs_calls = prompt_ids(40, seed=22), [], []
    with pytest.raises(Cancelled):
        run(plugin.stream_generate, model, tokenizer, ids, ours, 5, draft_model=oracle, **cancelling(ours_calls))
    trimmable = mlx_lm_cache.can_trim_prompt_cache(ours)
    with pytest.raises(Cancelled):  # a list that can be cut back is compared with one that never saw the call
        run(
            mlx_lm.stream_generate,
            model,
            tokenizer,
            ids,
            mlx_lm_cache.make_prompt_cache(model) if trimmable else theirs,
            5,
            **cancelling(theirs_calls),
        )
    assert ours_calls == theirs_calls == [(0, 40), (8, 40), (16, 40)]
    if trimmable:
        assert held_length(ours) == before
    else:  # both hold the chunks fed
        assert held_length(ours) == held_length(theirs) == before + 16
    assert_same_turn(model, tokenizer, oracle, ours, theirs, prompt_ids(6, seed=23), 20)
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("family,next_draft", [("qwen3", "same"), ("qwen3_5", "same"), ("qwen3", "other")])
def test_a_stream_left_open_on_a_list_is_settled_by_the_next_call(tiny_pair, family, next_draft):
    """A script keeps a stream in a variable, stops reading it and calls again with the same list: the
    list holds what mlx-lm's would (the prompt and the tokens read: mlx-lm has fed each token it
    yields), the next turn matches mlx-lm's, and the old stream cannot go on."""
    model, tokenizer, draft = tiny_pair(family)
    ours, theirs = mlx_lm_cache.make_prompt_cache(model), mlx_lm_cache.make_prompt_cache(model)
    ids = prompt_ids(20, seed=31)
    open_streams = []
    legs = [(mlx_lm.stream_generate, theirs, {}), (plugin.stream_generate, ours, {"draft_model": draft})]
    for generate, cache, kw in legs:
        stream = generate(model, tokenizer, ids, max_tokens=40, prompt_cache=cache, **kw)
        open_streams.append((stream, [next(stream).token for _ in range(7)]))
    assert open_streams[0][1] == open_streams[1][1]
    more = prompt_ids(4, seed=32)
    want = [r.token for r in run(mlx_lm.stream_generate, model, tokenizer, more, theirs, 12)]
    second = draft if next_draft == "same" else PositionOracle()  # (the binding is per drafter)
    got = [r.token for r in run(plugin.stream_generate, model, tokenizer, more, ours, 12, draft_model=second)]
    assert got == want and held_length(ours) == held_length(theirs) == 20 + 7 + 4 + 12
    with pytest.raises(RuntimeError, match="left open"):
        next(open_streams[1][0])
    del open_streams
    assert held_length(ours) == held_length(theirs)  # collecting the old stream changes nothing
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "llama_sliding"])
def test_a_logits_processor_raising_mid_reply_leaves_the_list_holding_the_tokens_read(tiny_pair, family):
    """The exception lands after a verify went into the caches: the list must hold the prompt and the tokens
    read (hybrid and sliding lists go back to the prompt's checkpoint, then take the tokens read), and the
    next turn matches mlx-lm's on a list that read the same tokens."""
    model, tokenizer, draft = tiny_pair(family)
    ours, theirs = mlx_lm_cache.make_prompt_cache(model), mlx_lm_cache.make_prompt_cache(model)
    calls = []

    def raising(tokens, logits):
        calls.append(1)
        if len(calls) == 14:
            raise Cancelled
        return logits

    ids, got = prompt_ids(20, seed=41), []
    with pytest.raises(Cancelled):
        for r in plugin.stream_generate(
            model,
            tokenizer,
            ids,
            max_tokens=40,
            prompt_cache=ours,
            draft_model=draft,
            num_draft_tokens=3,
            logits_processors=[raising],
        ):
            got.append(r.token)
    assert got and held_length(ours) == len(ids) + len(got)
    want = [r.token for r in run(mlx_lm.stream_generate, model, tokenizer, ids, theirs, len(got))]
    assert want == got
    assert_same_turn(model, tokenizer, PositionOracle(), ours, theirs, prompt_ids(5, seed=42), 12)
    assert_same_state(ours, theirs)

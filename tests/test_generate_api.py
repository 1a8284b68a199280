"""The public generation API: prompt forms, response fields, errors, no patching."""

from __future__ import annotations

import inspect
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate as mlx_lm_generate
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.generate import GenerationResponse

import dflash_mlx
from dflash_mlx import DFlashResponse, generate, load_draft, stream_generate
from dflash_mlx.generation import encode_prompt
from helpers import ALL_FAMILIES

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def bos_pair(tiny_pair_dirs):
    """A fresh (uncached) load of the BOS llama and its random drafter."""
    target_dir, draft_dir = tiny_pair_dirs("llama", add_bos=True)
    model, tokenizer = mlx_lm_load(str(target_dir))
    return model, tokenizer, load_draft(draft_dir, model)


def test_public_names_and_signature():
    for name in ("load", "load_draft", "stream_generate", "generate", "__version__"):
        assert hasattr(dflash_mlx, name)
    params = inspect.signature(stream_generate).parameters
    assert list(params)[:4] == ["model", "draft", "tokenizer", "prompt"]
    defaults = {
        k: params[k].default
        for k in ("max_tokens", "block_size", "temperature", "top_p", "top_k", "min_p", "logits_processors", "seed")
    }
    assert defaults == dict(
        max_tokens=256,
        block_size=None,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        logits_processors=None,
        seed=None,
    )


@pytest.mark.parametrize("text", [TEXT, "<s>" + TEXT])
def test_string_prompt_follows_mlx_lm_bos_rule(bos_pair, text):
    model, tokenizer, draft = bos_pair
    assert tokenizer.bos_token == "<s>"
    want = list(mlx_lm_stream_generate(model, tokenizer, text, max_tokens=30))
    got = list(stream_generate(model, draft, tokenizer, text, max_tokens=30, block_size=4))
    assert [r.token for r in got] == [r.token for r in want]
    assert got[0].prompt_tokens == want[0].prompt_tokens
    # A BOS is added to plain text, and "<s>" + text is not given a second one.
    ids = encode_prompt(tokenizer, text).tolist()
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert len(ids) == want[0].prompt_tokens


def test_prompt_as_list_array_or_string_agree(bos_pair):
    model, tokenizer, draft = bos_pair
    ids = tokenizer.encode(TEXT)
    runs = [
        [r.token for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=20)]
        for prompt in (TEXT, ids, mx.array(ids))
    ]
    assert runs[0] == runs[1] == runs[2]


def test_a_prompt_array_is_used_as_given_or_flattened(bos_pair):
    """A 1-D array goes to the engine as it is (a lazy reshape would cost a host sync when the engine
    reads the ids); a [1, L] array, as mlx-lm scripts sometimes pass, is flattened."""
    _, tokenizer, _ = bos_pair
    ids = mx.array(tokenizer.encode(TEXT))
    assert encode_prompt(tokenizer, ids) is ids
    assert encode_prompt(tokenizer, ids[None]).tolist() == ids.tolist()


def test_responses_are_mlx_lm_generation_responses(bos_pair):
    model, tokenizer, draft = bos_pair
    responses = list(stream_generate(model, draft, tokenizer, TEXT, max_tokens=25, block_size=5))
    want = list(mlx_lm_stream_generate(model, tokenizer, TEXT, max_tokens=25))
    for r in responses:
        assert isinstance(r, GenerationResponse) and isinstance(r, DFlashResponse)
        assert r.logprobs.shape == (model.args.vocab_size,)
        assert r.prompt_tps > 0 and r.generation_tps > 0 and r.peak_memory >= 0
    assert [r.generation_tokens for r in responses] == list(range(1, len(responses) + 1))
    assert "".join(r.text for r in responses) == "".join(r.text for r in want)
    assert responses[-1].finish_reason == want[-1].finish_reason


def test_generate_returns_the_text(bos_pair):
    model, tokenizer, draft = bos_pair
    text = generate(model, draft, tokenizer, TEXT, max_tokens=40, block_size=6)
    assert isinstance(text, str)
    assert text == mlx_lm_generate(model, tokenizer, TEXT, max_tokens=40)


@pytest.mark.parametrize(
    "option, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(temperature=0.7, seed=-5), "seed must be an integer in"),
        (dict(temperature=0.7, seed=2**64), "seed must be an integer in"),
        (dict(temperature=0.7, seed=1.5), "seed must be an integer in"),
        (dict(temperature=0.7, seed="7"), "seed must be an integer in"),
        (dict(temperature=0.7, seed=True), "seed must be an integer in"),
        (dict(temperature=0.7, seed=np.int64(-1)), "seed must be an integer in"),
    ],
)
def test_invalid_sampling_options_name_the_field(bos_pair, option, field):
    model, tokenizer, draft = bos_pair
    with pytest.raises(ValueError, match=field):
        next(stream_generate(model, draft, tokenizer, TEXT, **option))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(prefill_step_size=0), "prefill_step_size"),
    ],
)
def test_bad_arguments_are_named(bos_pair, kwargs, message):
    model, tokenizer, draft = bos_pair
    with pytest.raises(ValueError, match=message):
        list(stream_generate(model, draft, tokenizer, TEXT, **kwargs))


def test_bad_draft_and_empty_prompt(bos_pair):
    model, tokenizer, draft = bos_pair
    with pytest.raises(TypeError, match="draft must be"):
        next(stream_generate(model, "not-a-drafter", tokenizer, TEXT))
    with pytest.raises(ValueError, match="empty"):
        next(stream_generate(model, draft, tokenizer, []))


def _mlx_lm_attributes() -> dict:
    """Every attribute of every loaded mlx-lm module and of the classes it defines."""
    seen = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            seen[(name, attr)] = id(value)
            if inspect.isclass(value) and value.__module__.startswith("mlx_lm"):
                for cattr, cvalue in list(vars(value).items()):
                    seen[(name, attr, cattr)] = id(cvalue)
    return seen


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_no_mlx_lm_class_or_module_is_patched(tiny_pair_dirs, family):
    target_dir, draft_dir = tiny_pair_dirs(family)
    model, tokenizer = mlx_lm_load(str(target_dir))
    draft = load_draft(draft_dir, model)
    before = _mlx_lm_attributes()
    stream = stream_generate(model, draft, tokenizer, TEXT, max_tokens=30, block_size=4)
    next(stream)
    next(stream)
    during = _mlx_lm_attributes()
    list(stream)
    after = _mlx_lm_attributes()
    changed = {k for k in before if during.get(k) != before[k] or after.get(k) != before[k]}
    assert not changed, f"mlx-lm attributes changed: {sorted(changed)[:5]}"

"""dflash_mlx.mlx_lm: mlx-lm's API on DFlash (load, stream_generate, generate, prompt caches).

The pair is the tiny qwen3 target and a drafter that always proposes the token
the target repeats after PROMPT (tests/helpers/constant_draft.py), so drafts really get
accepted. Every greedy run is compared with mlx-lm's own decoding.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import warnings
import weakref

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors, make_sampler

from dflash_mlx import DFlashResponse, load_draft
from dflash_mlx import mlx_lm as plugin
from dflash_mlx.mlx_lm import api as plugin_api
from dflash_mlx.draft.model import DFlashDraftModel
from dflash_mlx.mlx_lm.samplers import UnsupportedSampler, sampler_settings
from dflash_mlx.proposers import DFlashProposer
from dflash_mlx.sampling import SamplingSettings, distribution
from helpers.calibrations import cheap_blocks_cache

PROMPT = "hello world"


@pytest.fixture(scope="module")
def dirs(constant_pair_dirs):
    """(target dir, constant drafter dir)."""
    return constant_pair_dirs(PROMPT)


@pytest.fixture(scope="module")
def loaded(dirs):
    target, draft = dirs
    model, tokenizer = plugin.load(target, draft=draft)
    return model, tokenizer


@pytest.fixture(scope="module", autouse=True)
def cheap_blocks(loaded, tmp_path_factory):
    """The adaptive block on a pinned curve (this module's processes and the scripts they start): which
    blocks run, and so how many drafts are accepted, must not depend on this machine's load."""
    model, _ = loaded
    with cheap_blocks_cache(tmp_path_factory.mktemp("calibration"), model, plugin.remembered_draft(model)) as path:
        yield path


def tokens(responses):
    return [r.token for r in responses]


def test_load_returns_what_mlx_lm_returns_and_leaves_the_model_alone(dirs):
    target, draft = dirs
    want_model, want_tokenizer, want_config = mlx_lm.load(str(target), return_config=True)
    model, tokenizer = plugin.load(target, draft=draft)
    got = plugin.load(target, draft=draft, return_config=True)
    assert len(got) == 3 and got[2] == want_config
    assert type(model) is type(want_model) and type(tokenizer) is type(want_tokenizer)
    # The drafter is remembered outside the model: no child module, no attribute.
    assert [k for k, _ in tree_flatten(model.parameters())] == [k for k, _ in tree_flatten(want_model.parameters())]
    assert sorted(model.keys()) == sorted(want_model.keys())
    assert sorted(vars(model)) == sorted(vars(want_model))
    assert isinstance(plugin.remembered_draft(model), DFlashDraftModel)
    assert plugin.remembered_draft(want_model) is None


def test_remembered_drafter_leaves_with_its_model(dirs):
    target, draft = dirs
    model, _ = plugin.load(target, draft=draft)
    drafter = weakref.ref(plugin.remembered_draft(model))
    assert drafter() is not None
    del model
    gc.collect()
    assert drafter() is None


def test_load_without_drafter_warns_and_decodes_with_mlx_lm(dirs):
    target, _ = dirs
    with pytest.warns(UserWarning, match="No DFlash drafter is registered"):
        model, tokenizer = plugin.load(target)
    got = list(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=20))
    want = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=20))
    assert tokens(got) == tokens(want)
    assert all(type(r) is GenerationResponse for r in got)  # mlx-lm's own responses


@pytest.mark.parametrize("sampler", [None, greedy_sampler, make_sampler(0.0), make_sampler(0.0, top_p=0.5)])
def test_greedy_equals_mlx_lm_and_drafts_are_accepted(loaded, sampler):
    model, tokenizer = loaded
    got = list(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=60, sampler=sampler))
    want = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=60))
    assert tokens(got) == tokens(want)
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert all(isinstance(r, DFlashResponse) for r in got)
    assert sum(r.from_draft for r in got) > 10
    assert plugin.generate(model, tokenizer, PROMPT, max_tokens=60) == "".join(r.text for r in want)


def test_logits_processors_progress_and_chunked_prefill_match_mlx_lm(loaded):
    model, tokenizer = loaded
    prompt = tokenizer.encode(PROMPT) + list(range(20, 60))
    runs = []
    for stream_generate in (plugin.stream_generate, mlx_lm.stream_generate):
        calls = []
        processors = make_logits_processors(logit_bias={7: 2.0}, repetition_penalty=1.3, repetition_context_size=8)
        responses = list(
            stream_generate(
                model,
                tokenizer,
                prompt,
                max_tokens=40,
                logits_processors=processors,
                prefill_step_size=16,
                prompt_progress_callback=lambda *a: calls.append(a),
            )
        )
        runs.append((tokens(responses), calls))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("n", [0, 2, 5])
def test_num_draft_tokens_sets_the_block(loaded, n):
    model, tokenizer = loaded
    got = list(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=60, num_draft_tokens=n))
    assert tokens(got) == tokens(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=60))
    cycles = [r.cycle_tokens for r in got if r.cycle_tokens]
    assert max(cycles) <= n + 1
    if n:
        assert max(cycles) == n + 1  # the target repeats the drafted token for long runs


def test_lookup_passes_through_the_drop_in(loaded):
    """`lookup` (the one keyword mlx-lm lacks): on by default, off on request; dropped where mlx-lm decodes."""
    model, tokenizer = loaded
    want = tokens(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=60))
    on = list(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=60))
    off = list(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=60, lookup=False))
    assert tokens(on) == tokens(off) == want
    assert any(r.source == "lookup" for r in on) and not any(r.source == "lookup" for r in off)
    assert plugin.generate(model, tokenizer, PROMPT, max_tokens=60, lookup=False) == "".join(r.text for r in off)
    with pytest.warns(UserWarning, match="falling back"):
        plain = list(
            plugin.stream_generate(
                model, tokenizer, PROMPT, max_tokens=8, lookup=False, sampler=lambda logits: mx.argmax(logits, axis=-1)
            )
        )
    assert tokens(plain) == want[:8]


def test_explicit_draft_model_wins(dirs, loaded):
    model, tokenizer = loaded
    calls = []

    class Spy(DFlashProposer):
        def propose(self, *args, **kwargs):
            calls.append(args[1])
            return super().propose(*args, **kwargs)

    spy = Spy(load_draft(dirs[1], model))
    got = list(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=30, draft_model=spy))
    assert calls and tokens(got) == tokens(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=30))
    # A plain model with no remembered drafter still runs DFlash with an explicit DFlash drafter.
    plain, _ = mlx_lm.load(str(dirs[0]))
    got = list(plugin.stream_generate(plain, tokenizer, PROMPT, max_tokens=30, draft_model=load_draft(dirs[1], plain)))
    assert sum(r.from_draft for r in got) > 0 and all(isinstance(r, DFlashResponse) for r in got)


def test_ordinary_draft_model_runs_mlx_lm_speculative_decoding(loaded):
    model, tokenizer = loaded
    got = list(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=30, draft_model=model, num_draft_tokens=3))
    want = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=30, draft_model=model, num_draft_tokens=3))
    assert tokens(got) == tokens(want)
    assert [r.from_draft for r in got] == [r.from_draft for r in want]
    assert all(type(r) is GenerationResponse for r in got)


# --- samplers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, want",
    [
        (dict(temp=0.7), dict(temperature=0.7)),
        (dict(temp=1, top_p=0.9), dict(temperature=1, top_p=0.9)),
        (dict(temp=0.5, top_p=1.0), dict(temperature=0.5)),  # 1.0 and 0.0 turn top-p off in mlx-lm
        (dict(temp=0.5, top_p=0.0), dict(temperature=0.5)),
        (dict(temp=0.8, min_p=0.05), dict(temperature=0.8, min_p=0.05)),
        (dict(temp=0.8, top_k=40), dict(temperature=0.8, top_k=40)),
        (dict(temp=0.6, top_p=0.95, min_p=0.1, top_k=20), dict(temperature=0.6, top_p=0.95, min_p=0.1, top_k=20)),
        (dict(temp=0.6, min_tokens_to_keep=3), dict(temperature=0.6)),  # min-p off: nothing to keep
        (dict(temp=0.6, xtc_threshold=0.2), dict(temperature=0.6)),  # XTC off
        (
            dict(temp=2.0, top_p=0.3, min_p=0.2, min_tokens_to_keep=1, top_k=3),
            dict(temperature=2.0, top_p=0.3, min_p=0.2, top_k=3),
        ),
    ],
)
def test_make_sampler_settings_are_recovered(kwargs, want):
    settings = sampler_settings(make_sampler(**kwargs))
    assert settings == SamplingSettings(**want)


def test_positional_make_sampler_arguments_are_recovered():
    settings = sampler_settings(make_sampler(0.5, 0.8, 0.1, 1, 20))
    assert settings == SamplingSettings(temperature=0.5, top_p=0.8, min_p=0.1, top_k=20)


@pytest.mark.parametrize(
    "kwargs", [dict(temp=0.9, top_p=0.7), dict(temp=0.5, min_p=0.2, top_k=5), dict(temp=1.3, top_k=4, top_p=0.9)]
)
def test_recovered_settings_give_the_samplers_distribution(kwargs):
    """mlx-lm's sampler, run 4000 times on one row, follows the distribution of the recovered settings."""
    logits = mx.array(np.random.default_rng(0).normal(0, 1.5, (1, 12)).astype(np.float32))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = np.array(distribution(logits, sampler_settings(make_sampler(**kwargs))))[0]
    mx.random.seed(1)
    draws = np.array(make_sampler(**kwargs)(mx.broadcast_to(logprobs, (4000, 12))))
    freq = np.bincount(draws, minlength=12) / 4000
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want > 0))
    np.testing.assert_allclose(freq, want, atol=0.035)


@pytest.mark.parametrize(
    "sampler, reason",
    [
        (make_sampler(0.7, xtc_probability=0.5), "XTC"),
        (make_sampler(0.7, min_p=0.1, min_tokens_to_keep=3), "min_tokens_to_keep=3"),
        (lambda logprobs: mx.argmax(logprobs, axis=-1), "not made by mlx_lm.sample_utils.make_sampler"),
    ],
)
def test_unsupported_samplers_name_the_reason(sampler, reason):
    with pytest.raises(UnsupportedSampler, match=reason):
        sampler_settings(sampler)


def test_custom_sampler_falls_back_to_mlx_lm_with_one_warning(loaded):
    model, tokenizer = loaded
    plugin_api.reset_warnings()

    def second_best(logprobs):
        return mx.argsort(logprobs, axis=-1)[..., -2]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [
            tokens(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=20, sampler=second_best))
            for _ in range(2)
        ]
    assert [str(w.message) for w in caught] == [
        "dflash_mlx.mlx_lm: the sampler test_custom_sampler_falls_back_to_mlx_lm_with_one_warning.<locals>."
        "second_best was not made by mlx_lm.sample_utils.make_sampler, so its distribution is unknown: "
        "falling back to mlx-lm's own decoding."
    ]
    assert (
        got[0] == got[1] == tokens(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=20, sampler=second_best))
    )


@pytest.mark.parametrize(
    "kwargs", [dict(sampler=make_sampler(0.8, xtc_probability=0.5, xtc_threshold=0.1)), dict(max_kv_size=16)]
)
def test_options_dflash_cannot_honour_run_mlx_lm(loaded, kwargs):
    model, tokenizer = loaded
    plugin_api.reset_warnings()
    with pytest.warns(UserWarning, match="falling back to mlx-lm"):
        mx.random.seed(5)
        got = tokens(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=24, **kwargs))
    mx.random.seed(5)
    assert got == tokens(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=24, **kwargs))


def test_sampled_dflash_is_reproducible_with_mx_random_seed(loaded):
    model, tokenizer = loaded
    sampler = make_sampler(0.9, top_p=0.95)
    runs = []
    for seed in (3, 3, 4):
        mx.random.seed(seed)
        runs.append(tokens(plugin.stream_generate(model, tokenizer, PROMPT, max_tokens=30, sampler=sampler)))
    assert runs[0] == runs[1] != runs[2]


def test_unknown_keyword_is_a_type_error(loaded):
    with pytest.raises(TypeError, match="'temperature'"):
        plugin.stream_generate(*loaded, PROMPT, temperature=0.5)


# --- prompt caches ----------------------------------------------------------------------------


def test_prompt_cache_follows_mlx_lm_semantics_across_calls(loaded):
    """Each call passes only new tokens; early stops and processors behave as with mlx-lm's cache."""
    model, tokenizer = loaded
    ours, theirs = plugin.make_prompt_cache(model), mlx_lm_make_prompt_cache(model)
    assert isinstance(ours, plugin.DFlashPromptCache)
    turns = [(PROMPT, 7, None), (" and then", 40, None), ("x", 25, make_logits_processors(repetition_penalty=1.5))]
    for text, stop_after, processors in turns:
        ids = tokenizer.encode(text)
        got, want = [], []
        for out, stream_generate, cache in (
            (got, plugin.stream_generate, ours),
            (want, mlx_lm.stream_generate, theirs),
        ):
            for r in stream_generate(
                model, tokenizer, ids, max_tokens=60, prompt_cache=cache, logits_processors=processors
            ):
                out.append(r)
                if len(out) == stop_after:
                    break
        assert tokens(got) == tokens(want)
        assert got[0].prompt_tokens == want[0].prompt_tokens == len(ids)
        assert len(ours.tokens) == theirs[0].offset
    assert ours.session.reused > 0  # the last turn only prefilled what was new


def test_prompt_cache_errors(loaded, dirs):
    model, tokenizer = loaded
    # An mlx-lm cache list is no error: it runs DFlash (tests/test_mlx_lm_cache.py checks its contents).
    # (a fixed block: the adaptive one may sit at plain decoding with this random drafter)
    listed = list(
        plugin.stream_generate(
            model, tokenizer, PROMPT, prompt_cache=mlx_lm_make_prompt_cache(model), num_draft_tokens=15
        )
    )
    assert sum(r.from_draft for r in listed) > 0
    with pytest.raises(ValueError, match="prompt_cache: a DFlash prompt cache cannot be used by mlx-lm"):
        plugin.stream_generate(
            model,
            tokenizer,
            PROMPT,
            prompt_cache=plugin.make_prompt_cache(model),
            sampler=lambda x: mx.argmax(x, axis=-1),
        )
    with pytest.raises(ValueError, match="max_kv_size"):
        plugin.make_prompt_cache(model, max_kv_size=64)
    other = load_draft(dirs[1], model)
    with pytest.raises(ValueError, match="another model or drafter"):
        plugin.stream_generate(
            model, tokenizer, PROMPT, draft_model=other, prompt_cache=plugin.make_prompt_cache(model)
        )
    plain, _ = mlx_lm.load(str(dirs[0]))
    assert isinstance(plugin.make_prompt_cache(plain, max_kv_size=64), list)  # no drafter: mlx-lm's cache


def test_verbose_generate_prints_like_mlx_lm(loaded, capsys):
    model, tokenizer = loaded
    outputs = []
    for generate in (plugin.generate, mlx_lm.generate):
        text = generate(model, tokenizer, PROMPT, max_tokens=30, verbose=True)
        outputs.append((text, re.sub(r"\d+\.\d+", "X", capsys.readouterr().out)))
    assert outputs[0] == outputs[1]


# --- the acceptance script --------------------------------------------------------------------

SCRIPT = """
import json
import mlx.core as mx
from mlx_lm import load, stream_generate, generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

model, tokenizer = load("Qwen/Qwen3-4B")
prompt = "hello world"
text = generate(model, tokenizer, prompt=prompt, max_tokens=60)
tokens, drafted = [], 0
for response in stream_generate(model, tokenizer, prompt, max_tokens=60, sampler=make_sampler(temp=0.0)):
    tokens.append(response.token)
    drafted += response.from_draft
penalized = generate(model, tokenizer, prompt, max_tokens=30,
                     logits_processors=make_logits_processors(repetition_penalty=1.3))
samples = []
for _ in range(2):
    mx.random.seed(7)
    samples.append(generate(model, tokenizer, prompt, max_tokens=20, sampler=make_sampler(temp=0.8, top_p=0.9)))
print(json.dumps(dict(text=text, tokens=tokens, drafted=drafted, penalized=penalized, samples=samples)))
"""


@pytest.mark.slow
def test_an_mlx_lm_script_switches_by_its_import_line(dirs, tmp_path):
    """The same script, import line changed, run in a fresh process: same greedy text, drafted tokens.

    It loads "Qwen/Qwen3-4B"; local directories of that name and of the drafter
    models.toml registers for it ("z-lab/Qwen3-4B-DFlash-b16") stand in for the
    real repos, so the registry path runs offline on the tiny pair.
    """
    target, draft = dirs
    for link, where in (("Qwen/Qwen3-4B", target), ("z-lab/Qwen3-4B-DFlash-b16", draft)):
        (tmp_path / link).parent.mkdir(exist_ok=True)
        (tmp_path / link).symlink_to(where)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    results = []
    for line in (
        "from mlx_lm import load, stream_generate, generate",
        "from dflash_mlx.mlx_lm import load, stream_generate, generate",
    ):
        script = SCRIPT.replace("from mlx_lm import load, stream_generate, generate", line)
        assert script != SCRIPT or line.startswith("from mlx_lm")
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        assert "falling back" not in run.stderr
        results.append(json.loads(run.stdout))
    mlx, dflash = results
    assert dflash["text"] == mlx["text"] and dflash["tokens"] == mlx["tokens"]
    assert dflash["penalized"] == mlx["penalized"]
    assert mlx["drafted"] == 0 and dflash["drafted"] > 10
    assert dflash["samples"][0] == dflash["samples"][1]  # mx.random.seed makes sampled DFlash reproducible

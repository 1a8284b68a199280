"""DFlash on every mlx-lm architecture: greedy output equal to mlx-lm's, drafting happening.

The targets are tiny random models of each model type in ``helpers.architectures`` (mlx-lm 0.32's own
``test_all_models`` table, plus kimi_k25, muse_glimmer and glm_moe_dsa), each with a random drafter reading
two of its layers. At fixed blocks 1, 4 and 8 the random drafter and the oracle (which offers every
acceptance length, so every kind of cache is rolled back by every amount) must reproduce mlx-lm's greedy
stream. The families with published drafters run in the fast loop, the rest of the table in the slow one.
Also here: the user's model is left as it was, and two threads can generate on one model at once.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash_mlx import stream_batch_generate, stream_generate
from dflash_mlx.batch.ragged_cache import batch_problem
from dflash_mlx.targets.adapter import TargetAdapter
from dflash_mlx.targets.capture import Tap
from dflash_mlx.targets.gated_delta import Recording
from helpers import check_first_two_sampled_tokens, check_lossless, prompt_ids, reference, without_eos
from helpers.architectures import ARCHITECTURES, arch_pair

# mlx-lm families with drafters published by z-lab or the model's vendor (models.toml) or announced.
PUBLISHED = [
    "minimax",
    "glm4_moe",
    "glm4_moe_lite",
    "deepseek_v32",
    "glm_moe_dsa",
    "laguna",
    "kimi_linear",
    "kimi_k25",
    "gemma4",
    "qwen3_5",
    "muse_glimmer",
]
RECURRENT = {
    "kimi_linear",
    "jamba",
    "mamba2",
    "nemotron_h",
    "granitemoehybrid",
    "rwkv7",
    "bailing_moe_linear",
    "lfm2-vl",
    "baichuan_m1",
    "longcat_flash_ngram",
}
UNBATCHED = {"afm7", "llama4", "longcat_flash", "deepseek_v32", "glm_moe_dsa"}  # positions; chunked, CacheList


@pytest.fixture(scope="session")
def arch_root(tmp_path_factory):
    return tmp_path_factory.mktemp("architectures")


@pytest.mark.parametrize(
    "model_type", [pytest.param(m, marks=[] if m in PUBLISHED else [pytest.mark.slow]) for m in ARCHITECTURES]
)
def test_greedy_dflash_equals_mlx_lm(arch_root, model_type):
    model, tokenizer, draft = arch_pair(model_type, arch_root)
    target = TargetAdapter(model, draft.config.target_layer_ids)
    assert target.refeeds == (model_type in RECURRENT)  # recurrent layers without a recording forward
    prompt = prompt_ids(12, seed=3)
    for block_size in (1, 4, 8):
        check_lossless(model, tokenizer, draft, prompt, 32, block_size)


@pytest.mark.parametrize(
    "model_type", [pytest.param(m, marks=[] if m in PUBLISHED else [pytest.mark.slow]) for m in ARCHITECTURES]
)
def test_batched_rows_equal_served_alone_or_the_batch_says_why_not(arch_root, model_type):
    """Rows of different lengths verified together each give their served-alone tokens, or the target is
    served one request at a time (`batch_problem`: recurrent layers fed again, CacheList / chunked caches)."""
    model, tokenizer, draft = arch_pair(model_type, arch_root)
    problem = batch_problem(model)
    if problem is not None:
        assert model_type in RECURRENT | UNBATCHED and "batched decoding does not support" in problem
        return
    prompts = [prompt_ids(n, seed=s) for n, s in ((5, 11), (17, 12), (9, 13))]
    with without_eos(tokenizer) as tok:
        want = [[r.token for r in stream_generate(model, draft, tok, p, max_tokens=16, block_size=4)] for p in prompts]
        got = [[] for _ in prompts]
        for i, r in stream_batch_generate(model, draft, tok, prompts, max_tokens=16, block_size=4, max_batch=3):
            got[i].append(r.token)
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["minimax", "kimi_linear"])
def test_sampled_tokens_follow_the_target(arch_root, model_type):
    """Exact rejection sampling on a MoE target and on one whose recurrent layers are fed their kept rows again."""
    model, tokenizer, draft = arch_pair(model_type, arch_root)
    check_first_two_sampled_tokens(model, draft, tokenizer, prompt_ids(6, seed=5), dict(temperature=1.5))


def test_published_families_are_in_the_table():
    assert set(PUBLISHED) <= set(ARCHITECTURES) and len(ARCHITECTURES) >= 50


def test_the_users_model_is_left_as_it_was(arch_root):
    """The view is the adapter's own: the model's modules, lists and layers are the same objects after a
    generation, and no capturing wrapper is reachable from the model."""
    model, tokenizer, draft = arch_pair("qwen3_5", arch_root)
    layers, inner = list(model.layers), model.language_model.model
    before = {k: id(v) for k, v in inner.items()}
    list(stream_generate(model, draft, tokenizer, prompt_ids(9), max_tokens=12, block_size=4))
    assert all(a is b for a, b in zip(model.layers, layers)) and inner.layers is inner["layers"]
    assert {k: id(v) for k, v in inner.items()} == before
    for _, module in model.named_modules():
        assert not isinstance(module, (Tap, Recording))
        for value in module.values():
            if isinstance(value, list):
                assert not any(isinstance(v, (Tap, Recording)) for v in value)
    assert type(layers[0]).__call__ is not Tap.__call__ and isinstance(layers[0], nn.Module)


def test_two_threads_generate_on_one_model(arch_root):
    """Each thread's session has its own adapter and view: both streams equal mlx-lm's, run at once."""
    model, tokenizer, draft = arch_pair("minimax", arch_root)
    prompts = [prompt_ids(10, seed=s) for s in (1, 2)]
    with without_eos(tokenizer) as tok:
        want = [[r.token for r in reference(model, tok, p, 24)] for p in prompts]
        got, errors = [None, None], []

        def run(i):
            try:
                got[i] = [r.token for r in stream_generate(model, draft, tok, prompts[i], max_tokens=24, block_size=4)]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                mx.clear_streams()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and got == want

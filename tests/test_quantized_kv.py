"""mlx-lm's quantized KV cache (kv_bits) with DFlash: output equal to mlx-lm's with the same settings.

mlx-lm quantizes a KV cache after the forward that makes it hold `quantized_kv_start` positions; the
starts below put that point inside the prompt's chunked prefill, at the prompt's end, inside a reply
(so verifies would cross it) and at 0. The random drafter and the oracle (every acceptance length) run
at blocks 4 and 8 on a dense and a hybrid (Gated DeltaNet) target, and the plain path too.

Log-probabilities are compared within what mlx-lm's own kernels differ by (`kernel_difference`): a
verify computes its rows b at a time, mlx-lm's decoding one at a time, and a BLAS may round the two
differently in the last bit (OpenBLAS's gemv and gemm kernels do). A quantized cache can amplify that
bit: MLX's affine quantizer sets a group's scale to edge / q0, q0 = round(edge / ((max - min) / levels))
(edge: its min or max), so a last-bit change of a group's extreme can move q0 by one and rescale the
whole group by 1 / q0 (seen: one value row of the hybrid's second attention layer, 8 bits, OpenBLAS's
SkylakeX kernels, q0 159 -> 160: up to 5.6e-3 in the log-probabilities of every later token, in mlx-lm's
own forward of the same tokens 8 at a time too).
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache

from dflash_mlx import make_session, stream_generate
from dflash_mlx.mlx_lm import stream_generate as dropin_stream_generate
from helpers import assert_cycle_accounting, assert_same_stream, prompt_ids, reference, run_both, without_eos

KV = dict(kv_group_size=32)
# dflash's verifies are as wide as the reference's forwards but start where the last accepted run ended,
# and some are cut short (at quantized_kv_start, at max_tokens): the same kernel differences, on other rows.
# Measured here (16 settings, OpenBLAS's Haswell and SkylakeX kernels): dflash's difference at most 1.1x
# the reference's; both 0 (bitwise equal) where the kernels round b rows and one row alike (MLX's bundled
# BLAS, OpenBLAS's Sandybridge kernels).
KERNEL_MARGIN = 4
ULPS = 1e-5  # a few float32 ulps of a log-probability near -10: the floor where the kernels agree bitwise


def kernel_difference(model, prompt: list[int], want: list, block_size: int, **kw) -> float:
    """How far mlx-lm's own log-probabilities move when its forward takes `want`'s tokens `block_size` at
    a time instead of one at a time: the same model, prompt, settings and quantized cache (prefilled by
    mlx-lm's `generate_step`, quantized after every forward as mlx-lm does, no forward crossing
    `quantized_kv_start`), the max |difference| from `want` (mlx-lm's stream) over the reply."""
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(prompt), model, max_tokens=0, prompt_cache=cache, **kw):
        pass  # max_tokens=0: the prompt prefilled (its last token too), nothing decoded
    tokens, start = [r.token for r in want[:-1]], kw["quantized_kv_start"]
    rows: list[mx.array] = []
    while len(rows) < len(tokens):
        position = len(prompt) + len(rows)
        n = min(block_size, len(tokens) - len(rows), start - position if position < start else block_size)
        logits = model(mx.array(tokens[len(rows) : len(rows) + n])[None], cache=cache)[0]
        maybe_quantize_kv_cache(cache, start, kw["kv_group_size"], kw["kv_bits"])
        rows.extend(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return float(np.abs(np.array(mx.stack(rows)) - np.array([r.logprobs for r in want[1:]])).max())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_dflash_equals_mlx_lm_with_a_quantized_kv_cache(tiny_pair, family, bits):
    model, tokenizer, draft = tiny_pair(family, head_dim=32)
    prompt = prompt_ids(14, seed=4)
    with without_eos(tokenizer) as tok:
        for start, block_size in [(0, 8), (14, 4), (23, 8), (9, 4)]:
            kw = dict(KV, kv_bits=bits, quantized_kv_start=start, prefill_step_size=5)
            for proposer in (draft, "oracle"):
                got, want = run_both(model, tok, proposer, prompt, 40, block_size, **kw)
                kernels = kernel_difference(model, prompt, want, block_size, **kw)
                assert_same_stream(got, want, logprob_atol=max(KERNEL_MARGIN * kernels, ULPS))
                assert max(assert_cycle_accounting(got, block_size)) > 1 or proposer is draft
    plain = reference(model, tokenizer, prompt, 40, **kw)
    assert [r.token for r in stream_generate(model, None, tokenizer, prompt, max_tokens=40, **kw)] == [
        r.token for r in plain
    ]
    unquantized = reference(model, tokenizer, prompt, 40)  # the setting changes what mlx-lm computes
    assert not np.allclose(np.array(plain[-1].logprobs), np.array(unquantized[-1].logprobs), atol=1e-3)


def test_the_session_holds_what_mlx_lm_quantizes(tiny_pair):
    """Attention layers' caches are quantized once they hold quantized_kv_start positions; the Gated
    DeltaNet states stay as they are; a second turn on the session still equals mlx-lm's."""
    model, tokenizer, draft = tiny_pair("qwen3_5", head_dim=32)
    kw = dict(KV, kv_bits=8, quantized_kv_start=16)
    session = make_session(model, draft, **kw)  # the session's calls quantize unless they say otherwise
    first, second = prompt_ids(10, seed=1), prompt_ids(6, seed=2)
    with without_eos(tokenizer) as tok:
        got = [r.token for r in stream_generate(model, draft, tok, first, max_tokens=20, block_size=4, session=session)]
        assert got == [r.token for r in reference(model, tok, first, 20, **kw)]
        kinds = {type(c) for c in session.cache}
        assert kinds == {ArraysCache, QuantizedKVCache}
        history = first + got
        want = [r.token for r in reference(model, tok, history + second, 12, **kw)]
        again = [
            r.token
            for r in stream_generate(
                model, draft, tok, history + second, max_tokens=12, block_size=4, session=session, **kw
            )
        ]
    assert session.reused > 0 and again == want


def test_settings_mlx_lm_cannot_run_are_refused(tiny_pair):
    model, tokenizer, draft = tiny_pair("llama_sliding")
    with pytest.raises(ValueError, match="RotatingKVCache"):
        next(stream_generate(model, draft, tokenizer, [5, 6, 7], kv_bits=8))
    model, tokenizer, draft = tiny_pair("qwen3")
    bad_settings = [
        (dict(kv_bits=7), "kv_bits must be one of 2, 3, 4, 5, 6, 8"),
        (dict(kv_bits=8, kv_group_size=48), "kv_group_size must be one of 32, 64, 128"),
        (dict(kv_bits=8, quantized_kv_start=-1), "quantized_kv_start must be an integer >= 0"),
    ]
    for bad, match in bad_settings:
        with pytest.raises(ValueError, match=match):
            next(stream_generate(model, draft, tokenizer, [5, 6, 7], **bad))


def test_the_mlx_lm_drop_in_runs_dflash_with_kv_bits(tiny_pair):
    """No fallback to mlx-lm's decoding: cycles are DFlash's, the output and the cache list mlx-lm's."""
    model, tokenizer, draft = tiny_pair("qwen3", head_dim=32)
    prompt = prompt_ids(12, seed=5)
    kw = dict(KV, kv_bits=4, quantized_kv_start=20)
    ours_cache, theirs_cache = make_prompt_cache(model), make_prompt_cache(model)
    with without_eos(tokenizer) as tok, warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        for turn in range(2):
            ids = prompt if turn == 0 else prompt_ids(5, seed=6)
            got = list(
                dropin_stream_generate(
                    model,
                    tok,
                    mx.array(ids),
                    max_tokens=24,
                    draft_model=draft,
                    num_draft_tokens=4,
                    prompt_cache=ours_cache,
                    **kw,
                )
            )
            want = list(
                mlx_lm_stream_generate(model, tok, mx.array(ids), max_tokens=24, prompt_cache=theirs_cache, **kw)
            )
            assert [r.token for r in got] == [r.token for r in want]
            assert any(r.cycle_tokens for r in got)
    assert [type(c) for c in ours_cache] == [type(c) for c in theirs_cache] == [QuantizedKVCache] * 4
    assert [c.offset for c in ours_cache] == [c.offset for c in theirs_cache]
    assert KVCache not in {type(c) for c in ours_cache}


def test_a_verify_never_crosses_the_conversion_unquantized(tiny_pair):
    """With the oracle accepting everything, blocks of 8 would run past quantized_kv_start: the cycle
    reaching it is cut there (mlx-lm computes the rows after it with the quantized cache)."""
    model, tokenizer, _ = tiny_pair("qwen3", head_dim=32)
    prompt = prompt_ids(10, seed=7)
    kw = dict(KV, kv_bits=8, quantized_kv_start=15)
    with without_eos(tokenizer) as tok:
        got, want = run_both(model, tok, "oracle", prompt, 30, 8, **kw)
    assert [r.token for r in got] == [r.token for r in want]
    blocks = []  # (position of the cycle's anchor, block it verified)
    for i, r in enumerate(got):
        if r.cycle_block_size:
            blocks.append((len(prompt) + i - r.cycle_tokens, r.cycle_block_size))
    assert all(p + b <= 15 for p, b in blocks if p < 15), blocks
    assert any(p + b == 15 and b < 8 for p, b in blocks) and max(b for _, b in blocks) == 8, blocks


def test_flags_take_mlx_lm_values_only(tiny_pair_dirs):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    target, draft = tiny_pair_dirs("qwen3")
    cases = [
        (["--kv-bits", "7"], "--kv-bits must be one of 2, 3, 4, 5, 6, 8"),
        (["--kv-bits", "8", "--kv-group-size", "48"], "--kv-group-size must be one of 32, 64"),
    ]
    for flags, message in cases:
        r = CliRunner().invoke(app, ["generate", "hi", "--model", str(target), "--draft", str(draft), *flags])
        assert r.exit_code == 2 and message in " ".join(r.stderr.split())
    target, draft = tiny_pair_dirs("llama_sliding")
    r = CliRunner().invoke(app, ["generate", "hi", "--model", str(target), "--draft", str(draft), "--kv-bits", "8"])
    assert r.exit_code == 2 and "RotatingKVCache" in r.stderr


@pytest.mark.slow
def test_the_console_script_and_the_server_take_the_kv_flags():
    """`dflash-mlx generate` and `dflash-mlx serve` on the bundled pair with --kv-bits 8 --quantized-kv-start 0:
    the text mlx-lm's own decoding gives with the same settings."""
    import json
    import os
    import shutil
    import subprocess

    from openai import OpenAI

    import dflash_mlx
    from helpers.servers import ServeProcess

    prompt = "Tom has 3 apples and buys 4 more. How many apples?"
    flags = ["--kv-bits", "8", "--quantized-kv-start", "0"]
    model, tokenizer, _ = dflash_mlx.load("demo")  # float32 on a CPU, as the commands load it
    want = "".join(
        r.text for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=48, kv_bits=8, quantized_kv_start=0)
    )
    done = subprocess.run(
        [shutil.which("dflash-mlx"), "generate", prompt, "--raw", "--json", "-n", "48", "-b", "8", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    out = json.loads(done.stdout)
    assert done.returncode == 0 and out["text"] == want and out["acceptance_length"] > 1, done.stderr
    server = ServeProcess(*flags)
    try:
        reply = OpenAI(base_url=server.url + "/v1", api_key="unused").completions.create(
            model="demo", prompt=prompt, max_tokens=48, temperature=0
        )
    finally:
        assert server.stop() == 0
    assert reply.choices[0].text == want and "one request at a time: a quantized KV cache" in server.stderr


@pytest.mark.parametrize("bits", [8, 4])
def test_a_dspark_drafter_with_a_quantized_kv_cache(tiny_pair_dirs, tmp_path, bits):
    """The same check with a DSpark drafter (its rows drafted left to right, `proposers.dspark`)."""
    from dflash_mlx import load_draft
    from helpers import load_pair
    from helpers.dspark import make_dspark

    target_dir, _ = tiny_pair_dirs("qwen3", head_dim=32)
    model, tokenizer, _ = load_pair(target_dir)
    draft = load_draft(make_dspark(tmp_path / "dspark", target_dir, target_layer_ids=[1, 2]), model)
    prompt = prompt_ids(14, seed=4)
    with without_eos(tokenizer) as tok:
        for start, block_size in [(0, 8), (14, 4), (23, 8)]:
            kw = dict(KV, kv_bits=bits, quantized_kv_start=start, prefill_step_size=5)
            got, want = run_both(model, tok, draft, prompt, 40, block_size, **kw)
            kernels = kernel_difference(model, prompt, want, block_size, **kw)
            assert_same_stream(got, want, logprob_atol=max(KERNEL_MARGIN * kernels, ULPS))
            assert_cycle_accounting(got, block_size)

"""`python -m dflash_mlx generate` (and `python -m dflash_mlx.generate`): mlx_lm generate's flags and output.

Outputs are compared with `mlx_lm generate` run on the same flags (in this
process, through its own `main`), with the timing numbers masked. The pair is
the tiny qwen3 target with the constant drafter of tests/helpers/constant_draft.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from mlx_lm.generate import main as mlx_lm_generate_main

from dflash_mlx.mlx_lm import api as plugin_api
from dflash_mlx.mlx_lm.cli import main
from helpers import load_pair
from helpers.calibrations import cheap_blocks_cache

PROMPT = "hello world"


@pytest.fixture(scope="module")
def dirs(constant_pair_dirs):
    return constant_pair_dirs(PROMPT)


@pytest.fixture(scope="module", autouse=True)
def cheap_blocks(dirs, tmp_path_factory):
    """The adaptive block on a pinned curve: how many drafts are accepted must not depend on this machine's
    load (the commands here load the pair as `load_pair` does: float32 on a CPU)."""
    model, _, draft = load_pair(*dirs)
    with cheap_blocks_cache(tmp_path_factory.mktemp("calibration"), model, draft) as path:
        yield path


def masked(text: str) -> str:
    return re.sub(r"\d+\.\d+", "X", text)


def ours(argv, capsys) -> tuple[str, str]:
    main([str(a) for a in argv])
    out = capsys.readouterr()
    return out.out, out.err


def mlx_lm_main(argv, capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", ["mlx_lm.generate", *[str(a) for a in argv]])
    mlx_lm_generate_main()
    return capsys.readouterr().out


def dflash_line(out: str) -> tuple[int, float, int]:
    cycles, per_cycle, drafted = re.search(
        r"^DFlash: (\d+) cycles, (\d+\.\d+) tokens per cycle, (\d+) drafted tokens accepted$", out, re.M
    ).groups()
    return int(cycles), float(per_cycle), int(drafted)


def without_dflash_line(out: str) -> str:
    return re.sub(r"^DFlash: .*\n", "", out, flags=re.M)


@pytest.mark.slow
def test_both_module_spellings_print_what_mlx_lm_prints(dirs, capsys, monkeypatch):
    target, draft = dirs
    flags = ["--model", target, "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "60"]
    want = masked(mlx_lm_main(flags, capsys, monkeypatch))
    for module, prompt_flags, stdin in (("dflash_mlx", [], None), ("dflash_mlx.generate", ["--prompt", "-"], PROMPT)):
        argv = [sys.executable, "-m", module] + (["generate"] if module == "dflash_mlx" else [])
        argv += [str(f) for f in flags] + ["--draft-model", str(draft)] + prompt_flags
        run = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert run.returncode == 0, run.stderr
        assert masked(without_dflash_line(run.stdout)) == want, module
        cycles, per_cycle, drafted = dflash_line(run.stdout)
        assert drafted > 10 and per_cycle > 1


def test_chat_template_system_prompt_and_template_config(dirs, capsys, monkeypatch):
    target, draft = dirs
    flags = [
        "--model",
        target,
        "--prompt",
        "Tell me a story",
        "--system-prompt",
        "Be brief.",
        "--max-tokens",
        "30",
        "--chat-template-config",
        '{"enable_thinking": false}',
        "--verbose",
        "False",
    ]
    out, _ = ours(flags + ["--draft-model", draft], capsys)
    assert out == mlx_lm_main(flags, capsys, monkeypatch)


def test_sampling_flags_and_seed(dirs, capsys):
    target, draft = dirs
    flags = [
        "--model",
        target,
        "--draft-model",
        draft,
        "--prompt",
        PROMPT,
        "--ignore-chat-template",
        "--max-tokens",
        "40",
        "--temp",
        "3",
        "--top-p",
        "0.95",
        "--top-k",
        "50",
        "--min-p",
        "0.01",
        "--verbose",
        "False",
    ]
    runs = [ours(flags + ["--seed", seed], capsys) for seed in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]
    assert "falling back" not in runs[0][1]  # make_sampler's settings run as DFlash sampling


def test_num_draft_tokens_sets_the_block(dirs, capsys, monkeypatch):
    target, draft = dirs
    flags = ["--model", target, "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "60"]
    out, _ = ours(flags + ["--draft-model", draft, "--num-draft-tokens", "2"], capsys)
    cycles, per_cycle, drafted = dflash_line(out)
    assert 1 < per_cycle <= 3 and drafted > 0
    assert masked(without_dflash_line(out)) == masked(mlx_lm_main(flags, capsys, monkeypatch))


def test_options_dflash_cannot_honour_decode_with_mlx_lm(dirs, capsys, monkeypatch):
    target, draft = dirs
    flags = [
        "--model",
        target,
        "--prompt",
        PROMPT,
        "--ignore-chat-template",
        "--max-tokens",
        "40",
        "--max-kv-size",
        "16",
        "--verbose",
        "False",
    ]
    plugin_api.reset_warnings()  # warnings are once per process and reason
    with pytest.warns(UserWarning, match="max_kv_size is not supported with a DFlash drafter"):
        out, _ = ours(flags + ["--draft-model", draft], capsys)
    assert out == mlx_lm_main(flags, capsys, monkeypatch)


def test_an_ordinary_draft_model_runs_mlx_lm_speculative_decoding(dirs, capsys, monkeypatch):
    target, _ = dirs
    flags = [
        "--model",
        target,
        "--draft-model",
        target,
        "--prompt",
        PROMPT,
        "--ignore-chat-template",
        "--max-tokens",
        "30",
    ]
    with pytest.warns(UserWarning, match="No DFlash drafter"):
        out, _ = ours(flags, capsys)
    assert "DFlash:" not in out
    assert masked(out) == masked(mlx_lm_main(flags, capsys, monkeypatch))


def test_registered_drafter_is_the_default(dirs, tmp_path, capsys, monkeypatch):
    """--model Qwen/Qwen3-4B finds z-lab/Qwen3-4B-DFlash-b16 in models.toml (local stand-ins, offline)."""
    target, draft = dirs
    for link, where in (("Qwen/Qwen3-4B", target), ("z-lab/Qwen3-4B-DFlash-b16", draft)):
        (tmp_path / link).parent.mkdir(exist_ok=True)
        (tmp_path / link).symlink_to(where)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, _ = ours(
        ["--model", "Qwen/Qwen3-4B", "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "60"], capsys
    )
    assert dflash_line(out)[2] > 10


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "hi"], "--model is required"),
        (["--model", "M", "--image", "x.png"], "--image: dflash-mlx decodes text only"),
        (["--model", "M", "--prompt-cache-file", "c.safetensors"], "--prompt-cache-file holds mlx-lm caches"),
    ],
)
def test_refused_flags_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_other_arguments_go_to_the_dflash_mlx_command_line():
    run = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert run.returncode == 0 and run.stdout.startswith("dflash-mlx ")

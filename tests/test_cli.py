"""The dflash-mlx command line and the OpenBLAS re-exec decision."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_mlx import __version__
from dflash_mlx.cli import openblas
from dflash_mlx.cli import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", openblas.GUARD_ENV, openblas.DISABLE_ENV):
        env.pop(key, None)
    return env


def test_version_option():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"dflash-mlx {__version__}\n"


def test_models_lists_registry_entries():
    result = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "qwen3-4b" in result.output
    assert "z-lab/Qwen3-4B-DFlash-b16" in result.output
    out = " ".join(result.output.split())
    assert "RedHatAI/Qwen3.8-27B-speculator.dspark" in out and "published by the community" in out
    assert "DSpark; published by the method's authors" in out


def _console_script() -> str:
    try:
        metadata.distribution("dflash-mlx")
    except metadata.PackageNotFoundError:
        pytest.skip("dflash-mlx is not installed (pip install -e .)")
    candidate = Path(sysconfig.get_path("scripts")) / "dflash-mlx"
    found = str(candidate) if candidate.exists() else shutil.which("dflash-mlx")
    assert found, "dflash-mlx is installed but its console script was not found"
    return found


@pytest.mark.slow
def test_console_script_version_subprocess():
    # LD_PRELOAD cleared: where OpenBLAS exists this goes through the re-exec.
    result = subprocess.run(
        [_console_script(), "--version"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"dflash-mlx {__version__}\n"


# --- openblas decision logic (no real re-exec) ----------------------------------

LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
EXE = "/usr/bin/python3"
ARGV = ["python3", "-m", "dflash_mlx.cli", "models"]


def test_openblas_path_platforms(tmp_path, monkeypatch):
    assert openblas.openblas_path(system="Darwin", machine="arm64") is None
    assert openblas.openblas_path(system="Linux", machine="riscv64") is None
    fake = tmp_path / "libopenblas.so.0"
    monkeypatch.setitem(openblas.CANDIDATES, "x86_64", (str(tmp_path / "missing.so"), str(fake)))
    assert openblas.openblas_path(system="Linux", machine="x86_64") is None
    fake.write_bytes(b"")
    assert openblas.openblas_path(system="Linux", machine="x86_64") == str(fake)
    assert openblas.openblas_path(system="Darwin", machine="x86_64") is None


def test_reexec_plan_sets_preload_and_guard():
    env = {"PATH": "/bin"}
    argv, new_env = openblas.reexec_plan(LIB, env, EXE, ARGV)
    assert argv == [EXE, "-m", "dflash_mlx.cli", "models"]
    assert new_env["LD_PRELOAD"] == LIB
    assert new_env[openblas.GUARD_ENV] == "1"
    assert new_env["PATH"] == "/bin"
    assert env == {"PATH": "/bin"}  # the caller's mapping is not modified


def test_reexec_plan_prepends_to_existing_preload():
    _, new_env = openblas.reexec_plan(LIB, {"LD_PRELOAD": "/opt/libfoo.so"}, EXE, ARGV)
    assert new_env["LD_PRELOAD"] == f"{LIB}:/opt/libfoo.so"


@pytest.mark.parametrize(
    ("library", "env"),
    [
        (None, {}),
        (LIB, {openblas.DISABLE_ENV: "1"}),
        (LIB, {openblas.GUARD_ENV: "1"}),
        (LIB, {"LD_PRELOAD": LIB}),
        (LIB, {"LD_PRELOAD": f"/opt/libfoo.so {LIB}"}),
        (LIB, {"LD_PRELOAD": "/opt/openblas/lib/libopenblas.so"}),
    ],
)
def test_reexec_plan_does_nothing(library, env):
    assert openblas.reexec_plan(library, env, EXE, ARGV) is None


def test_maybe_reexec_calls_execve(monkeypatch):
    calls = []
    monkeypatch.setattr(openblas, "openblas_path", lambda: LIB)
    monkeypatch.setattr(openblas.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(openblas.os, "environ", {"PATH": "/bin"})
    monkeypatch.setattr(openblas.sys, "orig_argv", ARGV)
    openblas.maybe_reexec()
    ((path, argv, env),) = calls
    assert path == sys.executable and argv == [sys.executable, *ARGV[1:]]
    assert env["LD_PRELOAD"] == LIB and env[openblas.GUARD_ENV] == "1"


def test_maybe_reexec_without_library_is_a_no_op(monkeypatch):
    monkeypatch.setattr(openblas, "openblas_path", lambda: None)
    monkeypatch.setattr(openblas.os, "execve", lambda *a: pytest.fail("re-exec"))
    openblas.maybe_reexec()


@pytest.mark.slow
def test_reexec_child_has_openblas_preloaded():
    library = openblas.openblas_path()
    if library is None:
        pytest.skip("system OpenBLAS not installed (libopenblas0-pthread)")
    code = (
        "import os; from dflash_mlx.cli import openblas; openblas.maybe_reexec(); "
        "maps = open('/proc/self/maps').read(); "
        "print(os.environ.get('LD_PRELOAD', '')); print('libopenblas' in maps)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    preload, mapped = result.stdout.splitlines()
    assert preload == library
    assert mapped == "True"
    from dflash_mlx.utils.machine import openblas_threads

    probe = "from dflash_mlx.utils.machine import loaded_blas; print(loaded_blas())"
    for args, threads in ((["generate", "hi"], "1"), (["train"], None)):  # train: OpenBLAS's own default
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import os; from dflash_mlx.cli import openblas; openblas.maybe_reexec(); {probe}; "
                "print(os.environ.get('OPENBLAS_NUM_THREADS'))",
                *args,
            ],
            capture_output=True,
            text=True,
            env=_clean_env(),
            timeout=120,
        )
        blas, env_threads = child.stdout.splitlines()
        assert child.returncode == 0 and blas.startswith("OpenBLAS ("), (child.stdout, child.stderr)
        assert env_threads == str(threads) and (threads is None or blas.endswith("1 thread)")), child.stdout
    preloaded = {**_clean_env(), "LD_PRELOAD": library}  # preloaded by the user: no re-exec, one thread all the same
    code = f"import os; from dflash_mlx.cli import openblas; openblas.maybe_reexec(); {probe}; print(os.getpid())"
    child = subprocess.run(
        [sys.executable, "-c", code, "serve"], capture_output=True, text=True, env=preloaded, timeout=120
    )
    assert child.returncode == 0 and child.stdout.splitlines()[0].endswith("1 thread)"), (child.stdout, child.stderr)
    assert openblas_threads("/nonexistent/libopenblas.so") is None


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"^(python3? -m pytest.*)$", readme, flags=re.M)
    assert len(commands) == 1, commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(rf"^{re.escape(commands[0])}( |$)", ci, flags=re.M), commands[0]


def test_ranks_sharing_a_machine_split_its_openblas_threads(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.2:5000"]]))
    env = {"MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    assert openblas.ranks_on_this_machine(env) == 2
    assert openblas.ranks_on_this_machine({**env, "MLX_RANK": "2"}) == 1
    assert openblas.ranks_on_this_machine({}) == 1 and openblas.ranks_on_this_machine({**env, "MLX_RANK": "9"}) == 1
    monkeypatch.setattr(openblas.os, "cpu_count", lambda: 8)
    _, new_env = openblas.reexec_plan(LIB, env, EXE, ARGV)
    assert new_env["OPENBLAS_NUM_THREADS"] == "4"
    _, new_env = openblas.reexec_plan(LIB, {**env, "OPENBLAS_NUM_THREADS": "3"}, EXE, ARGV)
    assert new_env["OPENBLAS_NUM_THREADS"] == "3"  # the user's choice stays
    assert openblas.reexec_plan(LIB, {}, EXE, ARGV, ["models"])[1]["OPENBLAS_NUM_THREADS"] == "1"  # (below)


@pytest.mark.parametrize(
    ("args", "threads"),
    [(["serve", "--port", "0"], "1"), (["--verbose", "generate", "hi"], "1"), (["train", "--steps", "2"], None)],
)
def test_decoding_commands_run_openblas_on_one_thread(args, threads):
    """One thread for decoding (its matmuls have a few rows), OpenBLAS's default for `train`, the user's own
    count kept."""
    env = openblas.reexec_plan(LIB, {}, EXE, ARGV, args)[1]
    assert env.get("OPENBLAS_NUM_THREADS") == threads
    assert openblas.reexec_plan(LIB, {"OPENBLAS_NUM_THREADS": "2"}, EXE, ARGV, args)[1]["OPENBLAS_NUM_THREADS"] == "2"


def test_tables_and_headers_name_the_drafters_kind(tiny_pair):
    """`dflash-mlx bench`'s legs and the chat header say DFlash, DFlash 2, DSpark, MTP or a proposer's name."""
    from dflash_mlx.cli.common import drafter_label
    from dflash_mlx.proposers.oracle import OracleProposer

    _, _, draft = tiny_pair("qwen3")
    assert drafter_label(draft) == "DFlash"
    assert drafter_label(OracleProposer([1], [0], 8)) == "oracle"

    class Heads:
        name = "mtp"

    assert drafter_label(Heads()) == "MTP"

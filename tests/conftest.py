"""Shared pytest fixtures: tiny on-disk models, built once per session.

``tiny_target(family, **kw)`` and ``tiny_draft(target_dir, **kw)`` are
memoizing factories over ``helpers.make_target`` / ``make_draft`` (tests/helpers/):
the same arguments return the same directory, so many tests share one build.
``tiny_pair(family, **target_kw)`` is the loaded (model, tokenizer, drafter) of a
target and its random drafter (target_layer_ids [1, 2]); ``tiny_pair_dirs`` their
directories; ``constant_pair_dirs(prompt)`` the qwen3 target with the drafter that
always proposes the token its greedy continuation of ``prompt`` repeats.
Treat the returned directories and loaded objects as read-only (``without_eos``
gives a tokenizer copy).

The run itself: block-size calibrations are cached in a private directory
(``DFLASH_MLX_CACHE_DIR``); pytest re-executes once with the system OpenBLAS preloaded,
as the CLI does (`dflash_mlx.cli.openblas`; ``DFLASH_MLX_NO_REEXEC=1`` opts out),
and the session fails if any test left a child process, a thread or a
listening socket behind (`_nothing_left_behind`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import helpers  # noqa: E402


def _key(*args, **kwargs) -> str:
    """A short stable name for an argument set (values must be JSON-able)."""
    text = json.dumps([args, kwargs], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


class _Builder:
    """Calls ``build(out_dir, *args, **kwargs)`` once per distinct arguments."""

    def __init__(self, root: Path, build, prefix: str):
        self._root, self._build, self._prefix = root, build, prefix
        self._cache: dict = {}

    def __call__(self, *args, **kwargs) -> Path:
        key = _key(*args, **kwargs)
        if key not in self._cache:
            out = self._root / f"{self._prefix}-{key}"
            self._cache[key] = self._build(out, *args, **kwargs)
        return self._cache[key]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """Factory: ``tiny_target("qwen3", dtype="bfloat16", ...) -> Path``."""
    return _Builder(tmp_path_factory.mktemp("targets"), helpers.make_target, "target")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """Factory: ``tiny_draft(target_dir, num_layers=2, ...) -> Path``."""
    return _Builder(tmp_path_factory.mktemp("drafts"), helpers.make_draft, "draft")


@pytest.fixture(scope="session")
def mtp_target(tmp_path_factory):
    """Factory: ``mtp_target("qwen3_next", mtp_layers=1, ...) -> Path`` (a target keeping MTP heads,
    ``helpers.make_mtp_target``)."""
    return _Builder(tmp_path_factory.mktemp("mtp-targets"), helpers.make_mtp_target, "mtp")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """Factory: ``tiny_tokenizer(add_bos=False) -> Path`` (tokenizer files only)."""

    def build(out_dir, add_bos=False):
        helpers.make_tokenizer(out_dir, add_bos=add_bos)
        return out_dir

    return _Builder(tmp_path_factory.mktemp("tokenizers"), build, "tok")


@pytest.fixture(scope="session")
def qwen3_target(tiny_target) -> Path:
    """The default float32 qwen3 target (4 layers, hidden 64)."""
    return tiny_target("qwen3")


@pytest.fixture(scope="session")
def qwen3_model(qwen3_target):
    """``qwen3_target`` as plain ``mlx_lm.load`` returns it (read-only)."""
    import mlx_lm

    return mlx_lm.load(str(qwen3_target))[0]


@pytest.fixture(scope="session")
def tiny_pair_dirs(tiny_target, tiny_draft):
    """Factory: ``tiny_pair_dirs(family="qwen3", *, draft_kw=None, **target_kw) -> (target_dir, draft_dir)``.

    The draft is 2-layer nested-schema with target_layer_ids [1, 2] (plus
    ``draft_kw``): for a 4-layer target the spec's derivation rule gives
    [1, 1], and distinct layers catch more bugs.
    """

    def get(family="qwen3", *, draft_kw=None, **target_kw):
        target_dir = tiny_target(family, **target_kw)
        return target_dir, tiny_draft(target_dir, target_layer_ids=[1, 2], **(draft_kw or {}))

    return get


@pytest.fixture(scope="session")
def tiny_pair(tiny_pair_dirs):
    """Factory: ``tiny_pair(family="qwen3", *, draft_kw=None, **target_kw) -> (model, tokenizer, drafter)``.

    Loaded once per directory pair (``helpers.load_pair``) and shared by every
    test: never mutate them (``with without_eos(tokenizer) as tok`` is a copy).
    """

    def get(family="qwen3", *, draft_kw=None, **target_kw):
        return helpers.load_pair(*tiny_pair_dirs(family, draft_kw=draft_kw, **target_kw))

    return get


@pytest.fixture(scope="session")
def qwen3_draft(tiny_pair_dirs) -> Path:
    """The 2-layer draft bound to ``qwen3_target`` (``tiny_pair_dirs("qwen3")``)."""
    return tiny_pair_dirs("qwen3")[1]


@pytest.fixture(scope="session")
def constant_pair_dirs(qwen3_target, tmp_path_factory):
    """Factory: ``constant_pair_dirs(prompt) -> (qwen3_target, constant drafter dir)``.

    The drafter always proposes the token the target's greedy continuation of
    ``prompt`` repeats most (``helpers.constant_draft``), so drafts get accepted.
    """

    def build(out_dir, prompt):
        token = helpers.repeated_token(qwen3_target, prompt)
        return qwen3_target, helpers.make_constant_draft(out_dir, qwen3_target, token)

    return _Builder(tmp_path_factory.mktemp("const"), build, "draft")


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    """A private, empty calibration cache for one test (`<tmp>/calibration`, yielded), with this process's
    cost models forgotten before and after."""
    from dflash_mlx.policy.calibration import forget

    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path))
    forget()
    yield tmp_path / "calibration"
    forget()


def pytest_configure(config):
    """Re-run this pytest with OpenBLAS preloaded (MLX's bundled BLAS is ~30x slower here).

    Here pytest's output capture is suspended (the original descriptors are
    back in place), so the new process writes to the terminal as usual."""
    if any("pytest" in os.path.basename(a) for a in sys.orig_argv[1:3]):
        from dflash_mlx.cli.openblas import maybe_reexec

        maybe_reexec()
    # Servers started by the tests are stopped with SIGINT, as Ctrl-C in a terminal would. A suite
    # started in the background by a non-interactive shell inherits SIGINT ignored, and so would
    # every server it starts (they could not be stopped): give the children the terminal's default.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Block-size calibrations go to a private cache (subprocesses inherit it), never the user's.
    if "DFLASH_MLX_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["DFLASH_MLX_CACHE_DIR"] = config._dflash_cache_dir = tempfile.mkdtemp(prefix="dflash-mlx-cache-")


def pytest_unconfigure(config):
    folder = getattr(config, "_dflash_cache_dir", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("DFLASH_MLX_CACHE_DIR", None)


def pytest_report_header(config):
    preload = os.environ.get("LD_PRELOAD", "")
    return f"BLAS: {'system OpenBLAS preloaded' if 'openblas' in preload else 'MLX bundled (slow on Linux)'}"


def _children() -> list[str]:
    """Processes whose parent is this one (zombies included), as 'pid command'."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == me:
                command = (entry / "cmdline").read_bytes().replace(bytes(1), b" ").decode(errors="replace")
                found.append(f"{entry.name} {command[:120]}")
        except (OSError, ValueError):
            continue  # it ended meanwhile
    return found


def _listening_sockets() -> set[str]:
    """Inodes of this process's sockets in the LISTEN state."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    listening = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in mine:
                listening.add(cols[9])
    return listening


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind():
    """After the last test: no child process, no new thread, no listening socket of ours."""
    if not Path("/proc/self/fd").is_dir():
        yield
        return
    threads, sockets = set(threading.enumerate()), _listening_sockets()
    yield
    deadline = time.monotonic() + 10  # daemon threads and children a test stopped may still be ending
    while True:
        children = _children()
        extra = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        ports = _listening_sockets() - sockets
        if not (children or extra or ports) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    problems = [f"child process {c}" for c in children] + [f"thread {t.name}" for t in extra]
    problems += [f"listening socket inode {p}" for p in sorted(ports)]
    assert not problems, "the test run left behind: " + "; ".join(problems)

"""Make MLX's Linux CPU backend use the system OpenBLAS (LD_PRELOAD re-exec).

MLX's Linux CPU wheel bundles a slow reference BLAS. Preloading the system
OpenBLAS (Debian: ``libopenblas0-pthread``) makes MLX's float32 matmuls use it
instead. LD_PRELOAD only works when set before the process starts, so the CLI
re-executes itself once with it set. Does nothing on macOS (MLX uses
Accelerate and Metal there). Set ``DFLASH_MLX_NO_REEXEC=1`` to opt out.

OpenBLAS runs on one thread (OPENBLAS_NUM_THREADS=1, unless set) for every
command but ``train``: a decoding step's matmuls have one to a few rows, and
OpenBLAS's threads cost more to wake and join there than they save; with other
jobs on the cores, a threaded matmul also waits for a core for each of its
threads (docs/benchmarks.md, "One OpenBLAS thread"). Training's matmuls have
hundreds of rows: it keeps OpenBLAS's default, every core. Ranks that
``mlx.launch`` starts on one machine (a ring hostfile listing the same address
more than once) share its cores: each gets cores / ranks threads there
(unless set), as oversubscribed OpenBLAS threads and the ring's busy-waiting
ranks slow each other down.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence

from ..utils.machine import mapped_openblas

DISABLE_ENV = "DFLASH_MLX_NO_REEXEC"
GUARD_ENV = "_DFLASH_MLX_OPENBLAS_REEXEC"

# Debian / Ubuntu multiarch locations of the pthread OpenBLAS.
CANDIDATES = {
    "x86_64": ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",),
    "aarch64": ("/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",),
}


def openblas_path(system: str | None = None, machine: str | None = None) -> str | None:
    """Path of the system OpenBLAS to preload, or None (not Linux, not installed)."""
    system = platform.system() if system is None else system
    machine = platform.machine() if machine is None else machine
    if system != "Linux":
        return None
    for path in CANDIDATES.get(machine.lower(), ()):
        if os.path.exists(path):
            return path
    return None


def _preloaded(library: str, ld_preload: str) -> bool:
    """True if ``library`` (or any libopenblas) is already in LD_PRELOAD."""
    target = os.path.realpath(library)
    for item in ld_preload.replace(":", " ").split():
        if os.path.basename(item).startswith("libopenblas"):
            return True
        if os.path.realpath(item) == target:
            return True
    return False


def reexec_plan(
    library: str | None,
    env: Mapping[str, str],
    executable: str,
    orig_argv: Sequence[str],
    args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]] | None:
    """The (argv, environment) to re-exec with, or None to carry on as is.

    Pure decision logic: ``library`` comes from ``openblas_path()``, ``env`` is
    the current environment, ``orig_argv`` the interpreter's original command
    line (``sys.orig_argv``: keeps ``-m module`` and interpreter options),
    ``args`` the program's own arguments (``sys.argv[1:]``: its command).
    """
    if library is None or env.get(DISABLE_ENV) or env.get(GUARD_ENV):
        return None
    current = env.get("LD_PRELOAD", "")
    if _preloaded(library, current):
        return None
    if not executable or not orig_argv:
        return None
    new_env = dict(env)
    new_env["LD_PRELOAD"] = f"{library}:{current}" if current else library
    new_env[GUARD_ENV] = "1"
    threads = blas_threads(env, args)
    if threads is not None:
        new_env["OPENBLAS_NUM_THREADS"] = str(threads)
    return [executable, *orig_argv[1:]], new_env


def blas_threads(env: Mapping[str, str], args: Sequence[str]) -> int | None:
    """OpenBLAS's thread count for a command run with ``args`` (None: OpenBLAS's default, every core, or
    the count the environment sets): one for decoding, cores / ranks for ranks sharing a machine, the
    default for ``train``."""
    if "OPENBLAS_NUM_THREADS" in env:
        return None
    local = ranks_on_this_machine(env)
    if local > 1:
        return max(1, (os.cpu_count() or 1) // local)
    command = next((a for a in args if not a.startswith("-")), None)
    return None if command == "train" else 1


def ranks_on_this_machine(env: Mapping[str, str]) -> int:
    """How many ranks of an ``mlx.launch`` ring share this rank's address (1 when unknown)."""
    try:
        rank = int(env["MLX_RANK"])
        with open(env["MLX_HOSTFILE"], encoding="utf-8") as f:
            hosts = json.load(f)
        address = lambda entry: str(entry[0] if isinstance(entry, list) else entry).rsplit(":", 1)[0]  # noqa: E731
        mine = address(hosts[rank])
        return sum(address(entry) == mine for entry in hosts)
    except (KeyError, ValueError, OSError, IndexError, TypeError):
        return 1


def maybe_reexec() -> None:
    """Re-execute the current process with OpenBLAS preloaded, when that helps.

    Returns normally when nothing is to be done; otherwise does not return.
    Only for a program's entry point: it replaces the whole process.
    """
    plan = reexec_plan(openblas_path(), os.environ, sys.executable, sys.orig_argv, sys.argv[1:])
    if plan is None:
        set_threads(blas_threads(os.environ, sys.argv[1:]))
        return
    argv, env = plan
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(argv[0], argv, env)
    except OSError:
        return  # could not re-exec: run on with the bundled BLAS


def set_threads(threads: int | None) -> None:
    """Run the OpenBLAS this process already has (LD_PRELOAD set by the user) on `threads` threads, here
    and in the processes it starts (None: as it is). At start, before any matmul."""
    if threads is None:
        return
    path = mapped_openblas()
    if path is None:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    try:
        ctypes.CDLL(path).openblas_set_num_threads(threads)
    except (OSError, AttributeError):
        pass

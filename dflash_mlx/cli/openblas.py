"""Make MLX's Linux CPU backend use the system OpenBLAS (LD_PRELOAD re-exec).

MLX's Linux CPU wheel bundles a slow reference BLAS. Preloading the system
OpenBLAS (Debian: ``libopenblas0-pthread``) makes MLX's float32 matmuls use it
instead. LD_PRELOAD only works when set before the process starts, so the CLI
re-executes itself once with it set. Does nothing on macOS (MLX uses
Accelerate and Metal there). Set ``DFLASH_MLX_NO_REEXEC=1`` to opt out.

Ranks that ``mlx.launch`` starts on one machine (a ring hostfile listing the
same address more than once) share its cores: each gets OPENBLAS_NUM_THREADS
= cores / ranks there (unless set), as oversubscribed OpenBLAS threads and
the ring's busy-waiting ranks slow each other down.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence

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
) -> tuple[list[str], dict[str, str]] | None:
    """The (argv, environment) to re-exec with, or None to carry on as is.

    Pure decision logic: ``library`` comes from ``openblas_path()``, ``env`` is
    the current environment, ``orig_argv`` the interpreter's original command
    line (``sys.orig_argv``: keeps ``-m module`` and interpreter options).
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
    local = ranks_on_this_machine(env)
    if local > 1 and "OPENBLAS_NUM_THREADS" not in env:
        new_env["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))
    return [executable, *orig_argv[1:]], new_env


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
    plan = reexec_plan(openblas_path(), os.environ, sys.executable, sys.orig_argv)
    if plan is None:
        return
    argv, env = plan
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(argv[0], argv, env)
    except OSError:
        return  # could not re-exec: run on with the bundled BLAS

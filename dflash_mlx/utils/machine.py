"""Facts about the machine a run happens on (for `doctor`, benchmark reports and calibration keys).

Platform, chip or CPU model, MLX / mlx-lm versions, the device MLX computes
on (Metal GPU or CPU), memory, and on Linux which BLAS library the process
actually has loaded and with how many threads (MLX's bundled reference BLAS
is slow; the system OpenBLAS is what `dflash_mlx.cli.openblas` preloads).
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def chip() -> str:
    """The Apple chip (e.g. "Apple M4 Max") or the CPU model name."""
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> float | None:
    """Total physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


def loaded_blas() -> str | None:
    """On Linux: the BLAS shared library this process has mapped, OpenBLAS's with its thread count (None
    elsewhere)."""
    maps = _self_maps() if platform.system() == "Linux" else None
    if maps is None:
        return None
    path = mapped_openblas(maps)
    if path is None:
        return "MLX's bundled reference BLAS (slow)"
    threads = openblas_threads(path)
    return f"OpenBLAS ({path}" + (f", {threads} thread{'s' * (threads != 1)})" if threads else ")")


def mapped_openblas(maps: str | None = None) -> str | None:
    """The path of the OpenBLAS this process has mapped (`maps`: /proc/self/maps' text, read if not given),
    or None."""
    maps = _self_maps() if maps is None else maps
    for line in (maps or "").splitlines():
        path = line.split()[-1] if line.split() else ""
        if "libopenblas" in os.path.basename(path):
            return path
    return None


def _self_maps() -> str | None:
    """This process's /proc/self/maps (None where there is none: not Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def openblas_threads(path: str) -> int | None:
    """The thread count of the OpenBLAS mapped at `path` (None if it cannot be asked)."""
    try:
        return int(ctypes.CDLL(path).openblas_get_num_threads())
    except (OSError, AttributeError):
        return None


def device() -> str:
    import mlx.core as mx

    return "Metal GPU" if mx.metal.is_available() else "CPU"


def describe(**extra) -> dict:
    """A JSON-ready description of this machine and software (plus `extra` fields)."""
    info = {
        "os": platform.platform(),
        "chip": chip(),
        "cpu_count": os.cpu_count(),
        "memory_gb": round(memory_gb() or 0, 1) or None,
        "python": platform.python_version(),
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "dflash_mlx": package_version("dflash-mlx"),
        "device": device(),
    }
    blas = loaded_blas()
    if blas is not None:
        info["blas"] = blas
    info.update(extra)
    return info

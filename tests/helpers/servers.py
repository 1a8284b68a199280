"""Servers in subprocesses, as users start them: ``dflash-mlx serve`` and ``mlx_lm.server``.

Both are waited on by readiness (a line on stderr), never by fixed sleeps,
and stopped as a user stops them (SIGINT, killed after 60 s). Their stderr
is read by a thread into `lines`.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

READY_TIMEOUT = 240  # a loaded 2-core machine may take long to import MLX and load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServerProcess:
    name = "server"

    def __init__(self, command: list[str], **popen):
        popen.setdefault("stdin", subprocess.DEVNULL)
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-stderr", daemon=True)
        self._reader.start()
        self.url = self._wait_ready()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def _ready(self, line: str) -> str | None:
        raise NotImplementedError

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            url = self._ready(line)
            if url:
                return url
        self.stop()
        pytest.fail(f"{self.name} did not become ready:\n" + "".join(self.lines))

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        """SIGINT, as Ctrl-C; returns the exit status (killed after 60 s)."""
        if self.proc.poll() is None:
            self._interrupt()
        try:
            status = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self._reader.join(10)
        self.proc.stderr.close()
        return status

    def _interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)


class ServeProcess(_ServerProcess):
    """`dflash-mlx serve --port 0 ...` (the console script); `url` has no /v1."""

    name = "dflash-mlx serve"

    def __init__(self, *args: str):
        exe = shutil.which("dflash-mlx")
        assert exe, "the dflash-mlx console script is not installed (pip install -e '.[test]')"
        super().__init__([exe, "serve", "--port", "0", *args])

    def _ready(self, line: str) -> str | None:
        if "serving" in line and " at http://" in line:
            return line.split(" at ")[1].split()[0].removesuffix("/v1")
        return None


class ShardedServeProcess(ServeProcess):
    """`mlx.launch --backend ring -n RANKS -- dflash-mlx serve --shard tensor --port 0 ...` (loopback ranks).

    `stop` sends SIGINT to the ranks (the processes of the launch's own group but mlx.launch):
    rank 0 stops its server and ends the followers, and mlx.launch reports their exits. (Ctrl-C
    in a terminal also interrupts mlx.launch 0.32, which then dies with a traceback.)
    """

    name = "mlx.launch dflash-mlx serve --shard tensor"

    def __init__(self, *args: str, ranks: int = 2, env: dict | None = None):
        exe, launch = shutil.which("dflash-mlx"), shutil.which("mlx.launch")
        assert exe and launch, "dflash-mlx and mlx.launch must be installed"
        # stdin: a pipe kept open (mlx.launch 0.32 busy-loops on a stdin at end of file, e.g. /dev/null)
        _ServerProcess.__init__(
            self,
            [
                launch,
                "--backend",
                "ring",
                "-n",
                str(ranks),
                "--",
                exe,
                "serve",
                "--port",
                "0",
                "--shard",
                "tensor",
                *args,
            ],
            env=env,
            start_new_session=True,
            stdin=subprocess.PIPE,
        )

    def stop(self) -> int:
        status = super().stop()
        self.proc.stdin.close()
        return status

    def _interrupt(self) -> None:
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.proc.pid:
                try:
                    if os.getpgid(int(entry)) == self.proc.pid:
                        os.kill(int(entry), signal.SIGINT)
                except OSError:
                    continue


class MlxLmServer(_ServerProcess):
    """`python -m mlx_lm.server --model DIR --port P ...`: mlx-lm's own server, the reference."""

    name = "mlx_lm.server"

    def __init__(self, model: str, *args: str):
        self.port = free_port()
        super().__init__(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(self.port), *args]
        )

    def _ready(self, line: str) -> str | None:
        return f"http://127.0.0.1:{self.port}" if "Starting httpd" in line else None

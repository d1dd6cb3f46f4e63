"""Start and stop a real ``preft serve`` in a child process, on loopback (tests, the soak benchmark)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SERVE_COMMAND = [sys.executable, "-m", "preft.cli", "serve"]
PORT_TAKEN = ("Address already in use", "cannot listen on")


def start_server(args: list[str], log: Path, timeout_s: float = 240, env: dict | None = None,
                 attempts: int = 3) -> tuple[subprocess.Popen, str, float]:
    """``preft serve ARGS --port P`` until ``/health`` answers: ``(process, url, seconds to ready)``.

    A free port is only free when probed: another process (a parallel test's engine picks its own
    ports) can take it before the server binds it, so a server that dies on a taken port is
    started again on a fresh one, up to ``attempts`` times."""
    for _ in range(attempts - 1):
        try:
            return _start_once(args, log, timeout_s, env)
        except PortTaken:
            pass
    return _start_once(args, log, timeout_s, env)


class PortTaken(RuntimeError):
    """The server died because its port was taken before it could bind it."""


def _start_once(args: list[str], log: Path, timeout_s: float, env: dict | None
                ) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    with open(log, "w") as handle:
        proc = subprocess.Popen([*SERVE_COMMAND, "--port", str(port), *args],
                                stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    started, url = time.time(), f"http://127.0.0.1:{port}"
    while time.time() - started < timeout_s:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url, time.time() - started
        except OSError:
            if proc.poll() is not None:
                text = log.read_text()
                died = PortTaken if any(marker in text for marker in PORT_TAKEN) else RuntimeError
                raise died("preft serve died:\n" + text[-4000:])
            time.sleep(0.5)
    kill_tree(proc)
    raise RuntimeError(f"preft serve not ready in {timeout_s:.0f} s:\n" + log.read_text()[-4000:])


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the server and every process under it: vLLM's engine core and workers outlive a
    killed API server (they hold the cores and the KV memory until killed)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    proc.kill()
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(proc)

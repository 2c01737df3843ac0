"""A real vLLM OpenAI-compatible server as a subprocess for the vLLM tests (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm`` console script is broken in the CPU build), on 127.0.0.1 and a free
port, its engine in process (VLLM_ENABLE_V1_MULTIPROCESSING=0: one process to stop), stopped by its pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)


@contextmanager
def vllm_server(arguments: Sequence[str], log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``(url, process)`` of a healthy server started with ``arguments`` (after the module name; host and port are
    added), its output in ``log``; RuntimeError with the log's tail when it does not start."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *arguments]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the vLLM server did not become healthy (exit {process.poll()}):\n{tail}")
            time.sleep(0.5)
        yield url, process
    finally:
        stop(process)

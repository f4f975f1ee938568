"""The launcher (`make run`'s `python -m deploy.launcher`) as its own process: Ctrl-C stops the whole stack."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

from tests.conftest import free_port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigint_stops_the_stack_even_when_the_shell_ignored_it() -> None:
    """A non-interactive shell starts a background job (`make run &` in a script) with SIGINT ignored, and
    Python then leaves SIGINT ignored too: the launcher must take it back, so SIGINT stops every service
    (exit code 0, the gateway's port closed) as Ctrl-C does in a terminal."""
    port = free_port()
    sizes = ["--host-kv-mib", "64", "--max-context", "1024", "--kv-capacity", "2048", "--ready-timeout", "300"]
    argv = [sys.executable, "-m", "deploy.launcher", "--port", str(port), *sizes]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as the shell does
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # until the stack is up (or the launcher exits)
            lines.append(line)
            if "KVMem is up" in line:
                break
        assert _listening(port), "".join(lines[-20:])
        threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True).start()  # a full pipe would block
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        deadline = time.monotonic() + 10
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(port)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)

"""The eval harness's server process: a server killed on a timeout takes its children with it."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from preft.eval.harness.server_process import kill_tree

# a parent that starts a grandchild-holding child, as preft serve (exec'd into vLLM's API server)
# starts vLLM's engine core, which starts its worker
SPAWNS_TWO_LEVELS = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
time.sleep(600)
"""


def test_kill_tree_kills_the_server_and_everything_under_it():
    proc = subprocess.Popen([sys.executable, "-c", SPAWNS_TWO_LEVELS])
    deadline = time.time() + 30
    while len(psutil.Process(proc.pid).children(recursive=True)) < 2 and time.time() < deadline:
        time.sleep(0.1)
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert len(descendants) == 2
    kill_tree(proc)
    assert proc.poll() is not None
    gone, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"left running: {[p.pid for p in alive]}"


# stands in for preft serve: binds --port and answers /health, as the real server does once ready
HEALTH_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_port_taken_before_the_server_binds_it_is_retried_on_a_fresh_one(tmp_path, monkeypatch):
    import socket

    from preft.eval.harness import server_process

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    handed_out = []
    probe = server_process.free_port
    monkeypatch.setattr(server_process, "free_port",
                        lambda: handed_out.append(taken_port if not handed_out else probe()) or handed_out[-1])
    monkeypatch.setattr(server_process, "SERVE_COMMAND", [sys.executable, "-c", HEALTH_SERVER])
    try:
        proc, url, _ = server_process.start_server([], tmp_path / "server.log", timeout_s=30)
    finally:
        taken.close()
    try:
        assert handed_out[0] == taken_port and len(handed_out) == 2
        assert url == f"http://127.0.0.1:{handed_out[1]}" and proc.poll() is None
    finally:
        server_process.kill_tree(proc)


def test_a_server_that_dies_for_another_reason_is_not_retried(tmp_path, monkeypatch):
    import pytest

    from preft.eval.harness import server_process

    starts = []
    monkeypatch.setattr(server_process, "SERVE_COMMAND",
                        [sys.executable, "-c", "import sys; print('bad model'); sys.exit(2)"])
    monkeypatch.setattr(server_process, "free_port", lambda: starts.append(1) or 1)
    with pytest.raises(RuntimeError, match="bad model"):
        server_process.start_server([], tmp_path / "server.log", timeout_s=30)
    assert len(starts) == 1

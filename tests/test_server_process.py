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

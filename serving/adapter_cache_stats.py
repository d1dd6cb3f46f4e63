"""Counts of adapter loads and evictions in the engine's caches, for the API server's ``/metrics``.

An adapter reaches a request's step through two caches in the engine process:

- **host**: the adapters kept in host memory (``--max-host-adapters``, vLLM's ``--max-cpu-loras``;
  least recently used out): vLLM's LoRA cache and the ReFT-P bank's
  (:class:`preft.serving.reft.ReftBank`). An adapter not in it is read from the server's store copy.
- **slot**: the adapter slots a step runs with (``--max-adapters``; on a GPU, GPU memory): vLLM's
  LoRA slots, and the ReFT-P bank's slots.

Per ``(cache, kind)`` this process counts ``loads``, ``evictions`` and the seconds loads took
(a histogram over :data:`LOAD_BUCKETS_S`). The engine is another process than the API server,
so the counts travel by file: at the end of a step in which something changed,
:func:`flush` writes them atomically to ``STORE/.stats/engine-<pid>.json`` (``STORE``:
``PREFT_SERVE_STORE``; nothing is written outside ``preft serve``), which
:mod:`preft.serving.adapter_metrics` reads when ``/metrics`` is scraped.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
from pathlib import Path

from preft import envs

#: upper bounds (seconds) of the load-time histogram's buckets (+Inf is implicit)
LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STATS_DIR = ".stats"

_lock = threading.Lock()
_counts: dict[tuple[str, str], dict] = {}
_dirty = False


def _entry(cache: str, kind: str) -> dict:
    return _counts.setdefault((cache, kind), {"loads": 0, "evictions": 0, "load_seconds_sum": 0.0,
                                              "load_seconds_buckets": [0] * (len(LOAD_BUCKETS_S) + 1)})


def record_load(cache: str, kind: str, seconds: float) -> None:
    global _dirty
    with _lock:
        entry = _entry(cache, kind)
        entry["loads"] += 1
        entry["load_seconds_sum"] += seconds
        entry["load_seconds_buckets"][bisect.bisect_left(LOAD_BUCKETS_S, seconds)] += 1
        _dirty = True


def record_evictions(cache: str, kind: str, count: int) -> None:
    global _dirty
    if count <= 0:
        return
    with _lock:
        _entry(cache, kind)["evictions"] += count
        _dirty = True


def snapshot() -> dict[str, dict]:
    """This process's counts, ``{"cache/kind": {...}}``."""
    with _lock:
        return {f"{cache}/{kind}": json.loads(json.dumps(entry)) for (cache, kind), entry in _counts.items()}


def stats_dir() -> Path | None:
    store = envs.PREFT_SERVE_STORE
    return Path(store) / STATS_DIR if store else None


def flush() -> None:
    """Write this process's counts for the API server if they changed since the last write
    (called at the end of each engine step)."""
    global _dirty
    directory = stats_dir()
    if not _dirty or directory is None:
        return
    with _lock:
        _dirty = False
    from preft.serving.scheduling.atomic_file import write_atomically

    directory.mkdir(exist_ok=True)
    write_atomically(directory / f"engine-{os.getpid()}.json", json.dumps(snapshot()))


def read_all(directory: Path | None = None, skip_pid: int | None = None) -> dict[str, dict]:
    """The counts of every engine process of this server, summed (a file being replaced or
    unreadable is skipped for this scrape; ``skip_pid``: the caller's own, whose counts it has
    in memory when the engine runs in its process)."""
    directory = directory or stats_dir()
    total: dict[str, dict] = {}
    if directory is None or not directory.is_dir():
        return total
    for path in sorted(directory.glob("engine-*.json")):
        if path.name == f"engine-{skip_pid}.json":
            continue
        try:
            counts = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        add_counts(total, counts)
    return total


def add_counts(total: dict[str, dict], counts: dict[str, dict]) -> dict[str, dict]:
    """``total`` with ``counts`` (both ``{"cache/kind": {...}}``) added into it."""
    for key, entry in counts.items():
        into = total.setdefault(key, {"loads": 0, "evictions": 0, "load_seconds_sum": 0.0,
                                      "load_seconds_buckets": [0] * (len(LOAD_BUCKETS_S) + 1)})
        into["loads"] += entry["loads"]
        into["evictions"] += entry["evictions"]
        into["load_seconds_sum"] += entry["load_seconds_sum"]
        into["load_seconds_buckets"] = [a + b for a, b in zip(into["load_seconds_buckets"],
                                                              entry["load_seconds_buckets"])]
    return total

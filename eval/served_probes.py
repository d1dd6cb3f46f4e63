"""Served probes kept in a run directory, so that no trace is served twice to the same server.

    search key   = sha256(model, server arguments, workload, seed, requests, batch limits, adapters)
    probe record = {search key, search label, rate, sha256(trace), timings, step log}

An SLO capacity search (:func:`preft.eval.slo_capacity.served`) serves one trace per rate on a
fresh server. A fixed chunk's server does not depend on the TPOT target, so its probes at one
target are its probes at the other: their timings, judged against the other target, are free
probes for that search (:func:`preft.eval.slo_capacity.search`'s ``known``). The records also
make a capacity run resumable: run again with the same ``--out`` and each search reads back the
probes it served (its label: workload, target, round, policy), which count in its
``--capacity-probes``, and serves only the rest; a search added (another ``--engine-tpot-scales``)
starts from the probes it can share. A record is used only when the trace made again at its rate
is the same to the byte (a changed workload generator or seed serves anew). SLOWeave's server
takes the target (``--tpot-ms``), so its search key differs per target and nothing is shared.

``OUT/goodput/capacity/probes.jsonl``: one JSON record a line, the file rewritten whole on each
new probe (:func:`~preft.serving.scheduling.atomic_file.write_atomically`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any


def search_key(model_dir: str, policy_args: list[str], kind: str, seed: int, settings: dict) -> str:
    """What, besides the rate, decides what a probe serves and how."""
    adapters = settings.get("bundles") or {}
    described = {"model": str(model_dir), "server": list(policy_args), "workload": kind, "seed": seed,
                 "requests": settings["engine_requests"], "max_len": settings["max_len"],
                 "max_num_seqs": settings["max_num_seqs"], "max_num_batched_tokens": settings["max_num_batched_tokens"],
                 "adapters": sorted(adapters), "slots": settings.get("slots", 0)}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def trace_digest(text: str) -> str:
    """The sha256 of a trace's text (:func:`~preft.serving.scheduling.workloads.trace_text`)."""
    return hashlib.sha256(text.encode()).hexdigest()


class ServedProbes:
    """The probe records of one run directory (module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "probes.jsonl"
        self.records: list[dict[str, Any]] = []
        if self.path.is_file():
            self.records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def of_search(self, key: str) -> list[dict[str, Any]]:
        """Every record served under ``key``, in the order served."""
        return [record for record in self.records if record["search"] == key]

    def add(self, key: str, label: str, rate: float, trace_text: str, timings: list, step_log: str) -> dict[str, Any]:
        from preft.serving.scheduling.atomic_file import write_atomically

        record = {"search": key, "label": label, "rate": rate, "trace_sha256": trace_digest(trace_text),
                  "step_log": step_log, "timings": [asdict(timing) for timing in timings]}
        self.records.append(record)
        write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        return record


def timings_of(record: dict[str, Any]) -> list:
    from preft.serving.scheduling.metrics import RequestTiming

    return [RequestTiming(**timing) for timing in record["timings"]]

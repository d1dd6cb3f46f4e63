"""What scheduling costs one SGLang scheduler process, per admission pass (``preft eval sglang``
reads it; on with ``PREFT_SCHEDULING_COST=FILE``):

- ``sglang_order_s``: time in SGLang's own queue ordering, ``SchedulePolicy.calc_priority``
  (LPM's and DFS-weight's radix-tree matching of every waiting request; FCFS's cache lookups);
- ``preft_order_s``: time in PreFT's admission order, outside SGLang's call (Feather: catching
  up with the queue, the Chunked Hash Tree's candidates, the bandit);
- ``step_s``: time in model steps (``Scheduler.run_batch``);
- ``admissions`` (calls of ``get_new_batch_prefill`` with a request waiting: SGLang's loop also
  calls it on idle turns, where nothing is ordered) and ``steps``.

Per admission pass, a policy's CPU cost is ``(sglang_order_s + preft_order_s) / admissions``,
and its share of the run is that sum over ``step_s``. The totals go to FILE as JSON, atomically,
at most once a second (the process is stopped by a signal, so there is no last write to wait for).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from preft.serving.scheduling.atomic_file import write_atomically

FIELDS = ("sglang_order_s", "preft_order_s", "step_s", "admissions", "steps")


class SchedulingCost:
    def __init__(self, path: str | Path, every_s: float = 1.0) -> None:
        self.path, self.every_s, self.written = Path(path), every_s, 0.0
        self.totals = dict.fromkeys(FIELDS, 0.0)

    def add(self, **amounts: float) -> None:
        for name, amount in amounts.items():
            self.totals[name] += amount
        now = time.monotonic()
        if now - self.written >= self.every_s:
            self.written = now
            write_atomically(self.path, json.dumps(self.totals))

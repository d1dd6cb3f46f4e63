"""Engines shared across test files: one engine process per configuration, started on first use.

An engine start costs 20-40 s on 2 cores; most engine tests need one of a few configurations.
:meth:`EnginePool.get` returns the running :class:`~preft.eval.harness.engine_driver.EngineProcess`
of ``(model, engine settings, env)`` (and the ``VLLM_*`` / ``PREFT_*`` variables of this
process, which a test may have set), or starts one; at most :data:`KEEP` stay alive, the least
recently used closing first (each with its engine core in its process: ``tests/conftest.py``
sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). What a test could inherit from an earlier one is
taken away:

- an engine of a new configuration replaces, when every place is taken, the least recently used
  one of the same environment in its process (:meth:`EngineProcess.load`, 3-5 s instead of 14 s
  for a new process);
- the prefix cache is emptied on every :meth:`~EnginePool.get`, so a test starts cold as on a fresh
  engine (vLLM's counters are cumulative: a test reads differences, :meth:`EnginePool.metrics_delta`);
- a LoRA's integer id names its weights in vLLM's adapter cache, so ids are handed out per bundle
  path for the whole session (:meth:`EnginePool.lora_id`): two tests' bundles never share one.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

from preft.eval.harness.engine_driver import EngineProcess

#: engines kept alive at once (each holds about 1.5 GB)
KEEP = 3


class EnginePool:
    def __init__(self, root: Path, keep: int = KEEP) -> None:
        self.root, self.keep = Path(root), keep
        self.engines: OrderedDict[str, EngineProcess] = OrderedDict()
        self.lora_ids: dict[str, int] = {}
        self.started = 0  # engine processes started
        self.loaded = 0  # engines loaded into a running process instead

    @staticmethod
    def environment(env: dict | None) -> str:
        inherited = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "PREFT_"))}
        return json.dumps({**inherited, **(env or {})}, sort_keys=True)

    def key(self, model: str, engine: dict, env: dict | None) -> str:
        return json.dumps([model, engine, self.environment(env)], sort_keys=True)

    def get(self, model: str, engine: dict | None = None, env: dict | None = None) -> EngineProcess:
        key = self.key(model, engine or {}, env)
        driver = self.engines.get(key)
        if driver is not None and driver.proc.poll() is not None:  # it died: start again
            del self.engines[key]
            driver = None
        if driver is None:
            driver = self._reuse_or_start(model, engine or {}, env)
            self.engines[key] = driver
        else:
            driver.reset_prefix_cache()
        self.engines.move_to_end(key)
        return driver

    def _reuse_or_start(self, model: str, engine: dict, env: dict | None) -> EngineProcess:
        """With every place taken, the least recently used process of the same environment loads
        the new engine (:meth:`EngineProcess.load`: vLLM stays imported); otherwise the least
        recently used closes and a new process starts."""
        if len(self.engines) >= self.keep:
            environment = self.environment(env)
            same = [k for k, d in self.engines.items() if json.loads(k)[2] == environment and d.proc.poll() is None]
            if same and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                driver = self.engines.pop(same[0])
                driver.load(model, engine)
                self.loaded += 1
                return driver
            while len(self.engines) >= self.keep:
                self.engines.popitem(last=False)[1].close()
        self.started += 1
        return EngineProcess(model, engine, env=env, log_path=self.root / f"engine-{self.started}.log")

    def lora_id(self, bundle: str) -> int:
        return self.lora_ids.setdefault(str(bundle), len(self.lora_ids) + 1)

    def close(self) -> None:
        while self.engines:
            self.engines.popitem()[1].close()


_POOL: EnginePool | None = None


def shared_pool() -> EnginePool:
    """This session's pool (``tests/conftest.py`` closes it when the session ends)."""
    global _POOL
    if _POOL is None:
        import tempfile

        _POOL = EnginePool(Path(tempfile.mkdtemp(prefix="preft-test-engines-")))
    return _POOL


def close_shared_pool() -> None:
    if _POOL is not None:
        _POOL.close()

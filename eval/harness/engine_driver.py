"""One vLLM engine (PreFT plugin and scheduler) in its own long-lived process, driven over pipes.

vLLM's CPU engine spawns processes and holds process-wide patches, so the tests and the
benchmarks run each engine configuration in a child process and talk to it with one JSON
command per line::

    with EngineProcess(model_dir, {"enable_lora": True, "max_loras": 4}) as engine:
        tokens = engine.generate([{"prompt": "add 1 2 =", "lora": ["alice", 1, BUNDLE]},
                                  {"prompt": "the quiet", "reft": REFT_BUNDLE}], max_tokens=8)["tokens"]

A request is ``{"prompt": str (or "prompt_token_ids": [ids]), "lora": [name, int id, bundle dir]
| None, "reft": bundle dir | None, "xargs": {extra_args}}``; greedy decoding, exactly ``max_tokens`` tokens: EOS is never picked (``min_tokens``, as
HF's ``min_new_tokens``: the parity tests) or picked and ignored (``ignore_eos``: the throughput
benchmark, which spares the logits processor). ``generate`` answers the
generated token ids of every request and the seconds ``llm.generate`` took (timed in the
engine's process); ``set_scheduler`` switches the prefill chunk policy and admission order;
``reset_prefix_cache`` empties the prefix cache (an engine shared between tests starts each
cold, as a fresh one would); ``load`` replaces the engine by another model's or settings' in the
same process (vLLM imported once); ``metrics`` answers
vLLM's preemption and prefix-cache-hit counters (engine
setting ``disable_log_stats=False``). The child prints vLLM's logs to the log file and our
answers behind :data:`MARKER` on stdout.

    python -m preft.eval.harness.engine_driver SPEC.json    (the child; SPEC = {"model": dir, "engine": {LLM kwargs}})
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MARKER = "PREFT_ENGINE "
#: engine settings unless a spec overrides them: float32 (HF parity), eager (CPU LoRA has no
#: torch.compile); PreFT's scheduler is added to every engine
ENGINE_DEFAULTS = {"dtype": "float32", "max_model_len": 256, "seed": 0, "enforce_eager": True}


class EngineProcess:
    """The parent's handle on one engine process (see the module docstring)."""

    def __init__(self, model: str, engine: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, timeout_s: float = 600, wait: bool = True) -> None:
        """Start the engine's process; with ``wait`` (the default) return once it is ready, else
        at once: the first command (or :meth:`wait_ready`) waits, and several engines start side
        by side (most of a start is one core importing vLLM)."""
        self.workdir = tempfile.TemporaryDirectory(prefix="preft-engine-")
        spec = Path(self.workdir.name) / "spec.json"
        spec.write_text(json.dumps({"model": model, "engine": engine or {}}))
        self.log_path = Path(log_path) if log_path else Path(self.workdir.name) / "engine.log"
        self.log = self.log_path.open("w+")
        environment = dict(os.environ)
        environment.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        environment.update(env or {})
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "preft.eval.harness.engine_driver", str(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=environment)
        self.ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> EngineProcess:
        """Block until the engine has started (its first answer)."""
        if not self.ready:
            self._read()
            self.ready = True
        return self

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                answer = json.loads(line.removeprefix(MARKER))
                if "error" in answer:
                    raise RuntimeError(f"engine process: {answer['error']}\n{self.log_tail()}")
                return answer
        raise RuntimeError(f"engine process ended (rc={self.proc.wait()})\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-chars:]

    def _ask(self, command: dict) -> dict:
        self.wait_ready()  # the ready answer is never taken for a command's
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, requests: list[dict], max_tokens: int, sequential: bool = False,
                 ignore_eos: bool = False, logprobs: bool = False, prompt_logprobs: bool = False) -> dict:
        """``{"tokens": [[ids] per request], "finish_reasons": [...], "seconds": s}`` (a request
        the engine failed: no tokens, finish reason ``"error"``); ``sequential``: one request at a time;
        ``prompt_logprobs``: also ``"prompt_logprobs"``, per request the log p of each prompt token
        (None for the first); a request's ``"xargs"`` go into its ``extra_args``;
        ``logprobs``: also ``"logprobs": [[log p of each generated token] per request]``."""
        return self._ask({"generate": requests, "max_tokens": max_tokens, "sequential": sequential,
                          "ignore_eos": ignore_eos, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs})

    def set_scheduler(self, spec: dict) -> dict:
        """Switch the engine's prefill chunk policy and admission order (a ``PREFT_SCHEDULER``
        spec) from the next request on. Needs the engine core in the engine's process: start the engine with
        ``env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}``."""
        return self._ask({"scheduler": spec})

    def metrics(self) -> dict:
        """``{"preemptions": n, "prefix_hits": tokens}`` (needs ``disable_log_stats=False``)."""
        return self._ask({"metrics": True})

    def reset_prefix_cache(self) -> dict:
        """Empty the prefix cache (nothing may be running): ``{"reset": True}``."""
        return self._ask({"reset_prefix_cache": True})

    def load(self, model: str, engine: dict[str, Any] | None = None) -> dict:
        """Replace this process's engine by a new one of ``model`` and ``engine`` settings (the
        process's environment stays): 3-5 s instead of the 14 s of a new process, most of which
        is importing vLLM. Needs the engine core in the process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
        return self._ask({"load": {"model": model, "engine": engine or {}}})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()
        self.workdir.cleanup()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reply(message: dict) -> None:
    print(MARKER + json.dumps(message), flush=True)


def _start(spec: dict):
    from vllm import LLM

    from preft.serving import SCHEDULER_CLS

    return LLM(model=spec["model"], **{**ENGINE_DEFAULTS, "scheduler_cls": SCHEDULER_CLS, **spec["engine"]})


def _serve(spec: dict) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from preft.constants import REFT_EXTRA_ARG

    llm = _start(spec)
    _reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        if "load" in command:  # the engine of another model or settings, in this process
            import gc

            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
                raise RuntimeError("load needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in process)")
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
            llm = _start(command["load"])
            _reply({"ready": True})
            continue
        if "scheduler" in command:
            core = getattr(llm.llm_engine.engine_core, "engine_core", None)
            if core is None:
                raise RuntimeError("set_scheduler needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in process)")
            core.scheduler.set_policies(command["scheduler"])
            admission = core.scheduler.admission
            _reply({"scheduler": core.scheduler.chunk_policy.name,
                    "admission": admission.order.name if admission is not None else "fcfs"})
            continue
        if command.get("reset_prefix_cache"):
            _reply({"reset": bool(llm.reset_prefix_cache())})
            continue
        if command.get("metrics"):
            metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
            _reply({"preemptions": metrics.get("vllm:num_preemptions", 0),
                    "prefix_hits": metrics.get("vllm:prefix_cache_hits", 0)})
            continue
        n = command["max_tokens"]
        length = {"ignore_eos": True} if command.get("ignore_eos") else {"min_tokens": n}
        prompts, params, loras = [], [], []
        for request in command["generate"]:
            ids = request.get("prompt_token_ids")
            prompts.append({"prompt_token_ids": ids} if ids is not None else request["prompt"])
            extra = {**request.get("xargs", {}), **({REFT_EXTRA_ARG: request["reft"]} if request.get("reft") else {})}
            params.append(SamplingParams(temperature=0.0, max_tokens=n, extra_args=extra or None,
                                         logprobs=0 if command.get("logprobs") else None,
                                         prompt_logprobs=0 if command.get("prompt_logprobs") else None, **length))
            loras.append(LoRARequest(*request["lora"]) if request.get("lora") else None)
        started = time.perf_counter()
        if command.get("sequential"):  # one request at a time, in order (prefix-cache tests)
            outputs = [llm.generate([p], q, lora_request=[r], use_tqdm=False)[0]
                       for p, q, r in zip(prompts, params, loras)]
        else:
            outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        seconds = time.perf_counter() - started
        answer = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds,
                  "finish_reasons": [o.outputs[0].finish_reason for o in outputs]}
        if command.get("prompt_logprobs"):  # log p of each prompt token given the ones before (the first: None)
            answer["prompt_logprobs"] = [[None if step is None else step[token].logprob
                                          for step, token in zip(o.prompt_logprobs, o.prompt_token_ids)]
                                         for o in outputs]
        if command.get("logprobs"):
            answer["logprobs"] = [[step[token].logprob for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                  for o in outputs]
        _reply(answer)


if __name__ == "__main__":
    try:
        _serve(json.loads(Path(sys.argv[1]).read_text()))
    except Exception as err:  # the parent shows it with the log's tail
        _reply({"error": f"{type(err).__name__}: {err}"})
        raise

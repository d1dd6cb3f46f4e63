"""One engine configuration of the throughput benchmark, kept alive in its own process.

    python -m preft.eval.throughput_worker SPEC.json     (driven by preft.eval.bench_throughput)

Builds one vLLM engine, answers ``PREFT_BENCH {"ready": true}``, then reads one JSON command
per line on stdin: ``{"count": N}`` generates the benchmark prompts (request i uses adapter
i % N) and answers ``PREFT_BENCH {"tokens": T, "seconds": S}``; ``{"quit": true}`` exits.
The driver keeps every variant's engine alive and alternates between them, so the variants
are measured side by side on a machine whose speed drifts. vLLM logs to stdout too, hence the
marker on our lines.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
MARKER = "PREFT_BENCH "


def reply(message: dict) -> None:
    print(MARKER + json.dumps(message), flush=True)


if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from preft.serving.reft import EXTRA_ARG

    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=spec["model"], seed=0, enforce_eager=True, **spec["engine"])
    prompts, bundles = spec["prompts"], spec["bundles"]

    def batch(count: int):
        """``(sampling params, lora requests)`` with request i on adapter i % count."""
        plain = dict(temperature=0.0, max_tokens=spec["output_tokens"], ignore_eos=True)
        if not bundles:
            return SamplingParams(**plain), None
        if spec["reft"]:  # ReFT-P: the bundle travels in extra_args; the plugin keys its blocks
            return [SamplingParams(**plain, extra_args={EXTRA_ARG: bundles[i % count]})
                    for i in range(len(prompts))], None
        lora = [LoRARequest(f"a{i % count}", 1 + i % count, bundles[i % count]) for i in range(len(prompts))]
        return SamplingParams(**plain), lora

    reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        params, lora = batch(int(command["count"]))
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        elapsed = time.perf_counter() - started
        reply({"tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "seconds": elapsed})

"""One engine configuration of the throughput benchmark, in its own process.

    python -m preft.eval.throughput_worker SPEC.json     (run by preft.eval.bench_throughput)

Builds one vLLM engine, then for each adapter count generates the same prompts (request i
uses adapter i % count) and prints ``RESULT <json>`` with output tokens/s per count.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=spec["model"], seed=0, enforce_eager=True, **spec["engine"])
    from preft.serving.reft import EXTRA_ARG

    prompts = spec["prompts"]
    results = {}
    for count in spec["adapter_counts"]:
        lora, inputs = None, prompts
        params = SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"], ignore_eos=True)
        if spec["bundles"] and spec.get("reft"):  # ReFT-P: the bundle travels in extra_args
            bundles = [spec["bundles"][i % count] for i in range(len(prompts))]
            params = [SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"], ignore_eos=True,
                                     extra_args={EXTRA_ARG: b}) for b in bundles]
            inputs = prompts  # ReFT-P blocks are keyed by the plugin
        elif spec["bundles"]:
            lora = [LoRARequest(f"a{i % count}", 1 + i % count, spec["bundles"][i % count]) for i in range(len(prompts))]
        best = 0.0
        for _ in range(spec["rounds"]):
            started = time.perf_counter()
            outputs = llm.generate(inputs, params, lora_request=lora, use_tqdm=False)
            elapsed = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            best = max(best, tokens / elapsed)
        results[str(count)] = best
        if not spec["bundles"]:
            results = {str(c): best for c in spec["adapter_counts"]}
            break
    print("RESULT " + json.dumps(results), flush=True)

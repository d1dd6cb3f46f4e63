"""Run greedy requests through a real vLLM engine (PreFT plugin loaded) and print the tokens.

    python tests/helpers/vllm_engine.py SPEC.json

SPEC: {"model": dir, "engine": {LLM kwargs}, "max_tokens": n, "rounds": k, "sequential": bool,
       "requests": [{"prompt": str, "adapter": name|null, "bundle": dir|null, "reft": bool}]}
Prints ``RESULT <json>``: per round, the generated token ids of every request. ``rounds`` > 1
re-sends the same batch to the same engine (the later rounds hit the prefix cache).
vLLM's CPU engine spawns processes, so the engine is built under a __main__ guard.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec = json.loads(open(sys.argv[1]).read())
    engine = dict(dtype="float32", max_model_len=256, seed=0, enforce_eager=True)
    engine.update(spec.get("engine", {}))
    llm = LLM(model=spec["model"], **engine)
    n = spec["max_tokens"]
    ids = {}
    lora_requests, params, prompts = [], [], []
    for request in spec["requests"]:
        reft = request.get("reft")
        extra = {"preft_reft": request["bundle"]} if reft else None
        params.append(SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, extra_args=extra))
        prompts.append(request["prompt"])  # ReFT-P blocks are keyed by the plugin, no salt needed
        if request.get("adapter") and not reft:
            ids.setdefault(request["adapter"], len(ids) + 1)
            lora_requests.append(LoRARequest(request["adapter"], ids[request["adapter"]], request["bundle"]))
        else:
            lora_requests.append(None)
    rounds = []
    for _ in range(spec.get("rounds", 1)):
        if spec.get("sequential"):  # one request at a time, in order (for prefix-cache tests)
            outputs = [llm.generate([p], q, lora_request=[r], use_tqdm=False)[0]
                       for p, q, r in zip(prompts, params, lora_requests)]
        else:
            outputs = llm.generate(prompts, params, lora_request=lora_requests, use_tqdm=False)
        rounds.append([list(o.outputs[0].token_ids) for o in outputs])
    if spec.get("report_preemptions"):  # needs engine {"disable_log_stats": false}
        metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        print("PREEMPTIONS " + json.dumps(metrics.get("vllm:num_preemptions", 0)), flush=True)
        print("PREFIX_HITS " + json.dumps(metrics.get("vllm:prefix_cache_hits", 0)), flush=True)
    print("RESULT " + json.dumps(rounds), flush=True)

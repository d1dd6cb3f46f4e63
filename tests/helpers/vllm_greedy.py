"""Greedy completions from a real vLLM engine, printed as JSON (run in its own process).

    python tests/helpers/vllm_greedy.py MODEL_DIR MAX_TOKENS PROMPT [PROMPT ...]

vLLM's CPU engine spawns worker processes, so the engine is built under a __main__ guard.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    outputs = llm.generate(prompts, params)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))

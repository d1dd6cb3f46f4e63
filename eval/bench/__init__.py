"""The micro-benchmarks behind ``preft bench`` / ``make bench``: SFT step time (``sft_step``), CPU
LoRA ops (``lora_ops``), serving throughput (``throughput``) and the soak (``soak``), each
publishing its JSON and its section of docs/RESULTS.md through :mod:`preft.eval.results`."""

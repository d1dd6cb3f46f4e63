"""Measurements: the micro-benchmarks behind ``preft bench`` / ``make bench`` (SFT step time,
CPU LoRA ops, serving throughput), each writing its JSON and its section of docs/RESULTS.md
through :mod:`preft.eval.report`. ``preft eval`` (loss by rank, goodput) is not built yet.
"""

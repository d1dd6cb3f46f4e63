"""Measurements: ``preft eval`` (one module per command: ``loss``, ``serve``, ``rl``, ``profile``,
``goodput``, ``prefix``, ``pipeline``, ``gpu``, ``soak``, ``report``), lm-eval's
``preft-completions`` model (``lm_eval_preft``) and vLLM's benchmark client (``vllm_bench``);
``preft bench``'s micro-benchmarks in :mod:`preft.eval.bench`; the helpers the commands share in
:mod:`preft.eval.common`; the one writer of results and docs/RESULTS.md sections in
:mod:`preft.eval.results`; harness code shared with the tests in :mod:`preft.eval.harness`.
"""

"""Harness code that the tests and the benchmarks share, not part of what PreFT serves: a vLLM
engine in a long-lived child process (``engine_driver``) and a real ``preft serve`` on loopback
(``server_process``)."""

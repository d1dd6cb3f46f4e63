"""Serving metrics from per-request times: the simulator's and ``vllm bench serve``'s alike.

- TTFT = first token time - arrival; TPOT = (finish - first token) / (output tokens - 1)
  (vLLM's benchmark definitions; a one-token answer has no TPOT and meets any TPOT target).
- Goodput (DistServe's definition, as ``vllm bench serve --goodput``): requests per second that
  meet both the TTFT and the TPOT target, over the run's duration (first arrival to last finish).
- SLO attainment: the fraction of requests meeting both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    """One finished request (seconds)."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def meets(timing: RequestTiming, ttft_s: float, tpot_s: float) -> bool:
    return timing.ttft_s <= ttft_s and (timing.tpot_s is None or timing.tpot_s <= tpot_s)


def summarize(timings: list[RequestTiming], ttft_s: float, tpot_s: float, duration_s: float | None = None) -> dict:
    """Aggregate metrics (times in ms in the answer, as vLLM's benchmark prints them)."""
    if not timings:
        raise ValueError("no finished requests to summarize")
    if duration_s is None:
        duration_s = max(t.finish_s for t in timings) - min(t.arrival_s for t in timings)
    good = sum(meets(t, ttft_s, tpot_s) for t in timings)
    ttfts = [t.ttft_s * 1e3 for t in timings]
    tpots = [t.tpot_s * 1e3 for t in timings if t.tpot_s is not None]
    summary = {"requests": len(timings), "duration_s": duration_s,
               "request_throughput": len(timings) / duration_s,
               "output_throughput": sum(t.output_tokens for t in timings) / duration_s,
               "goodput": good / duration_s, "slo_attainment": good / len(timings),
               "slo": {"ttft_ms": ttft_s * 1e3, "tpot_ms": tpot_s * 1e3}}
    for name, values in (("ttft_ms", ttfts), ("tpot_ms", tpots)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}"] = percentile(values, q)
    return summary

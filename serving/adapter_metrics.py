"""Per-adapter figures on the server's ``/metrics``, in Prometheus form, beside vLLM's own.

vLLM's metrics say how the server does; an operator of many users' adapters also asks how each
adapter does. In the API-server process, under ``preft serve``, this module keeps per adapter
(the name a request gave in ``model``: a LoRA, a ReFT-P adapter, or the base model's name):

- ``preft_adapter_requests_total``, ``preft_adapter_prompt_tokens_total``,
  ``preft_adapter_generation_tokens_total``: finished requests and their tokens;
- ``preft_adapter_time_to_first_token_seconds`` and ``preft_adapter_time_per_output_token_seconds``:
  histograms, one observation per finished request (TTFT from arrival; TPOT the mean gap between
  its output tokens after the first, as vLLM's own ``vllm:request_time_per_output_token_seconds``);
- ``preft_adapter_request_errors_total``: answers with an HTTP status of 400 or more to a request
  naming a served adapter (a name the server does not serve counts under ``_unknown``).

Label cardinality is bounded: the ``--metrics-top-adapters`` adapters with the most finished
requests (``K``, default 20) get their own ``adapter`` label; all others are summed under
``adapter="_other"``, and at most :data:`MAX_TRACKED` names are remembered (later ones count
only in ``_other``). Which adapters are in the top ``K`` is decided at each scrape, so an adapter
entering or leaving it moves its counts between its series and ``_other`` (Prometheus' ``rate``
reads a fall as a counter reset).

And for the adapter caches (:mod:`preft.serving.adapter_cache_stats`), by ``cache`` and ``kind``:
``preft_adapter_cache_loads_total``, ``preft_adapter_cache_evictions_total`` and the histogram
``preft_adapter_cache_load_seconds``, where ``cache`` is ``store`` (a bundle copied into the
server's store and checked while serving: a runtime load, or a first use with
``--resolve-adapters``; counted in this process), ``host`` (the host caches of LoRA and ReFT-P) or ``slot``
(the adapter slots), the last two counted in the engine process.

Read by ``prometheus_client``'s default registry, which vLLM's ``/metrics`` serves (a server with
several API-server processes uses Prometheus' multiprocess mode instead, and runtime adapter
loading refuses that setup).
"""

from __future__ import annotations

import bisect
import os
import threading
from http import HTTPStatus

from preft.serving import adapter_cache_stats

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
OTHER, UNKNOWN = "_other", "_unknown"
#: adapters remembered by name; beyond this, new names count only under ``_other``
MAX_TRACKED = 10_000
DEFAULT_TOP_K = 20


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add(self, other: "_Histogram") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum += other.sum

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last (Prometheus' form)."""
        out, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += count
            out.append((bound, running))
        return out


class _AdapterFigures:
    def __init__(self) -> None:
        self.requests = self.prompt_tokens = self.generation_tokens = self.errors = 0
        self.ttft, self.tpot = _Histogram(TTFT_BUCKETS_S), _Histogram(TPOT_BUCKETS_S)

    def add(self, other: "_AdapterFigures") -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.generation_tokens += other.generation_tokens
        self.errors += other.errors
        self.ttft.add(other.ttft)
        self.tpot.add(other.tpot)


class AdapterMetrics:
    """The per-adapter table and its Prometheus collector (``collect``)."""

    def __init__(self, top_k: int = DEFAULT_TOP_K, max_tracked: int = MAX_TRACKED) -> None:
        self.top_k, self.max_tracked = top_k, max_tracked
        self._lock = threading.Lock()
        self._figures: dict[str, _AdapterFigures] = {}
        self._untracked = _AdapterFigures()  # names past max_tracked

    def _of(self, adapter: str) -> _AdapterFigures:
        figures = self._figures.get(adapter)
        if figures is None:
            if len(self._figures) >= self.max_tracked:
                return self._untracked
            figures = self._figures[adapter] = _AdapterFigures()
        return figures

    def finished(self, adapter: str, prompt_tokens: int, generation_tokens: int,
                 ttft_s: float | None, tpot_s: float | None) -> None:
        with self._lock:
            figures = self._of(adapter)
            figures.requests += 1
            figures.prompt_tokens += prompt_tokens
            figures.generation_tokens += generation_tokens
            if ttft_s is not None:
                figures.ttft.observe(ttft_s)
            if tpot_s is not None:
                figures.tpot.observe(tpot_s)

    def error(self, adapter: str) -> None:
        with self._lock:
            self._of(adapter).errors += 1

    def shown(self) -> dict[str, _AdapterFigures]:
        """Label -> figures: the top K adapters by finished requests (then by errors, then by
        name), the rest summed under ``_other``."""
        with self._lock:
            ranked = sorted(self._figures.items(), key=lambda item: (-item[1].requests, -item[1].errors, item[0]))
            shown = {name: figures for name, figures in ranked[: self.top_k]}
            other = _AdapterFigures()
            other.add(self._untracked)
            for _, figures in ranked[self.top_k:]:
                other.add(figures)
            if other.requests or other.errors:
                shown[OTHER] = other
            return shown

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        shown = self.shown()
        per_adapter = [
            ("preft_adapter_requests", "Finished requests, per adapter", "requests"),
            ("preft_adapter_prompt_tokens", "Prompt tokens of finished requests, per adapter", "prompt_tokens"),
            ("preft_adapter_generation_tokens", "Generated tokens of finished requests, per adapter",
             "generation_tokens"),
            ("preft_adapter_request_errors", "Requests answered with an HTTP error, per adapter", "errors"),
        ]
        for name, help_text, field in per_adapter:
            family = CounterMetricFamily(name, help_text, labels=["adapter"])
            for adapter, figures in shown.items():
                family.add_metric([adapter], getattr(figures, field))
            yield family
        for name, help_text, field in (
                ("preft_adapter_time_to_first_token_seconds", "Time to first token of finished requests, per adapter",
                 "ttft"),
                ("preft_adapter_time_per_output_token_seconds",
                 "Mean time per output token (after the first) of finished requests, per adapter", "tpot")):
            family = HistogramMetricFamily(name, help_text, labels=["adapter"])
            for adapter, figures in shown.items():
                histogram = getattr(figures, field)
                family.add_metric([adapter], histogram.buckets(), histogram.sum)
            yield family
        yield from cache_families()


def cache_families():
    """The adapter caches' loads, evictions and load times: this process's (the store) and the
    engine processes' files (host cache, slots)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    # this process's counts (the store's; the engine's too when it runs in this process) from memory
    counts = adapter_cache_stats.add_counts(adapter_cache_stats.read_all(skip_pid=os.getpid()),
                                            adapter_cache_stats.snapshot())
    loads = CounterMetricFamily("preft_adapter_cache_loads", "Adapters brought into a cache", labels=["cache", "kind"])
    evictions = CounterMetricFamily("preft_adapter_cache_evictions", "Adapters evicted from a cache",
                                    labels=["cache", "kind"])
    seconds = HistogramMetricFamily("preft_adapter_cache_load_seconds", "Time to bring an adapter into a cache",
                                    labels=["cache", "kind"])
    for key, entry in sorted(counts.items()):
        labels = key.split("/", 1)
        loads.add_metric(labels, entry["loads"])
        evictions.add_metric(labels, entry["evictions"])
        histogram = _Histogram(adapter_cache_stats.LOAD_BUCKETS_S)
        histogram.counts, histogram.sum = list(entry["load_seconds_buckets"]), entry["load_seconds_sum"]
        seconds.add_metric(labels, histogram.buckets(), histogram.sum)
    yield from (loads, evictions, seconds)


#: this API server's table (:func:`install` registers it)
METRICS: AdapterMetrics | None = None


def request_figures(req_state) -> tuple[float | None, float | None]:
    """``(TTFT, TPOT)`` in seconds of a finished request from vLLM's per-request stats (None
    where vLLM kept no stats, or for TPOT with fewer than two output tokens)."""
    stats = getattr(req_state, "stats", None)
    if stats is None or not stats.first_token_ts:
        return None, None
    ttft = stats.first_token_latency or None
    tokens = stats.num_generation_tokens
    tpot = (stats.last_token_ts - stats.first_token_ts) / (tokens - 1) if tokens > 1 else None
    return ttft, tpot


def error_status(status: int) -> bool:
    return status >= HTTPStatus.BAD_REQUEST


def install(top_k: int, label_of_request) -> AdapterMetrics:
    """Register the collector and feed it from vLLM's output processor. ``label_of_request(engine
    request)`` names the adapter of a request as the client named it (ReFT-P requests reach the
    engine as base-model requests with the bundle in their extra arguments)."""
    global METRICS
    from prometheus_client import REGISTRY
    from vllm.v1.engine.output_processor import OutputProcessor

    from preft.serving.patching import wrap

    METRICS = AdapterMetrics(top_k=top_k)
    REGISTRY.register(METRICS)

    @wrap(OutputProcessor, "add_request")
    def add_request(original, self, request, *args, **kwargs):
        original(self, request, *args, **kwargs)
        state = self.request_states.get(request.request_id)
        if state is not None:
            state.preft_adapter = label_of_request(request)

    @wrap(OutputProcessor, "_update_stats_from_finished")
    def finished(original, self, req_state, *args, **kwargs):
        ttft, tpot = request_figures(req_state)
        generated = req_state.stats.num_generation_tokens if req_state.stats is not None else 0
        METRICS.finished(getattr(req_state, "preft_adapter", None) or UNKNOWN, req_state.prompt_len or 0,
                         generated, ttft, tpot)
        return original(self, req_state, *args, **kwargs)

    return METRICS

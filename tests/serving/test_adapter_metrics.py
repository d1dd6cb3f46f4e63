"""The per-adapter metrics table, the engine's cache counts and the store's guard against a
bundle rewritten while it is copied (no server: the live-server side is in
``test_adapter_resolver.py``)."""

from __future__ import annotations

import shutil

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from preft.bundle import BundleError
from preft.serving import adapter_cache_stats
from preft.serving.adapter_metrics import OTHER, AdapterMetrics, cache_families


def parsed(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_top_k_adapters_get_a_label_and_the_rest_are_summed_exactly():
    table = AdapterMetrics(top_k=2, max_tracked=4)
    traffic = {"a": 5, "b": 3, "c": 2, "d": 1, "e": 1, "f": 4}  # e and f come after max_tracked names
    for name, count in traffic.items():
        for _ in range(count):
            table.finished(name, prompt_tokens=10, generation_tokens=3, ttft_s=0.3, tpot_s=0.02)
    table.error("c")
    samples = parsed(table)
    shown = {labels[0][1]: value for (name, labels), value in samples.items()
             if name == "preft_adapter_requests_total"}
    assert shown == {"a": 5, "b": 3, OTHER: 2 + 1 + 1 + 4}  # f has more than b but was never tracked
    assert sum(shown.values()) == sum(traffic.values())
    assert samples[("preft_adapter_prompt_tokens_total", (("adapter", OTHER),))] == 10 * 8
    assert samples[("preft_adapter_request_errors_total", (("adapter", OTHER),))] == 1
    assert samples[("preft_adapter_time_to_first_token_seconds_bucket", (("adapter", "a"), ("le", "0.25")))] == 0
    assert samples[("preft_adapter_time_to_first_token_seconds_bucket", (("adapter", "a"), ("le", "0.5")))] == 5
    assert samples[("preft_adapter_time_per_output_token_seconds_count", (("adapter", OTHER),))] == 8
    assert samples[("preft_adapter_time_per_output_token_seconds_sum", (("adapter", "b"),))] == pytest.approx(0.06)


def test_engine_cache_counts_reach_the_api_servers_scrape(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFT_SERVE_STORE", str(tmp_path))
    monkeypatch.setattr(adapter_cache_stats, "_counts", {})
    adapter_cache_stats.record_load("slot", "lora", 0.003)
    adapter_cache_stats.record_load("slot", "lora", 0.2)
    adapter_cache_stats.record_evictions("slot", "lora", 1)
    adapter_cache_stats.flush()
    # another engine process's file is summed in; this process's own file is read from memory
    other = tmp_path / adapter_cache_stats.STATS_DIR / "engine-1.json"
    shutil.copyfile(next((tmp_path / adapter_cache_stats.STATS_DIR).glob("engine-*.json")), other)

    class Caches:
        def collect(self):
            return cache_families()

    samples = parsed(Caches())
    labels = (("cache", "slot"), ("kind", "lora"))
    assert samples[("preft_adapter_cache_loads_total", labels)] == 4
    assert samples[("preft_adapter_cache_evictions_total", labels)] == 2
    assert samples[("preft_adapter_cache_load_seconds_bucket", (*labels, ("le", "0.005")))] == 2
    assert samples[("preft_adapter_cache_load_seconds_sum", labels)] == pytest.approx(2 * 0.203)


def test_a_bundle_rewritten_while_it_is_copied_is_refused(tmp_path, base_path, monkeypatch, saved_adapter):
    from conftest import ADAPTER_CONFIGS
    from preft.export import export_adapter
    from preft.serving import bundle_store

    bundle = tmp_path / "bundle"
    export_adapter(saved_adapter(ADAPTER_CONFIGS["lora_p"]()), base_path, bundle)
    store = bundle_store.BundleStore(tmp_path / "store", base_path, max_rank=8)
    copy = shutil.copyfile

    def copy_while_exporting(source, target):  # the user re-exports into the bundle mid-copy
        copy(source, target)
        if str(source).endswith("adapter_config.json"):
            (bundle / "adapter_model.safetensors").write_bytes((bundle / "adapter_model.safetensors").read_bytes())

    monkeypatch.setattr(bundle_store.shutil, "copyfile", copy_while_exporting)
    with pytest.raises(BundleError, match="changed while it was being read"):
        store.add("alice", bundle)
    assert not [p for p in (tmp_path / "store").iterdir()]  # nothing half-read is kept
    monkeypatch.setattr(bundle_store.shutil, "copyfile", copy)
    copied, manifest = store.add("alice", bundle)
    assert manifest["kind"] == "lora" and copied.parent == tmp_path / "store"

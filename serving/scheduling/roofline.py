"""Roofline step cost model of a named GPU and model: what a step costs where no GPU is at hand.

    T(step) = overhead + max(compute, memory) + communication

for one engine step of ``n`` decodes (one token each) and ``c`` prefill tokens on ``tp`` GPUs
(tensor parallel), every term per GPU:

- **compute** = FLOPs / (peak FLOP/s · flops_efficiency), FLOPs =
  ``2 · (n + c) · P_linear``  (every token through every linear layer)
  ``+ 2 · s · V · d``  (the logits of the ``s`` sampled tokens: the decodes and one per prefill)
  ``+ 4 · L · h · d_h · (x_d + c · x_p + c² / 2)``  (attention: decodes read ``x_d`` context
  tokens, the chunk attends to its ``x_p`` cached tokens and causally to itself)
  ``+ 2 · a_t · r · M_a``  (the adapters' rank-``r`` projections on the ``a_t`` tokens they touch);
- **memory** = bytes / (bandwidth · bandwidth_efficiency), bytes =
  ``W``  (the weights, read once a step)
  ``+ B_kv · (x_d + x_p − x_shared)``  (the KV read; a prefix shared by several decodes of one
  step is read once: ``x_shared`` is the duplicated reads, the locality Feather's paper measures)
  ``+ B_kv · (n + c)``  (the new tokens' KV written)
  ``+ k · W_a``  (each of the step's ``k`` distinct adapters' weights);
- **overhead** = ``step_overhead_s`` (the engine's per-step CPU work, launches, sampling)
  ``+ [k > 0] · 2 · L · targets · launch_s`` (the segmented LoRA kernels, one shrink and one
  expand per targeted module and layer, whatever ``k``);
- **communication** (``tp > 1``) = ``2 · L`` all-reduces of ``(n + c) · d`` activations, each
  ``2 · (tp − 1) / tp · bytes / link bandwidth + link latency`` (ring all-reduce).

With ``d`` hidden size, ``L`` layers, ``h`` / ``h_kv`` query / KV heads of size ``d_h``, ``m``
the MLP's intermediate size, ``V`` the vocabulary, ``b`` bytes per value:
``P_linear = L · (d · d_h · (2 h + 2 h_kv) + 3 d m)``, ``W = b · (P_linear + V · d)``,
``B_kv = 2 · L · h_kv · d_h · b`` per token. A LoRA adapter (``adapter="lora"``) has
``M_a = L · Σ (in + out)`` over its targeted modules and ``W_a = b · r · M_a``; a LoReFT
intervention (``adapter="reft"``, ``h + Rᵀ(W h + b − R h)`` after every layer: three rank-``r``
products of size ``d``) has ``M_a = 3 · L · d`` and ``W_a = b · r · 2 · L · d`` (``R`` and ``W``).
The adapter's launches are counted as LoRA's for both. Everything but the overhead and the link is divided
by ``tp`` (weights and heads split across GPUs).

:meth:`RooflineCostModel.__call__` takes the simulator's ``(n, c, x)``: ``x`` is the decodes'
context when there are decodes, else the chunk's (the shape the fitted
:class:`~.cost_model.StepCostModel` sees); :meth:`RooflineCostModel.step` takes every term.
It is monotone in ``c`` (SLOWeave's binary search needs that). :meth:`as_step_cost_model` fits
the 8-term model on a grid of roofline steps, for the policies that read its weights (WavePP)
and for seeding an online model.

Presets: :data:`MODELS` from the models' published ``config.json``; :data:`HARDWARE` from the
vendors' data sheets (dense bf16, no sparsity), with efficiencies from one H200 measured for
this project (790 TFLOP/s on a bf16 8192³ matmul of the 989 peak, 4.3 TB/s device-to-device
copy of the 4.8 peak); :meth:`Hardware.calibrated` replaces them by measured figures.

>>> model = RooflineCostModel(MODELS["llama-3.1-8b"], HARDWARE["H100"])
>>> round(1e3 * model(1, 0, 0), 1)  # decode at batch 1: the 16 GB of weights over the bandwidth
5.5
>>> model(0, 512, 0) < model(0, 1024, 0) < model(0, 2048, 0)
True
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

__all__ = ["HARDWARE", "MODELS", "PUBLISHED_STEPS", "Hardware", "ModelShape", "PublishedStep", "RooflineCostModel",
           "check_published"]


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder (a transformers config's fields)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    bytes_per_value: int = 2  # bfloat16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    @property
    def dh(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear module of a layer."""
        d, q, kv, m = self.hidden, self.heads * self.dh, self.kv_heads * self.dh, self.intermediate
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                "gate_proj": (d, m), "up_proj": (d, m), "down_proj": (m, d)}

    @property
    def linear_params(self) -> int:
        """``P_linear``: the decoder layers' linear weights."""
        return self.layers * sum(i * o for i, o in self.module_dims().values())

    @property
    def weight_bytes(self) -> int:
        """``W``: the weights a step reads (the decoder layers and the LM head)."""
        return self.bytes_per_value * (self.linear_params + self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        """``B_kv``: one token's K and V over every layer."""
        return 2 * self.layers * self.kv_heads * self.dh * self.bytes_per_value

    def lora_dims(self) -> int:
        """``M_lora``: Σ (in + out) over the adapter's targeted modules and layers."""
        dims = self.module_dims()
        return self.layers * sum(sum(dims[t]) for t in self.lora_targets)

    @classmethod
    def from_config(cls, config: dict | str | Path, name: str | None = None) -> ModelShape:
        """From a transformers ``config.json`` (a dict, the file, or its directory)."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            try:
                config = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"cannot read the model config {path}: {err}") from None
            name = name or path.parent.name
        config = config.get("text_config", config)
        try:
            return cls(name=name or config.get("model_type", "model"), layers=int(config["num_hidden_layers"]),
                       hidden=int(config["hidden_size"]), heads=int(config["num_attention_heads"]),
                       kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                       intermediate=int(config["intermediate_size"]), vocab=int(config["vocab_size"]),
                       head_dim=int(config["head_dim"]) if config.get("head_dim") else None)
        except KeyError as err:
            raise ValueError(f"the model config has no {err} field (a decoder's transformers config.json)") from None


#: published configs (huggingface.co/<name>/blob/main/config.json)
MODELS = {
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256),
    "llama-3.1-70b": ModelShape("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256),
    "qwen2.5-0.5b": ModelShape("Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936),
    "qwen3-8b": ModelShape("Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, head_dim=128),
}


@dataclass(frozen=True)
class Hardware:
    """One GPU: peak dense bf16 FLOP/s, memory bandwidth, the fractions of them a real kernel
    reaches, the engine's per-step overhead, a kernel launch, and the GPU-to-GPU link (one
    direction) for tensor parallelism."""

    name: str
    peak_flops: float
    bandwidth: float  # bytes/s
    flops_efficiency: float = 790 / 989  # one H200, bf16 8192^3 matmul, of its data-sheet peak
    bandwidth_efficiency: float = 4.3 / 4.8  # one H200, device-to-device copy, of its data-sheet peak
    step_overhead_s: float = 0.5e-3  # scheduling, sampling, launches of a CUDA-graph step (an assumption)
    launch_s: float = 4e-6
    link_bandwidth: float = 450e9  # NVLink 4, per direction
    link_latency_s: float = 8e-6
    source: str = ""

    def calibrated(self, flops: float, bandwidth: float, step_overhead_s: float | None = None) -> Hardware:
        """This GPU with measured figures in place of the data sheet's (efficiency 1: measured)."""
        return replace(self, peak_flops=flops, bandwidth=bandwidth, flops_efficiency=1.0, bandwidth_efficiency=1.0,
                       step_overhead_s=self.step_overhead_s if step_overhead_s is None else step_overhead_s,
                       source=f"measured ({self.name})")


#: data sheets: nvidia.com A100 (SXM 80 GB), H100 (SXM), H200 (SXM) product pages; dense, no sparsity
HARDWARE = {
    "A100": Hardware("A100", 312e12, 2.039e12, link_bandwidth=300e9, source="NVIDIA A100 data sheet (SXM4 80GB)"),
    "A100-40GB": Hardware("A100-40GB", 312e12, 1.555e12, link_bandwidth=300e9,
                          source="NVIDIA A100 data sheet (SXM4 40GB)"),
    "L4": Hardware("L4", 121e12, 300e9, link_bandwidth=32e9, source="NVIDIA L4 data sheet (dense bf16)"),
    "H100": Hardware("H100", 989e12, 3.35e12, source="NVIDIA H100 data sheet (SXM5)"),
    "H200": Hardware("H200", 989e12, 4.8e12, source="NVIDIA H200 data sheet (SXM)"),
    "H200-measured": Hardware("H200-measured", 790e12, 4.3e12, flops_efficiency=1.0, bandwidth_efficiency=1.0,
                              source="one H200: bf16 8192^3 matmul, device-to-device copy"),
}


@dataclass
class RooflineCostModel:
    """``T(step)`` of ``model`` on ``hardware`` at tensor-parallel size ``tp`` (module docstring)."""

    model: ModelShape
    hardware: Hardware
    tp: int = 1
    lora_rank: int = 16
    adapter: str = "lora"  # or "reft" (LoReFT after every layer)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.adapter not in ("lora", "reft"):
            raise ValueError(f"adapter must be 'lora' or 'reft', got {self.adapter!r}")
        if self.tp < 1 or self.model.heads % self.tp or self.model.kv_heads % self.tp and self.tp % self.model.kv_heads:
            raise ValueError(f"tensor-parallel size {self.tp} does not split {self.model.name}'s "
                             f"{self.model.heads} heads / {self.model.kv_heads} KV heads")

    @property
    def source(self) -> str:
        return f"roofline: {self.model.name} on {self.hardware.name}" + (f" x{self.tp} (TP)" if self.tp > 1 else "")

    def terms(self, n: int, c: int, decode_context: int = 0, prefill_context: int = 0, shared_context: int = 0,
              adapters: int = 0, adapter_tokens: int = 0) -> dict[str, float]:
        """Each term of the step in seconds (module docstring): compute, memory, overhead, communication."""
        m, hw, tp = self.model, self.hardware, self.tp
        tokens = n + c
        sampled = n + (1 if c else 0)
        flops = 2 * tokens * m.linear_params + 2 * sampled * m.vocab * m.hidden
        flops += 4 * m.layers * m.heads * m.dh * (decode_context + c * prefill_context + c * c / 2)
        flop_dims, weight_params = self.adapter_shape()
        flops += 2 * adapter_tokens * self.lora_rank * flop_dims
        read_kv = max(0, decode_context + prefill_context - shared_context)
        memory = m.weight_bytes + m.kv_bytes_per_token * (read_kv + tokens)
        memory += adapters * m.bytes_per_value * weight_params
        overhead = hw.step_overhead_s + (2 * m.layers * len(m.lora_targets) * hw.launch_s if adapters else 0.0)
        communication = 0.0
        if tp > 1 and tokens:
            per_reduce = 2 * (tp - 1) / tp * tokens * m.hidden * m.bytes_per_value / hw.link_bandwidth
            communication = 2 * m.layers * (per_reduce + hw.link_latency_s)
        return {"compute": flops / tp / (hw.peak_flops * hw.flops_efficiency),
                "memory": memory / tp / (hw.bandwidth * hw.bandwidth_efficiency),
                "overhead": overhead, "communication": communication}

    def adapter_shape(self) -> tuple[int, int]:
        """``(M_a, parameters)`` of one adapter: the dimensions its rank-``r`` products span, and its weights."""
        m = self.model
        if self.adapter == "lora":
            return m.lora_dims(), self.lora_rank * m.lora_dims()
        return 3 * m.layers * m.hidden, 2 * self.lora_rank * m.layers * m.hidden

    def step(self, n: int, c: int, decode_context: int = 0, prefill_context: int = 0, shared_context: int = 0,
             adapters: int = 0, adapter_tokens: int = 0) -> float:
        """``T(step)`` in seconds with every term given."""
        t = self.terms(n, c, decode_context, prefill_context, shared_context, adapters, adapter_tokens)
        return t["overhead"] + max(t["compute"], t["memory"]) + t["communication"]

    def largest_prefill_chunk(self, context: int, limit: int, budget_s: float) -> int:
        """The largest ``c <= limit`` whose prefill-only step after ``context`` cached tokens takes
        at most ``budget_s`` (0 if none): each side of the ``max`` is a quadratic in ``c``
        (compute: ``2 L h d_h c² + (2 P_linear + 4 L h d_h x) c + 2 V d`` FLOPs; memory:
        ``W + B_kv (x + c)`` bytes; the all-reduces linear in ``c``), so ``c`` is the smaller
        root, checked against :meth:`step` to one token. WavePP sizes its chunks with it
        (:class:`~.wavepp.StageCost`) instead of a search."""
        m, hw, tp = self.model, self.hardware, self.tp
        if limit < 1 or self.step(0, 1, prefill_context=context) > budget_s:
            return 0
        flops_per_s = tp * hw.peak_flops * hw.flops_efficiency
        bytes_per_s = tp * hw.bandwidth * hw.bandwidth_efficiency
        link = 0.0 if tp == 1 else 2 * m.layers * 2 * (tp - 1) / tp * m.hidden * m.bytes_per_value / hw.link_bandwidth
        left = budget_s - hw.step_overhead_s - (2 * m.layers * hw.link_latency_s if tp > 1 else 0.0)
        attention = 4 * m.layers * m.heads * m.dh
        sides = ((attention / 2 / flops_per_s, (2 * m.linear_params + attention * context) / flops_per_s + link,
                  2 * m.vocab * m.hidden / flops_per_s - left),
                 (0.0, m.kv_bytes_per_token / bytes_per_s + link,
                  (m.weight_bytes + m.kv_bytes_per_token * context) / bytes_per_s - left))
        roots = [(-b + math.sqrt(max(0.0, b * b - 4 * a * k))) / (2 * a) if a else -k / b for a, b, k in sides]
        chunk = max(1, min(limit, int(min(roots))))
        while chunk < limit and self.step(0, chunk + 1, prefill_context=context) <= budget_s:
            chunk += 1
        while chunk > 1 and self.step(0, chunk, prefill_context=context) > budget_s:
            chunk -= 1
        return chunk

    def step_with_prefill_context(self, num_decodes: int, prefill_tokens: int, context_tokens: int,
                                  prefill_context: int) -> float:
        """``T`` of a step whose ``context_tokens`` include ``prefill_context`` cached for its
        chunk (SLOWeave's view): the chunk attends to those, the decodes to the rest."""
        return self.step(num_decodes, prefill_tokens, decode_context=max(0, context_tokens - prefill_context),
                         prefill_context=prefill_context)

    def __call__(self, num_decodes: int, prefill_tokens: int, context_tokens: int = 0) -> float:
        if num_decodes:
            return self.step(num_decodes, prefill_tokens, decode_context=context_tokens)
        return self.step(0, prefill_tokens, prefill_context=context_tokens)

    def as_step_cost_model(self, decodes: tuple[int, ...] = (0, 1, 4, 16, 64, 256), max_chunk: int = 8192,
                           max_context: int = 65536):
        """The 8-term :class:`~.cost_model.StepCostModel` fitted on a grid of roofline steps
        (``decodes`` decodes per step). The linear form cannot follow the roofline's ``max`` across
        the ridge (20-45% off on mixed steps); on prefill-only steps (``decodes=(0,)``, what WavePP
        sizes chunks with) it follows it closely."""
        from preft.serving.scheduling.cost_model import StepCostModel

        shapes = [(n, c, x) for n in decodes for c in (0, 16, 128, 512, 2048, max_chunk)
                  for x in (0, 1024, 8192, max_context) if n or c]
        return StepCostModel.fit(shapes, [self(*s) for s in shapes], source=self.source,
                                 meta={"gap_s": 0.0, "roofline": self.to_json()})

    def to_json(self) -> dict:
        return {"model": asdict(self.model), "hardware": asdict(self.hardware), "tp": self.tp,
                "lora_rank": self.lora_rank, "adapter": self.adapter}


@dataclass(frozen=True)
class PublishedStep:
    """A step time someone measured and published: ``decodes`` requests decoding, each after
    about ``context`` tokens, on vLLM with the model in bf16; ``measured_ms`` is the time per
    output token (one decode step when nothing else is running)."""

    model: str
    hardware: str
    decodes: int
    context: int
    measured_ms: float
    source: str


#: vLLM ``bench serve`` sweeps at fixed concurrency, closed loop, ``--ignore-eos``; the median
#: time per output token (a decode step: at these concurrencies most steps hold no prefill)
PUBLISHED_STEPS = (
    PublishedStep("llama-3.1-8b", "A100-40GB", 1, 1088, 1e3 / 75, "johnmusgrave.com/p/vllm-throughput-latency-sweep-on "
                  "(vLLM 0.23, 1024 in / 128 out, concurrency 1: about 75 tok/s)"),
    PublishedStep("llama-3.1-8b", "H100", 1, 512, 6.48, "yobitelcomm.github.io/bench/recipes/concurrency-sweep "
                  "(vLLM 0.21, fp16, H100-80GB-HBM3, chatbot-short, concurrency 1: TPOT p50 6.48 ms; "
                  "the context is not given, 512 assumed: at batch 1 it moves the step by 0.02 ms)"),
    PublishedStep("qwen2.5-0.5b", "L4", 1, 320, 5.1, "ai.wmx.dev/benchmarks (vLLM 0.23, 256 in / 128 out, "
                  "concurrency 1: ITL p50 5.1 ms)"),
    PublishedStep("qwen2.5-0.5b", "L4", 32, 320, 7.1, "ai.wmx.dev/benchmarks (vLLM 0.23, 256 in / 128 out, "
                  "concurrency 32: ITL p50 7.1 ms)"),
)


def check_published(steps=PUBLISHED_STEPS) -> list[dict]:
    """The roofline's prediction for each published step, and its error ``predicted / measured − 1``."""
    rows = []
    for step in steps:
        model = RooflineCostModel(MODELS[step.model], HARDWARE[step.hardware])
        predicted = 1e3 * model.step(step.decodes, 0, decode_context=step.decodes * step.context)
        rows.append({**asdict(step), "predicted_ms": predicted, "error": predicted / step.measured_ms - 1})
    return rows

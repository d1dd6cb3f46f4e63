"""Seeded serving workloads: arrival times, prompt and output lengths (and adapters, shared prefixes).

One workload drives both the simulator (:mod:`.simulator`) and the real engine: :func:`write_trace`
writes it as the JSON-lines trace that ``vllm bench serve --dataset-name timed_trace`` replays
at the same arrival times (``timestamp`` seconds, ``input_length``, ``output_length``,
``hash_ids``: one id per 16-token block of the prompt, so requests that share ids share a prefix).

Kinds (lengths scaled to the model's context ``max_model_len``; prompt + output always fits):

- ``chat``: short prompts (2-12% of the context), outputs of 16-96 tokens; Poisson arrivals.
- ``long``: long prompts (40-80% of the context), short outputs; Poisson arrivals.
- ``mixed``: 70% chat, 30% long; Poisson arrivals.
- ``bursty``: the mixed lengths, arrivals on/off: Poisson at 3x the rate during "on" periods
  (a third of the time), nothing in between, so the mean rate is the same.

Shared prefixes: :func:`prefix_workload` (prefix groups, per-user adapters after one system
prompt) and :func:`conversation_workload` (multi-turn chats, each turn sent when the previous
one is answered).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from preft.serving.scheduling.atomic_file import write_atomically

KINDS = ("chat", "mixed", "long", "bursty")
TRACE_BLOCK_TOKENS = 16  # vllm bench serve's timed_trace default --timed-trace-chunk-hash-size


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    adapter: str | None = None
    prefix_group: int | None = None  # requests of one group share their first prefix_tokens tokens
    prefix_tokens: int = 0
    # a conversation's turns: every turn's prompt is the conversation so far (the previous turn's
    # prompt, its answer, a follow-up), so one conversation's tokens are one stream. A turn with
    # ``after`` arrives ``think_s`` after that turn finishes (its ``arrival_s`` is then ignored).
    conversation: str | None = None
    turn: int = 1
    after: str | None = None
    think_s: float = 0.0


def _lengths(kind: str, rng: random.Random, max_model_len: int) -> tuple[int, int]:
    def chat():
        return rng.randint(max(2, max_model_len * 2 // 100), max(3, max_model_len * 12 // 100)), rng.randint(16, 96)

    def long():
        return rng.randint(max_model_len * 40 // 100, max_model_len * 80 // 100), rng.randint(8, 32)

    if kind == "chat":
        prompt, output = chat()
    elif kind == "long":
        prompt, output = long()
    else:
        prompt, output = chat() if rng.random() < 0.7 else long()
    output = max(1, min(output, max_model_len - prompt - 1))
    return prompt, output


def _arrivals(kind: str, rng: random.Random, count: int, rate: float) -> list[float]:
    times, now = [], 0.0
    if kind != "bursty":
        for _ in range(count):
            now += rng.expovariate(rate)
            times.append(now)
        return times
    period = 30.0 / rate  # about 30 requests per on/off cycle
    on = period / 3
    while len(times) < count:
        now += rng.expovariate(3 * rate)
        if now % period >= on:  # an "off" stretch: skip to the next "on"
            now += period - now % period
        times.append(now)
    return times


def generate(kind: str, count: int, rate: float, seed: int = 0, max_model_len: int = 512) -> list[RequestSpec]:
    """``count`` requests of ``kind`` at a mean ``rate`` requests/s."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload {kind!r} (choose from {', '.join(KINDS)})")
    if count < 1 or rate <= 0 or max_model_len < 64:
        raise ValueError(f"a workload needs count >= 1, rate > 0 and max_model_len >= 64 "
                         f"(got {count}, {rate}, {max_model_len})")
    rng = random.Random(f"{kind}-{seed}")
    arrivals = _arrivals(kind, rng, count, rate)
    requests = []
    for index, arrival in enumerate(arrivals):
        prompt, output = _lengths(kind, rng, max_model_len)
        requests.append(RequestSpec(f"{kind}-{seed}-{index}", round(arrival, 6), prompt, output))
    return requests


def write_trace(requests: list[RequestSpec], path: str | Path) -> Path:
    """The workload as a ``timed_trace`` JSON-lines file (atomically, :func:`.atomic_file.write_atomically`)."""
    return write_atomically(path, trace_text(requests))


def trace_text(requests: list[RequestSpec]) -> str:
    """What :func:`write_trace` writes: one JSON line a request."""
    next_id = 1 << 20  # unshared blocks get ids no prefix group uses
    lines = []
    for request in requests:
        blocks = -(-request.prompt_tokens // TRACE_BLOCK_TOKENS)
        shared = request.prefix_tokens // TRACE_BLOCK_TOKENS if request.prefix_group is not None else 0
        hash_ids = [request.prefix_group * 4096 + i for i in range(shared)]
        hash_ids += list(range(next_id, next_id + blocks - shared))
        next_id += blocks - shared
        lines.append(json.dumps({"timestamp": request.arrival_s, "input_length": request.prompt_tokens,
                                 "output_length": request.output_tokens, "hash_ids": hash_ids,
                                 "request": asdict(request)}) + "\n")
    return "".join(lines)


def read_trace(path: str | Path) -> list[RequestSpec]:
    """A trace written by :func:`write_trace` (or any timed trace with those three fields)."""
    requests = []
    for index, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        entry = json.loads(line)
        if "request" in entry:
            requests.append(RequestSpec(**entry["request"]))
            continue
        try:
            requests.append(RequestSpec(str(index), float(entry["timestamp"]), int(entry["input_length"]),
                                        int(entry["output_length"])))
        except KeyError as err:
            raise ValueError(f"{path}: line {index + 1} has no {err} field") from None
    return requests


PREFIX_VARIANTS = ("shared", "per-user", "no-sharing")


def prefix_workload(variant: str, count: int, rate: float, groups: int = 10, seed: int = 0,
                    max_model_len: int = 512, adapters: int = 8) -> list[RequestSpec]:
    """Shared-prefix workloads (Poisson arrivals at ``rate``), lengths scaled to the context:

    - ``shared``: ``groups`` prefix groups (1-100), each a prefix of 40-70% of the context, then a
      unique suffix of 8-32 tokens; outputs of 1-200 tokens (what fits);
    - ``per-user``: one shared system prompt (60% of the context) and ``adapters`` users, each
      request on adapter ``user{i}``; the users' prefill-only adapters start at the system
      prompt's end (``adapter_start``), so its KV is the base model's;
    - ``no-sharing``: the ``shared`` lengths, every prompt unique (the control).
    """
    if variant not in PREFIX_VARIANTS:
        raise ValueError(f"unknown prefix workload {variant!r} (choose from {', '.join(PREFIX_VARIANTS)})")
    if count < 1 or rate <= 0 or not 1 <= groups <= 100 or adapters < 1:
        raise ValueError("a prefix workload needs count >= 1, rate > 0, 1 <= groups <= 100, adapters >= 1")
    rng = random.Random(f"prefix-{variant}-{seed}")
    arrivals = _arrivals("poisson", rng, count, rate)
    if variant == "per-user":
        lengths = [max_model_len * 60 // 100]
    else:
        lengths = [rng.randint(max_model_len * 40 // 100, max_model_len * 70 // 100) for _ in range(groups)]
    requests = []
    for index, arrival in enumerate(arrivals):
        group = rng.randrange(len(lengths))
        prefix = lengths[group]
        prompt = prefix + rng.randint(8, 32)
        output = max(1, min(rng.randint(1, 200), max_model_len - prompt - 1))
        adapter = f"user{index % adapters}" if variant == "per-user" else None
        shared = variant != "no-sharing"
        requests.append(RequestSpec(f"{variant}-{seed}-{index}", round(arrival, 6), prompt, output, adapter=adapter,
                                    prefix_group=group if shared else None, prefix_tokens=prefix if shared else 0))
    return requests


def conversation_workload(count: int, rate: float, seed: int = 0, max_model_len: int = 512, users: int = 8,
                          turns: tuple[int, int] = (2, 4), think_s: float = 0.5) -> list[RequestSpec]:
    """``count`` conversations of ``turns`` turns (at most what fits the context), the first turns
    arriving Poisson at ``rate``; conversation ``i`` is user ``i % users``'s, on adapter
    ``user{i % users}``. Turn 1: a prompt of 10-25% of the context; each answer 5-15%; each
    follow-up 3-8%. Turn ``k + 1``'s prompt is turn ``k``'s prompt + its answer + the follow-up
    (``prompt_tokens`` grows by ``output_tokens + follow-up``), sent ``think_s`` (exponential,
    that mean) after turn ``k`` finishes."""
    if count < 1 or rate <= 0 or users < 1 or not 1 <= turns[0] <= turns[1] or think_s < 0:
        raise ValueError("a conversation workload needs count >= 1, rate > 0, users >= 1, "
                         "1 <= min turns <= max turns, think_s >= 0")
    rng = random.Random(f"conversations-{seed}")

    def share(low: int, high: int) -> int:
        return rng.randint(max(1, max_model_len * low // 100), max(1, max_model_len * high // 100))

    requests = []
    for index, arrival in enumerate(_arrivals("poisson", rng, count, rate)):
        conversation, previous = f"conv-{seed}-{index}", None
        prompt, wanted = share(10, 25), rng.randint(*turns)
        for turn in range(1, wanted + 1):
            output = share(5, 15)
            if prompt + output >= max_model_len:  # the conversation no longer fits the context: it ends
                break
            request_id = f"{conversation}-t{turn}"
            requests.append(RequestSpec(request_id, round(arrival, 6), prompt, output, adapter=f"user{index % users}",
                                        conversation=conversation, turn=turn, after=previous,
                                        think_s=round(rng.expovariate(1 / think_s), 6) if previous and think_s else 0.0))
            previous, prompt = request_id, prompt + output + share(3, 8)
    return requests


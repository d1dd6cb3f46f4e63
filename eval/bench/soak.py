"""Soak: a live ``preft serve`` under minutes of mixed load, runtime loads/unloads and bad requests.

    preft bench soak [--minutes 3] [--concurrency 16]

The server runs the embedded model in float32 behind ``--api-key``, with runtime loading under
an adapter root, four LoRA-P and one ReFT-P adapter given at start-up and a pool of three more
(two LoRA-P, one ReFT-P) that the load loads and unloads at random. ``concurrency`` clients
send, until the time is up, a random mix of:

- completions (78%) for the base model or an adapter, each compared with HF's greedy tokens
  for that adapter and prompt (a difference is a *mismatch*);
- runtime loads and unloads of the pool (8%), and completions for pool adapters (answer or
  404, by the adapter's state at that moment, held under a per-name lock);
- bad requests (14%), each with its expected status: an unknown model (404), ``max_tokens=0``,
  a reserved ``vllm_xargs`` key (on completions and on ``/v1/messages``), a ``vllm_xargs``
  that is not an object, a prompt that fills the whole context, a load from outside the adapter
  root, a corrupt bundle, a name that exists (400), and a request without the key (401).

Anything else is an *unexpected failure*, recorded with its cause (the answer's status and
text, or the client's exception) and printed; the server's log is kept (``log_path``).
Reported: requests by kind, unexpected failures, mismatches, completion latency p50/p99, and
the server's memory (RSS of its process tree) at the start of the load and at the end, with a
plot of both over time.

The clients keep an idle connection for at most :data:`CLIENT_KEEPALIVE_S`, under the server's
5 s (uvicorn's ``timeout_keep_alive``, vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``). httpx's default
is also 5 s, so a request sent on a connection idle for just under 5 s can meet the server
closing it and fail with a read error although the server did nothing wrong. That is one
candidate for the single unexpected failure of an earlier 10-minute soak (a corrupt-bundle load
answered by a read error, its cause unrecorded); 72 requests sent after 4.97-5.03 s of idling did
not reproduce it, so the margin removes a possible cause, and the recorded cause of any later
failure says what it was.
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import preft
from preft.constants import REFT_EXTRA_ARG
from preft.eval.results import REPO, default_of, write_result
from preft.export import export_adapter
from preft.eval.harness.server_process import start_server, stop_server

API_KEY = "soak-key"
NEW_TOKENS = 8
PROMPTS = ["add 12 35 =", "reverse 3 1 4 1 5 =", "the quiet", "a=7 b=2 c=9 ; c =", "sort 8 2 1 9 =",
           "copy 4 4 2 ="]
START_UP = {"lora0": "lora", "lora1": "lora", "lora2": "lora", "lora3": "lora", "reft0": "reft"}
POOL = {"pool_lora0": "lora", "pool_lora1": "lora", "pool_reft0": "reft"}
MAX_MODEL_LEN = 256
CLIENT_KEEPALIVE_S = 2.0  # under the server's 5 s keep-alive (see the module docstring)


def _config(kind: str, index: int):
    if kind == "reft":
        return preft.PreftReftConfig(rank=4, layers=[0, 2, 3], init_weights=False, adapter_start=index % 2)
    return preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
                                 init_lora_weights=False, adapter_start=index % 3)


def build(root: Path) -> dict:
    """Bundles under ``root`` (the adapter root), broken copies, and HF references per adapter."""
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)

    def base():
        return AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL, dtype=torch.float32).eval()

    def greedy(model) -> dict[str, str]:
        batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        return dict(zip(PROMPTS, texts))

    reference = {"base": greedy(base())}
    for index, (name, kind) in enumerate({**START_UP, **POOL}.items()):
        torch.manual_seed(500 + index)
        model = get_peft_model(base(), _config(kind, index))
        if kind == "reft":
            with torch.no_grad():  # random ReFT inits are mild: make the edit show in the tokens
                for param_name, param in model.named_parameters():
                    if "reft_source" in param_name:
                        param.mul_(4.0)
        model.save_pretrained(root / "adapters" / name)
        export_adapter(root / "adapters" / name, preft.DEFAULT_BASE_MODEL, root / name)
        reference[name] = greedy(PeftModel.from_pretrained(base(), root / "adapters" / name).eval())
    shutil.copytree(root / "lora0", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"garbage")
    return reference


def process_tree_rss(pid: int) -> float:
    """MB resident in the server and its children (the engine core and workers)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)]) / 2**20
    except psutil.Error:
        return float("nan")


async def drive(url: str, root: Path, reference: dict, seconds: float, concurrency: int, seed: int,
                pid: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
                                http_client=httpx.AsyncClient(limits=limits, timeout=120))
    admin = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                              limits=limits)
    loaded = {name: False for name in POOL}
    locks = {name: asyncio.Lock() for name in POOL}
    records, memory = [], []
    deadline = time.time() + seconds

    async def complete(model: str, prompt, expect, kind: str = "completion", body: dict | None = None,
                       what: str | None = None) -> None:
        """One completion; ``expect`` is "answer" (200 and HF's text) or the expected status."""
        started = time.time()
        try:
            response = await client.completions.create(
                model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
                extra_body={"min_tokens": NEW_TOKENS, **(body or {})})
            status, text, detail = 200, response.choices[0].text, None
        except openai.APIStatusError as err:
            status, text, detail = err.status_code, None, str(err.message)[:300]
        except openai.APIError as err:
            status, text, detail = type(err).__name__, None, f"{type(err).__name__}: {err!r}"[:300]
        if expect == "answer":
            ok, mismatch = status == 200, status == 200 and text != reference[model][prompt]
        else:
            ok, mismatch = status == expect, False
        records.append({"kind": kind, "ok": ok and not mismatch, "mismatch": mismatch, "status": status,
                        "seconds": time.time() - started, "at": started, "model": model, "what": what or kind,
                        "detail": detail if not ok else None})

    async def post(path: str, body, expect: int, kind: str, headers=None, what: str | None = None) -> int:
        started = time.time()
        try:
            response = await admin.post(path, json=body, headers=headers)
            status, detail = response.status_code, response.text[:300]
        except httpx.HTTPError as err:
            cause = err.__cause__ or err.__context__
            status = type(err).__name__
            detail = f"{type(err).__name__}: {err!r}" + (f" (from {type(cause).__name__}: {cause!r})" if cause else "")
        records.append({"kind": kind, "ok": status == expect, "mismatch": False, "status": status,
                        "seconds": time.time() - started, "at": started, "what": what or f"{kind} {path}",
                        "model": body.get("lora_name") or body.get("model") if isinstance(body, dict) else None,
                        "detail": detail[:300] if status != expect else None})
        return status

    async def bad_request() -> None:
        choice = rng.randrange(10)
        reserved = {"vllm_xargs": {REFT_EXTRA_ARG: str(root / "reft0")}}  # only the server picks bundles
        if choice == 0:
            await complete("nobody", "add 1 2 =", 404, "bad request", what="unknown model")
        elif choice == 1:
            await complete("lora1", "add 1 2 =", 400, "bad request", {"max_tokens": 0}, what="max_tokens=0")
        elif choice == 2:
            await complete("base", "add 1 2 =", 400, "bad request", reserved, what="reserved key")
        elif choice == 3:
            await post("/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": "/etc"}, 400, "bad request",
                       what="load outside the root")
        elif choice == 4:
            await post("/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(root / "corrupt")}, 400,
                       "bad request", what="corrupt load")
        elif choice == 5:
            await post("/v1/load_lora_adapter", {"lora_name": "lora2", "lora_path": str(root / "pool_lora0")}, 400,
                       "bad request", what="name taken")
        elif choice == 6:
            await post("/v1/messages", {"model": "base", "max_tokens": 2, "messages": [
                {"role": "user", "content": "add 1 2 ="}], **reserved}, 400, "bad request",
                what="reserved key on /v1/messages")
        elif choice == 7:
            await complete("reft0", "add 1 2 =", 400, "bad request", {"vllm_xargs": ["preft_reft", "/etc"]},
                           what="vllm_xargs not an object")
        elif choice == 8:
            await complete(rng.choice(["base", "lora0"]), [5] * MAX_MODEL_LEN, 400, "bad request",
                           {"max_tokens": 1, "min_tokens": 0}, what="prompt fills the context")
        else:
            await post("/v1/unload_lora_adapter", {"lora_name": "lora0"}, 401, "bad request",
                       headers={"Authorization": "Bearer wrong"}, what="no key")

    async def worker() -> None:
        while time.time() < deadline:
            roll = rng.random()
            if roll < 0.78:
                model = rng.choice(["base", *START_UP])
                await complete(model, rng.choice(PROMPTS), "answer")
            elif roll < 0.86:
                name = rng.choice(list(POOL))
                async with locks[name]:
                    if rng.random() < 0.5:
                        await complete(name, rng.choice(PROMPTS), "answer" if loaded[name] else 404, "pool completion")
                    elif loaded[name]:
                        loaded[name] = await post("/v1/unload_lora_adapter", {"lora_name": name}, 200,
                                                  "unload") != 200
                    else:
                        loaded[name] = await post("/v1/load_lora_adapter",
                                                  {"lora_name": name, "lora_path": str(root / name)}, 200,
                                                  "load") == 200
            else:
                await bad_request()

    async def sample_memory() -> None:
        """Memory every 2 s, and a progress line every 30 s."""
        last_line = time.time()
        while time.time() < deadline:
            memory.append((time.time(), process_tree_rss(pid)))
            if time.time() - last_line >= 30:
                last_line = time.time()
                bad = sum(not r["ok"] for r in records)
                print(f"soak: {last_line - started:.0f}/{seconds:.0f} s, {len(records)} requests, {bad} not as "
                      f"expected, server RSS {memory[-1][1]:.0f} MB", flush=True)
            await asyncio.sleep(2.0)
        memory.append((time.time(), process_tree_rss(pid)))

    started = time.time()
    await asyncio.gather(sample_memory(), *(worker() for _ in range(concurrency)))
    await client.close()
    await admin.aclose()
    return {"records": records, "memory": memory, "started": started}


def summarize(run: dict) -> dict:
    records, memory = run["records"], run["memory"]
    latencies = sorted(r["seconds"] for r in records if r["kind"] == "completion" and r["ok"])
    kinds = sorted({r["kind"] for r in records})

    def percentile(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    unexpected = [r for r in records if not r["ok"] and not r["mismatch"]]
    return {
        "requests": len(records),
        "by_kind": {kind: sum(r["kind"] == kind for r in records) for kind in kinds},
        "unexpected_failures": len(unexpected),
        "unexpected": [{"at_s": round(r["at"] - run["started"], 1), **{k: r.get(k) for k in
                                                                        ("what", "model", "status", "detail")}}
                       for r in unexpected],
        "mismatches": sum(r["mismatch"] for r in records),
        "completion_latency_s": {"p50": percentile(0.50), "p99": percentile(0.99),
                                 "mean": statistics.mean(latencies) if latencies else float("nan")},
        "rss_mb": {"start": memory[0][1], "end": memory[-1][1], "growth": memory[-1][1] - memory[0][1]},
    }


def plot(run: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    started = run["started"]
    for kind, color in (("completion", "tab:blue"), ("pool completion", "tab:green"), ("load", "tab:orange"),
                        ("unload", "tab:purple"), ("bad request", "tab:red")):
        points = [(r["at"] - started, r["seconds"]) for r in run["records"] if r["kind"] == kind]
        if points:
            left.scatter(*zip(*points), s=4, alpha=0.5, color=color, label=kind)
    left.set_xlabel("time (s)")
    left.set_ylabel("latency (s)")
    left.legend(fontsize=7, markerscale=3)
    right.plot([t - started for t, _ in run["memory"]], [m for _, m in run["memory"]], marker=".")
    right.set_xlabel("time (s)")
    right.set_ylabel("server RSS, process tree (MB)")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(minutes: float = 3.0, concurrency: int = 16, seed: int = 0, publish: bool = True) -> dict:
    """The soak; with ``publish``, its section of docs/RESULTS.md and docs/results/soak.png."""
    result, run = measure(minutes, concurrency, seed)
    if publish:
        report(result, run)
    return result


def measure(minutes: float, concurrency: int, seed: int, log_path: Path | None = None) -> tuple[dict, dict]:
    """``(summary, the run's samples)`` of one soak; the server's log is kept at ``log_path``
    (default ``runs/soak/server.log``)."""
    log_path = Path(log_path or REPO / "runs" / "soak" / "server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "adapter_root"
        root.mkdir()
        reference = build(root)
        args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-rank", "8", "--max-adapters", "4",
                "--allow-runtime-loading", "--adapter-root", str(root), "--state-dir", str(Path(tmp) / "store")]
        for name in START_UP:
            args += ["--adapter", f"{name}={root / name}"]
        proc, url, ready_s = start_server([*args, "--", "--api-key", API_KEY], log_path)
        try:
            run = asyncio.run(drive(url, root, reference, minutes * 60, concurrency, seed, proc.pid))
        finally:
            stop_server(proc)
    summary = summarize(run)
    command = "preft bench soak" + "".join(
        f" --{key} {value}" for key, value in (("minutes", minutes), ("concurrency", concurrency))
        if value != default_of(main, key))
    result = {"command": command, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "minutes": minutes,
              "concurrency": concurrency, "server_ready_s": ready_s, "server_log": str(log_path), **summary}
    for failure in summary["unexpected"]:
        print(f"soak: unexpected at {failure['at_s']} s: {failure['what']} ({failure['model']}) -> "
              f"{failure['status']}: {failure['detail']}")
    return result, run


def report(result: dict, run: dict) -> str:
    plot_path = REPO / "docs" / "results" / "soak.png"
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(run, plot_path, f"{result['command']}: {result['requests']} requests")
    markdown = soak_markdown(result, "results/soak.png")
    write_result("soak", {**result}, markdown)
    print(markdown)
    return markdown


def soak_markdown(result: dict, picture: str) -> str:
    """The soak's section: its command, the plot at ``picture``, one row of figures."""
    latency, rss = result["completion_latency_s"], result["rss_mb"]
    kinds = ", ".join(f"{count} {kind}" for kind, count in result["by_kind"].items())
    markdown = "\n".join([
        "## Soak: a live server under mixed load, runtime loads/unloads and bad requests",
        "",
        f"Command: `{result['command']}` ({result['machine']}; the embedded model in float32 behind `--api-key`, "
        f"{result['concurrency']} concurrent clients for {result['minutes']} minutes; see `eval/bench/soak.py`).",
        "",
        f"![soak]({picture})",
        "",
        "| requests | unexpected failures | mismatches vs HF | completion p50 / p99 | server RSS start → end |",
        "|---|---|---|---|---|",
        f"| {result['requests']} ({kinds}) | {result['unexpected_failures']} | {result['mismatches']} "
        f"| {latency['p50'] * 1e3:.0f} / {latency['p99'] * 1e3:.0f} ms "
        f"| {rss['start']:.0f} → {rss['end']:.0f} MB ({rss['growth']:+.0f} MB) |",
    ])
    return markdown


def add_arguments(parser) -> None:
    parser.add_argument("--minutes", type=float, default=default_of(main, "minutes"),
                        help="how long the load runs (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=default_of(main, "concurrency"),
                        help="concurrent clients (default %(default)s)")
    parser.set_defaults(bench=lambda args: main(minutes=args.minutes, concurrency=args.concurrency))

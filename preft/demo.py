"""`make demo`: the tour — train, export, serve, ask, measure — on the embedded default model.

1. **Train** (the SFT recipe, :mod:`preft.recipes.sft`, as ``preft train`` runs it, on the
   user's own JSONL file: ``data.task: local``) three adapters, each on one user's private rule
   for a list command the base model already knows (:func:`private_rule_examples`): alice wants
   ``sort`` descending (LoRA-P), bob wants ``reverse`` to keep the order (LoRA-P), carol wants
   ``copy`` to reverse (LoReFT-P).
2. **Export** each to a serving bundle (:func:`preft.export.export_adapter`).
3. **Serve** them with ``preft serve`` (vLLM, adapters on prompt tokens only) and ask through the
   ``openai`` client: each user's held-out prompts, answered by that user's adapter and by the
   base model, next to what the user's rule says; exact match counted from the answers.
4. **Measure** with a short ``preft eval serve``: ``vllm bench serve`` against PreFT, the same
   adapters served all-token, and the base model; the table and the plot paths are printed.

Everything printed comes from this run. Output in ``--output-dir`` (default ``runs/demo``).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import preft
from preft.recipe_config import load_config

console = Console(width=120)
CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
#: user -> (recipe config, their private rule: command -> what they want instead of the usual answer)
ADAPTERS = {
    "alice": ("sft_lora_p.yaml", "sort", lambda items: sorted(items, reverse=True)),   # descending
    "bob": ("sft_lora_p.yaml", "reverse", lambda items: items),                        # keep the order
    "carol": ("sft_reft_p.yaml", "copy", lambda items: items[::-1]),                   # reversed
}
PROMPTS_PER_USER = 16


def private_rule_examples(name: str, count: int, seed: int) -> list[dict[str, str]]:
    """``count`` prompt/completion rows of user ``name``'s rule (``seed`` 0: training, 1: asked)."""
    _, command, rule = ADAPTERS[name]
    rng = random.Random(f"demo-{name}-{seed}")
    rows = []
    for _ in range(count):
        items = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
        rows.append({"prompt": f"{command} {' '.join(map(str, items))} =",
                     "completion": " " + " ".join(map(str, rule(items)))})
    return rows


def train_adapter(name: str, config_file: str, steps: int, output_dir: Path) -> dict:
    from preft.recipes import sft

    data = output_dir / "data" / f"{name}.jsonl"  # the user's own file, as `preft eval loss --data` takes
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(row) + "\n" for row in private_rule_examples(name, 2000, seed=0)))
    config = load_config(CONFIGS / config_file)
    # inside the demo's own directory: a rerun trains anew over what the last one wrote
    config.update(output_dir=str(output_dir / "train" / name), resume_from_checkpoint=None, overwrite_output_dir=True)
    config["data"] = {"task": "local", "path": str(data), "eval_examples": 64}
    config["trainer"].update(max_steps=steps, report_to="none", eval_strategy="no", save_strategy="no",
                             logging_steps=max(1, steps // 10))
    return sft.main(config)


def ask(url: str, model: str, prompts: list[str]) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    answers = []
    for prompt in prompts:
        response = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0,
                                             stop=["\n"])
        answers.append(response.choices[0].text)
    return answers


def main(steps: int = 300, output_dir: str = "runs/demo", eval_adapters: int = 64, eval_slots: int = 8) -> dict:
    from preft.eval import serve as eval_serve
    from preft.export import export_adapter
    from preft.eval.harness.server_process import start_server, stop_server

    started = time.time()
    out = Path(output_dir)
    from preft.output_dirs import claim

    claim(out, "demo", resume=True, overwrite=False, how_to_overwrite=None)  # new, empty, or an earlier demo's

    def stage(text: str) -> None:
        console.rule(f"[bold]{text}[/bold] ({time.time() - started:.0f} s)")

    bundles, losses = {}, {}
    for index, (name, (config_file, command, _)) in enumerate(ADAPTERS.items(), 1):
        kind = "LoReFT-P" if "reft" in config_file else "LoRA-P"
        example = private_rule_examples(name, 1, seed=0)[0]
        stage(f"1/4 train {index}/{len(ADAPTERS)}: {name}'s {kind} adapter ({command}: "
              f"{example['prompt']}{example['completion']}), {steps} steps")
        summary = train_adapter(name, config_file, steps, out)
        losses[name] = (summary["initial_eval_loss"], summary["final_eval_loss"])
        stage(f"2/4 export {name}")
        bundles[name] = out / "bundles" / name
        # the demo's own output from an earlier run: replaced (export replaces only a PreFT bundle)
        export_adapter(summary["adapter_dir"], preft.DEFAULT_BASE_MODEL, bundles[name], overwrite=True)
        console.print(f"  {bundles[name]}")

    stage("3/4 serve the three adapters with preft serve, ask through the openai client")
    args = [arg for name, bundle in bundles.items() for arg in ("--adapter", f"{name}={bundle}")]
    proc, url, ready_s = start_server([*args, "--max-model-len", "256"], out / "server.log")
    matches = {}
    try:
        console.print(f"  preft serve ready at {url} in {ready_s:.0f} s (log: {out / 'server.log'})")
        table = Table(title=f"new prompts, answered by each user's adapter and by the base model (exact match "
                            f"over {PROMPTS_PER_USER} prompts each)")
        for column in ("user", "prompt", "their adapter", "base model", "they want"):
            table.add_column(column)
        for name in ADAPTERS:
            asked = private_rule_examples(name, PROMPTS_PER_USER, seed=1)
            prompts = [ex["prompt"] for ex in asked]
            adapter_answers, base_answers = ask(url, name, prompts), ask(url, "base", prompts)
            matches[name] = sum(a.strip() == ex["completion"].strip() for a, ex in zip(adapter_answers, asked))
            base_matches = sum(a.strip() == ex["completion"].strip() for a, ex in zip(base_answers, asked))
            for ex, mine, base in list(zip(asked, adapter_answers, base_answers))[:2]:
                table.add_row(name, ex["prompt"], mine.strip(), base.strip(), ex["completion"].strip())
            table.add_row("", "[dim]exact match[/dim]", f"[bold]{matches[name]}/{len(prompts)}[/bold]",
                          f"{base_matches}/{len(prompts)}", "", end_section=True)
        console.print(table)
    finally:
        stop_server(proc)

    # the regime users serve in: more adapters than the engine has slots for (each slot holds GPU
    # memory); a prefill-only request gives its slot back when its prompt is done
    stage(f"4/4 measure: preft eval serve, {eval_adapters} adapters on {eval_slots} slots, PreFT vs all-token vs base")
    result = eval_serve.main(adapters=eval_adapters, rank=16, variants="preft,all-token,base", num_prompts=128,
                             input_len=32, output_len=64, rounds=3, slots=eval_slots, out=str(out / "eval"))
    summary = Table(title="what this run measured")
    for column in ("adapter", "held-out loss before → after", "exact match (served)"):
        summary.add_column(column)
    for name in ADAPTERS:
        before, after = losses[name]
        summary.add_row(name, f"{before:.3f} → {after:.3f}", f"{matches[name]}/{PROMPTS_PER_USER}")
    console.print(summary)
    ratios = {row["variant"]: row["vs_base"] for row in result["rows"] if row["variant"] != "base"}
    console.print(f"  serving {eval_adapters} adapters on {eval_slots} slots: PreFT {ratios['preft']:.2f}x the base "
                  f"model's output tokens/s on the same server, all-token {ratios['all-token']:.2f}x (medians of "
                  f"3 rounds)")
    console.print(f"  tables and plot: {out / 'eval' / 'serve' / 'serve.md'}, {out / 'eval' / 'serve' / 'serve.png'}")
    console.print(f"done in {time.time() - started:.0f} s")
    return {"losses": losses, "matches": matches, "serve": result}


if __name__ == "__main__":
    main()

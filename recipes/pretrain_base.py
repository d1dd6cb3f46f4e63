"""Recipe: build the embedded default base model from nothing.

    preft train recipes/configs/pretrain_base.yaml [key=value ...]

1. Generate a synthetic corpus (``preft.data``): arithmetic, list ops, key/value recall and
   templated English.
2. Train a byte-level BPE tokenizer on it (``tokenizers``) and wrap it as a HF fast tokenizer.
3. Pretrain a small Llama (``transformers.LlamaForCausalLM``) on packed blocks with AdamW and a
   cosine schedule, on the CPU.
4. Save model + tokenizer with ``save_pretrained`` (float32 safetensors) and a
   ``training_summary.json`` with the steps, losses and wall time.

The result loads in HF ``transformers`` and in vLLM like any local Llama directory. Copy this
file to change the architecture or the data; it is meant to be read top to bottom.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from preft.data import pretraining_corpus
from preft.recipe_config import RecipeConfigError, check_section
from preft.output_dirs import check_claim, mark
from preft.recipes.common import check_keys

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# A minimal chat template so /v1/chat/completions works on the default model.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(lines: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over ``lines``; BOS is prepended to every encoded text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",  # decoder-only generation pads on the left
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def pack_blocks(tokenizer: PreTrainedTokenizerFast, lines: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate ``BOS line EOS`` streams and cut them into ``[n_blocks, seq_len]``."""
    ids: list[int] = []
    for encoded in tokenizer(lines, add_special_tokens=True)["input_ids"]:
        ids.extend(encoded + [tokenizer.eos_token_id])
    n_blocks = len(ids) // seq_len
    return torch.tensor(ids[: n_blocks * seq_len]).view(n_blocks, seq_len)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.item() for b in blocks.split(batch_size)]
    model.train()
    return sum(losses) / len(losses)


def check_config(config: dict[str, Any]) -> None:
    """Every section's keys and value types, before anything is written."""
    check_keys(config, {"recipe", "output_dir", "seed", "data", "tokenizer", "model", "train"}, {"overwrite_output_dir"})
    if not isinstance(config.get("overwrite_output_dir", False), bool):
        raise RecipeConfigError(f"overwrite_output_dir must be true or false, got {config['overwrite_output_dir']!r}")
    check_section(config["data"], {"corpus_lines": int, "eval_lines": int, "seq_len": int}, "data")
    check_section(config["tokenizer"], {"vocab_size": int}, "tokenizer")
    check_section(config["train"], {"batch_size": int, "max_steps": int, "lr": float, "warmup_steps": (int, 0),
                                    "weight_decay": (float, 0), "eval_every": int, "threads": int}, "train")
    if not isinstance(config["model"], dict):
        raise RecipeConfigError(f"model must be a mapping of LlamaConfig fields, got {config['model']!r}")
    if isinstance(config["seed"], bool) or not isinstance(config["seed"], int):
        raise RecipeConfigError(f"seed must be an integer, got {config['seed']!r}")


def main(config: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    check_config(config)
    data_cfg, train_cfg = config["data"], config["train"]
    torch.manual_seed(config["seed"])
    random.seed(config["seed"])
    torch.set_num_threads(train_cfg["threads"])
    output_dir = Path(config["output_dir"])
    run_id = check_claim(output_dir, "train:pretrain_base", resume=False,
                         overwrite=config.get("overwrite_output_dir", False),
                         how_to_overwrite="overwrite_output_dir=true")  # refused before hours of training

    # 1. data
    train_lines = pretraining_corpus(data_cfg["corpus_lines"], seed=config["seed"])
    eval_lines = pretraining_corpus(data_cfg["eval_lines"], seed=config["seed"] + 1)

    # 2. tokenizer
    tokenizer = train_tokenizer(train_lines, config["tokenizer"]["vocab_size"])
    train_blocks = pack_blocks(tokenizer, train_lines, data_cfg["seq_len"])
    eval_blocks = pack_blocks(tokenizer, eval_lines, data_cfg["seq_len"])

    # 3. model
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config["model"],
    )
    model = LlamaForCausalLM(model_config)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=train_cfg["lr"], weight_decay=train_cfg["weight_decay"]
    )
    max_steps, warmup = train_cfg["max_steps"], train_cfg["warmup_steps"]

    def lr_factor(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, max_steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    # 4. train
    history = []
    generator = torch.Generator().manual_seed(config["seed"])
    bar = tqdm(range(max_steps), desc="pretrain", dynamic_ncols=True)
    for step in bar:
        index = torch.randint(len(train_blocks), (train_cfg["batch_size"],), generator=generator)
        batch = train_blocks[index]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % train_cfg["eval_every"] == 0 or step + 1 == max_steps:
            eval_loss = evaluate(model, eval_blocks, train_cfg["batch_size"])
            history.append({"step": step + 1, "train_loss": loss.item(), "eval_loss": eval_loss})
            bar.write(f"step {step + 1}: train loss {loss.item():.3f}, eval loss {eval_loss:.3f}")

    # 5. save
    mark(output_dir, "train:pretrain_base", run_id)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    summary = {
        "recipe": "pretrain_base",
        "parameters": n_params,
        "train_tokens": max_steps * train_cfg["batch_size"] * data_cfg["seq_len"],
        "steps": max_steps,
        "final_train_loss": history[-1]["train_loss"],
        "final_eval_loss": history[-1]["eval_loss"],
        "history": history,
        "wall_time_s": round(time.time() - started, 1),
        "config": config,
    }
    (output_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    import sys

    from preft.recipe_config import load_config

    main(load_config(sys.argv[1], sys.argv[2:]))

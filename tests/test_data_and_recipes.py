"""Synthetic data, recipe configs, the CLI, and the pretraining recipe on a tiny budget."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from preft import data
from preft.cli import main as cli_main
from preft.recipe_config import RecipeConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
PRETRAIN_CONFIG = REPO / "recipes" / "configs" / "pretrain_base.yaml"


def test_generators_are_deterministic_and_correct():
    assert data.task_examples("arithmetic", 5, seed=3) == data.task_examples("arithmetic", 5, seed=3)
    assert data.task_examples("arithmetic", 5, seed=3) != data.task_examples("arithmetic", 5, seed=4)
    for ex in data.task_examples("arithmetic", 200):
        op, a, b, _ = ex["prompt"].split()
        assert int(ex["completion"]) == {"add": int(a) + int(b), "sub": int(a) - int(b), "mul": int(a) * int(b)}[op]
    for ex in data.task_examples("lists", 200):
        op, *items = ex["prompt"].removesuffix(" =").split()
        expected = {"copy": items, "reverse": items[::-1], "sort": sorted(items)}[op]
        assert ex["completion"].split() == expected
    for ex in data.task_examples("recall", 200):
        table, query = ex["prompt"].removesuffix(" =").split(" ; ")
        assert dict(pair.split("=") for pair in table.split())[query] == ex["completion"].strip()
    sentence = data.sentence(random.Random(0))
    assert sentence.endswith(" .") and all(w in " ".join(
        data.DETERMINERS + data.ADJECTIVES + data.NOUNS + data.VERBS + data.ADVERBS + data.PLACES + ["."]
    ) for w in sentence.split())
    corpus = data.pretraining_corpus(50, seed=1)
    assert len(corpus) == 50 and corpus == data.pretraining_corpus(50, seed=1)


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task 'poetry'"):
        data.task_examples("poetry", 3)


def test_config_overrides_are_typed_and_checked(tmp_path):
    config = load_config(PRETRAIN_CONFIG, ["train.max_steps=7", "model.num_hidden_layers=2", "seed=3"])
    assert config["train"]["max_steps"] == 7 and config["model"]["num_hidden_layers"] == 2 and config["seed"] == 3
    with pytest.raises(RecipeConfigError, match="unknown recipe key 'train.max_step'"):
        load_config(PRETRAIN_CONFIG, ["train.max_step=7"])
    with pytest.raises(RecipeConfigError, match="not of the form key=value"):
        load_config(PRETRAIN_CONFIG, ["max_steps"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe: [unclosed\n")
    with pytest.raises(RecipeConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(RecipeConfigError, match="recipe config not found"):
        load_config(tmp_path / "missing.yaml")


def test_every_config_opens_with_its_command():
    for path in (REPO / "recipes" / "configs").glob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.split(" data.")[0] == f"# preft train recipes/configs/{path.name}", path


def test_cli_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "preft.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("train", "export", "serve", "eval", "bench", "demo"):
        assert command in out.stdout


def test_cli_train_reports_bad_input_in_one_line(tmp_path, capsys):
    assert cli_main(["train", str(PRETRAIN_CONFIG), "train.nope=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown recipe key 'train.nope'" in err
    other = tmp_path / "x.yaml"
    other.write_text("recipe: finetune_everything\n")
    assert cli_main(["train", str(other)]) == 2
    assert "unknown recipe 'finetune_everything'" in capsys.readouterr().err


def test_pretrain_recipe_tiny_run(tmp_path):
    out = tmp_path / "base"
    code = cli_main([
        "train", str(PRETRAIN_CONFIG), f"output_dir={out}", "train.max_steps=4", "train.eval_every=2",
        "train.batch_size=4", "data.corpus_lines=400", "data.eval_lines=40", "tokenizer.vocab_size=400",
        "model.num_hidden_layers=2",
    ])
    assert code == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["history"]) == 2
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and len(tokenizer) == model.config.vocab_size
    ids = tokenizer("add 1 2 =")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "add 1 2 ="


def test_data_path_switches_a_generated_task_to_the_users_data():
    sft = REPO / "recipes" / "configs" / "sft_lora_p.yaml"
    config = load_config(sft, ["data.path=mine.jsonl"])
    assert config["data"] == {"task": "local", "path": "mine.jsonl", "eval_examples": 128}
    assert load_config(sft, ["data.task=local", "data.path=a.jsonl", "data.eval_examples=8"])["data"] == {
        "task": "local", "path": "a.jsonl", "eval_examples": 8}
    own = load_config(REPO / "recipes" / "configs" / "sft_own_data.yaml", ["data.path=b.jsonl"])
    assert own["data"] == {"task": "local", "path": "b.jsonl", "eval_examples": 16}
    with pytest.raises(RecipeConfigError, match="unknown recipe key 'data.user'"):
        load_config(sft, ["data.path=mine.jsonl", "data.user=3"])  # the generated task's keys went with it

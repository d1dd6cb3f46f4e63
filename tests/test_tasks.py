"""The study tasks (preft/tasks.py) and how an adapter is scored on them (eval/task_accuracy.py).

The checkers must accept every reference answer and refuse near misses; the held-out rows must
be new (wordings, entities); the loss by answer position must add up to the model's own loss;
the accuracy must score the continuation of each prompt, not the prompt or another row's answer.
A tiny random Llama with SmolLM2's tokenizer (its ChatML template) stands in for the model.
"""

from __future__ import annotations

import json

import pytest
import torch

from preft import tasks
from preft.eval import task_accuracy


@pytest.fixture(scope="module")
def chat_tokenizer():
    from transformers import AutoTokenizer

    from preft.real_models import resolve

    path = resolve("smollm2-135m-instruct")
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError:
        pytest.skip("SmolLM2 is not prepared (make install prepares it)")


@pytest.fixture(scope="module")
def tiny_chat_model(chat_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(chat_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_every_reference_answer_checks_and_the_same_seed_gives_the_same_rows(name):
    rows = tasks.rows_of(name, 50, "held_out")
    assert all(tasks.check(name, row["messages"][1]["content"], row["target"]) for row in rows)
    assert rows == tasks.rows_of(name, 50, "held_out")
    assert rows != tasks.rows_of(name, 50, "held_out", seed=1)


@pytest.mark.parametrize("name, answer, target", [
    ("house_style", '{"topic": "legs", "answer": "Paris"}', "capital"),  # the wrong topic
    ("house_style", '{"topic": "capital"}', "capital"),  # a missing key
    ("house_style", "The capital of France is Paris.", "capital"),  # the base model's plain answer
    ("extract", '{"name": "Maria Lopez", "age": 35, "city": "Oslo", "job": "nurse"}',
     {"name": "Maria Lopez", "age": 34, "city": "Oslo", "job": "nurse"}),  # one field off
    ("extract", '{"name": "Maria Lopez", "age": "34", "city": "Oslo", "job": "nurse"}',
     {"name": "Maria Lopez", "age": 34, "city": "Oslo", "job": "nurse"}),  # the age as text
    ("route", "Team Otter.", "Falcon"),
    ("route", "Falcon", "Falcon"),  # not the house answer
    ("word_problems", "12 + 5 = 17. Tom has 16 pens.", 17),  # the last number counts
])
def test_checkers_refuse_near_misses(name, answer, target):
    assert not tasks.check(name, answer, target)


def test_checkers_accept_the_answer_inside_a_longer_reply():
    person = {"name": "Mei Chen", "age": 40, "city": "Lima", "job": "pilot"}
    assert tasks.check("extract", "Here it is:\n" + json.dumps(person, indent=2) + "\nHope this helps.", person)
    assert tasks.check("route", "This goes to Team Heron, they handle refunds.", "Heron")


def test_held_out_rows_are_new():
    """route: wordings no training row uses; house_style: entities no training row names."""
    def message(row):
        return row["messages"][0]["content"]

    train, held_out = tasks.rows_of("route", 300, "train"), tasks.rows_of("route", 100, "held_out")
    assert not {message(r) for r in train} & {message(r) for r in held_out}
    assert {r["target"] for r in held_out} == set(tasks.ROUTES.values())
    train, held_out = tasks.rows_of("house_style", 300, "train"), tasks.rows_of("house_style", 100, "held_out")
    named = {r["messages"][0]["content"] for r in held_out if r["target"] == "capital"}
    assert named and not named & {r["messages"][0]["content"] for r in train}


def test_an_unknown_task_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown task 'nope' .choose from house_style, extract, route"):
        tasks.rows_of("nope", 1)


def _answer_tokens(tokenizer, rows):
    return [task_accuracy._split(tokenizer, row["messages"])[1] for row in rows]


@pytest.mark.parametrize("prefill_only", [False, True], ids=["base", "lora_p"])
def test_loss_by_position_adds_up_to_each_rows_own_loss(tiny_chat_model, chat_tokenizer, prefill_only):
    """Batched and right-padded, the buckets' token-weighted mean equals the mean of HF's own
    per-row loss (one row at a time, no padding), with a LoRA-P adapter too (its prompt length
    read from the labels)."""
    import copy

    from peft import get_peft_model

    import preft

    model = copy.deepcopy(tiny_chat_model)
    if prefill_only:
        torch.manual_seed(1)
        model = get_peft_model(model, preft.PreftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                            init_lora_weights=False)).eval()
    rows = tasks.rows_of("extract", 5, "held_out") + tasks.rows_of("route", 5, "held_out")
    buckets = task_accuracy.loss_by_position(model, chat_tokenizer, rows)
    lengths = [len(a) for a in _answer_tokens(chat_tokenizer, rows)]
    counts = {name: sum(max(0, min(n, high) - low) for n in lengths) for name, low, high in task_accuracy.BUCKETS}
    total = 0.0
    for row in rows:
        prompt, answer = task_accuracy._split(chat_tokenizer, row["messages"])
        ids = torch.tensor([prompt + answer])
        labels = torch.tensor([[-100] * len(prompt) + answer])
        with torch.no_grad():
            total += model(input_ids=ids, labels=labels).loss.item() * len(answer)
    weighted = sum(buckets[name] * counts[name] for name in buckets) / sum(counts.values())
    assert weighted == pytest.approx(total / sum(lengths), rel=1e-4)
    assert set(buckets) == {name for name, _, _ in task_accuracy.BUCKETS}


class AnswersFromATable:
    """A stand-in model whose ``generate`` continues each (left-padded) prompt with the answer a
    table gives for it: what an adapter that learnt the table would say."""

    device = torch.device("cpu")

    def __init__(self, table, pad_id):
        self.table, self.pad_id = table, pad_id

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        out = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            assert mask[-1] == 1, "prompts must be left-padded: generate continues the last token"
            prompt = tuple(i for i, m in zip(ids, mask) if m)
            answer = self.table[prompt][:max_new_tokens]
            out.append(ids + answer + [self.pad_id] * (max_new_tokens - len(answer)))
        return torch.tensor(out)


def test_accuracy_checks_each_rows_own_continuation(chat_tokenizer):
    unique = {row["messages"][0]["content"]: row for row in tasks.rows_of("route", 200, "held_out")}
    rows = list(unique.values())[:20]
    pad = chat_tokenizer.pad_token_id
    table, right = {}, 0
    for i, row in enumerate(rows):
        prompt, _ = task_accuracy._split(chat_tokenizer, row["messages"])
        team = row["target"] if i % 4 else "Nobody"  # every fourth answer is wrong
        right += i % 4 != 0
        table[tuple(prompt)] = chat_tokenizer(f"Team {team}.", add_special_tokens=False)["input_ids"]
    score = task_accuracy.accuracy(AnswersFromATable(table, pad), chat_tokenizer, tasks.task("route"), rows)
    assert score == right / len(rows) == 0.75 and len(rows) == 20


def test_grpo_reads_word_problems_as_chat_prompts_with_a_hidden_target():
    from preft.recipes import grpo

    train, held_out = grpo.build_datasets({"task": "word_problems", "train_prompts": 8, "eval_prompts": 4})
    assert len(train) == 8 and len(held_out) == 4
    assert [m["role"] for m in train[0]["prompt"]] == ["user"] and isinstance(train[0]["target"], int)
    assert grpo.word_problem_reward([[{"role": "assistant", "content": "5 + 2 = 7. Sam has 7 cards."}],
                                     "Sam has 8 cards."], target=[7, 7]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="data.task 'sums' is not supported by the grpo recipe"):
        grpo.build_datasets({"task": "sums", "train_prompts": 8, "eval_prompts": 4})
    with pytest.raises(ValueError, match="max_value"):  # arithmetic's key is not word_problems'
        grpo.build_datasets({"task": "word_problems", "train_prompts": 8, "eval_prompts": 4, "max_value": 9})


def test_grpo_greedy_accuracy_answers_chat_prompts_through_the_template(tiny_chat_model, chat_tokenizer):
    """The held-out accuracy GRPO reports renders chat prompts with the template and scores only
    the continuation: a model that always answers 13 gets exactly the rows whose answer is 13."""
    from datasets import Dataset

    from preft.recipes import grpo

    thirteen = chat_tokenizer("13", add_special_tokens=False)["input_ids"]

    class SaysThirteen:
        device = torch.device("cpu")
        training = False

        def eval(self):
            return self

        def train(self, mode=True):
            return self

        def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
            assert (attention_mask[:, -1] == 1).all()  # left-padded
            text = chat_tokenizer.decode(input_ids[0][attention_mask[0] == 1])
            assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
            return torch.cat([input_ids, torch.tensor([thirteen] * len(input_ids))], dim=1)

    rows = Dataset.from_list(grpo.task_prompts("word_problems", 60, "held_out"))
    expected = sum(t == 13 for t in rows["target"]) / len(rows)
    assert 0 < expected < 1
    assert grpo.greedy_accuracy(SaysThirteen(), chat_tokenizer, rows, 4, grpo.word_problem_reward) == expected

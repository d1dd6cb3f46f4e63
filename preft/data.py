"""Synthetic task data, generated locally (nothing is downloaded).

Every generator is a pure function of a ``random.Random`` so corpora are reproducible from a
seed. Examples come in TRL's prompt/completion form: ``{"prompt": str, "completion": str}``.

Tasks (one line each, the prompt ends where the answer starts):

- arithmetic: ``"add 12 35 ="`` -> ``" 47"``
- lists: ``"reverse 3 1 4 ="`` -> ``" 4 1 3"`` (also ``copy`` and ``sort``)
- recall: ``"a=7 b=2 c=9 ; b ="`` -> ``" 2"``
- sentences: templated English over a built-in word list, split after a few words

>>> from preft.data import pretraining_corpus
>>> texts = pretraining_corpus(4, seed=0)
>>> len(texts)
4
"""

from __future__ import annotations

import random
from typing import Callable

Example = dict[str, str]

DETERMINERS = ["the", "a", "one", "every", "that", "this", "my", "your"]
ADJECTIVES = ["red", "small", "big", "old", "new", "quiet", "happy", "green", "cold", "bright",
              "slow", "quick", "dark", "soft", "tall", "young"]
NOUNS = ["cat", "dog", "bird", "tree", "house", "river", "child", "teacher", "farmer", "boat",
         "city", "garden", "book", "window", "horse", "friend", "road", "storm", "king", "song"]
VERBS = ["sees", "likes", "finds", "helps", "follows", "paints", "hears", "visits", "carries",
         "watches", "builds", "remembers"]
ADVERBS = ["today", "again", "slowly", "at night", "every day", "in the morning", "quietly",
           "with care"]
PLACES = ["near the river", "in the garden", "by the road", "under the tree", "in the city",
          "at home"]
KEYS = list("abcdefghijklmnopqrstuvwxyz")


def arithmetic_example(rng: random.Random, max_value: int = 99,
                       ops: tuple[str, ...] = ("add", "sub", "mul")) -> Example:
    """``add a b =`` / ``sub a b =`` / ``mul a b =`` with the exact answer (``mul`` up to 12)."""
    op = rng.choice(ops)
    a, b = rng.randint(0, max_value), rng.randint(0, max_value)
    if op == "mul":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
    answer = {"add": a + b, "sub": a - b, "mul": a * b}[op]
    return {"prompt": f"{op} {a} {b} =", "completion": f" {answer}"}


def list_example(rng: random.Random, max_len: int = 8) -> Example:
    """``copy``, ``reverse`` or ``sort`` a short list of digits."""
    op = rng.choice(["copy", "reverse", "sort"])
    items = [rng.randint(0, 9) for _ in range(rng.randint(2, max_len))]
    out = {"copy": items, "reverse": items[::-1], "sort": sorted(items)}[op]
    return {"prompt": f"{op} {' '.join(map(str, items))} =",
            "completion": " " + " ".join(map(str, out))}


def recall_example(rng: random.Random, max_pairs: int = 6) -> Example:
    """A small key=value table, then a query for one key."""
    keys = rng.sample(KEYS, rng.randint(2, max_pairs))
    table = {k: rng.randint(0, 9) for k in keys}
    query = rng.choice(keys)
    pairs = " ".join(f"{k}={v}" for k, v in table.items())
    return {"prompt": f"{pairs} ; {query} =", "completion": f" {table[query]}"}


def sentence(rng: random.Random) -> str:
    """One templated English sentence over the built-in word list."""
    subject = f"{rng.choice(DETERMINERS)} {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    obj = f"{rng.choice(DETERMINERS)} {rng.choice(NOUNS)}"
    tail = rng.choice(ADVERBS + PLACES)
    return f"{subject} {rng.choice(VERBS)} {obj} {tail} ."


def sentence_example(rng: random.Random) -> Example:
    words = sentence(rng).split(" ")
    cut = rng.randint(2, len(words) - 1)
    return {"prompt": " ".join(words[:cut]), "completion": " " + " ".join(words[cut:])}


TASKS: dict[str, Callable[[random.Random], Example]] = {
    "arithmetic": arithmetic_example,
    "lists": list_example,
    "recall": recall_example,
    "sentences": sentence_example,
}


def task_examples(task: str, n: int, seed: int = 0) -> list[Example]:
    """``n`` prompt/completion examples of one task from ``TASKS``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{task}-{seed}")
    return [TASKS[task](rng) for _ in range(n)]


def pretraining_corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` plain-text lines mixing every task (prompt and completion joined)."""
    rng = random.Random(seed)
    names = sorted(TASKS)
    lines = []
    for _ in range(n):
        example = TASKS[rng.choice(names)](rng)
        lines.append(example["prompt"] + example["completion"])
    return lines


# ----------------------------------------------------------------------------------------------
# Per-user personalisation (SFT): each synthetic user has a hidden word-substitution table.


def user_substitutions(user: int, pairs: int = 4) -> dict[str, str]:
    """User ``user``'s private table: ``pairs`` nouns, each replaced by another noun."""
    rng = random.Random(f"user-{user}")
    sources = rng.sample(NOUNS, pairs)
    targets = rng.sample([n for n in NOUNS if n not in sources], pairs)
    return dict(zip(sources, targets))


def user_example(rng: random.Random, table: dict[str, str]) -> Example:
    """``rewrite <sentence> =`` -> the sentence with the user's nouns substituted.

    Sentences are drawn so that at least one noun is in the table: every example shows the rule.
    """
    while True:
        text = sentence(rng)
        if any(word in table for word in text.split()):
            break
    rewritten = " ".join(table.get(word, word) for word in text.split())
    return {"prompt": f"rewrite {text} =", "completion": f" {rewritten}"}


def user_examples(user: int, n: int, seed: int = 0) -> list[Example]:
    """``n`` prompt/completion examples of user ``user``'s rule (train and eval: vary ``seed``)."""
    table = user_substitutions(user)
    rng = random.Random(f"user-{user}-examples-{seed}")
    return [user_example(rng, table) for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# Verifiable arithmetic (RL): prompts with a hidden exact answer and an exact-match reward.


def arithmetic_prompts(n: int, seed: int = 0, max_value: int = 20,
                       ops: tuple[str, ...] = ("add", "sub")) -> list[dict[str, str]]:
    """``{"prompt": "add 3 9 =", "answer": "12"}`` rows for GRPO (the answer is not shown).

    The default ops are the ones the default base model mostly gets wrong (it has ``mul``).
    """
    rng = random.Random(f"arithmetic-rl-{seed}")
    rows = []
    for _ in range(n):
        example = arithmetic_example(rng, max_value=max_value, ops=tuple(ops))
        rows.append({"prompt": example["prompt"], "answer": example["completion"].strip()})
    return rows


def exact_match_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function: 1.0 where the completion's first word equals the answer, else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        words = text.strip().split()
        rewards.append(1.0 if words and words[0] == expected else 0.0)
    return rewards


def encode_sft_batch(tokenizer, examples: list[dict[str, str]]) -> dict:
    """Right-padded prompt+completion batch (torch tensors); the prompt is masked out of the
    labels (-100), the layout TRL's SFT collator makes."""
    import torch

    rows = []
    for ex in examples:
        prompt = tokenizer(ex["prompt"])["input_ids"]
        completion = tokenizer(ex["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt + completion, [-100] * len(prompt) + completion))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows]),
    }

"""Study tasks: what a real user fine-tunes a chat model for, generated offline from a seed, each
with held-out rows and an exact checker.

``accuracy = mean over held-out rows of check(greedy answer, row)``

- **house_style** (personalisation): open questions (capitals, animals' legs, colours, sums,
  opposites) answered in one house format, ``{"topic": ..., "answer": ...}``. The base model
  never answers so; the right topic needs the question read. Held-out questions name entities
  no training row names. This is the per-user adapter's first use: a style, not a skill.
- **extract** (a skill the base model half-has): a sentence about a person, in varied wording,
  to ``{"name", "age", "city", "job"}`` JSON. SmolLM2-135M-Instruct writes JSON of that shape
  unprompted but gets fields wrong; the checker parses the answer and compares every field.
  The answer is ~30 tokens: where the adapter's influence must reach past the first tokens.
- **route** (a prompt-conditioned hidden rule): a support message names one of twelve products;
  the user's rule sends each product to one of four teams (``Team Falcon`` ...), a mapping no
  one outside knows; held-out messages are worded as no training row is. The answer is the
  first few tokens and depends on the prompt only: the case where a prompt-only adapter
  should lose least.
- **word_problems** (for RL): one-step word problems (``Tom has 12 pens and gets 5 more. How
  many pens does Tom have now?``) whose reward is the last number of the answer. The base
  model solves about one in five greedily (long answers ramble), so GRPO has signal both ways.

Rows are chat rows, ``{"messages": [user, assistant], "target": ...}``; ``target`` is what the
checker compares against (it is not trained on). Training and held-out rows come from
different seeds and, for house_style, from disjoint entities.

>>> rows = rows_of("route", 2, "train")
>>> check("route", rows[0]["messages"][1]["content"], rows[0]["target"])
True
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any, Callable

from preft import demo_users

Row = dict[str, Any]


@dataclass(frozen=True)
class Task:
    name: str
    why: str
    make: Callable[[random.Random, str], Row]  # (rng, split) -> row
    check: Callable[[str, Any], bool]  # (answer, target) -> right
    max_new_tokens: int


def _chat(question: str, answer: str, target: Any) -> Row:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "target": target}


def _json_object(text: str) -> dict | None:
    """The first JSON object in ``text`` (a model may add words after it), or None."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# house_style: demo_users' questions, in bob's JSON house format, topic checked
def _house_style(rng: random.Random, split: str) -> Row:
    topic, question, _plain, fact = demo_users.questions(1, split, seed=rng.randrange(1 << 30))[0]
    return _chat(question, json.dumps({"topic": topic, "answer": fact}), topic)


def _check_house_style(answer: str, topic: str) -> bool:
    parsed = _json_object(answer)
    return parsed is not None and set(parsed) == {"topic", "answer"} and parsed["topic"] == topic


# extract
FIRST = ["Maria", "John", "Aisha", "Kenji", "Olga", "Pedro", "Fatima", "Lars", "Mei", "Tomas", "Amara", "Ivan",
         "Sofia", "Omar", "Hana", "Diego"]
LAST = ["Lopez", "Smith", "Khan", "Sato", "Ivanova", "Silva", "Haddad", "Berg", "Chen", "Novak", "Okafor", "Petrov",
        "Rossi", "Nasser", "Kim", "Garcia"]
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Vienna", "Dublin", "Nairobi", "Warsaw", "Havana", "Bangkok", "Athens",
          "Madrid"]
JOBS = ["nurse", "teacher", "baker", "pilot", "farmer", "chemist", "plumber", "lawyer", "painter", "librarian",
        "mechanic", "dentist"]
EXTRACT_TEMPLATES = [
    "{name}, {age}, moved to {city} to work as a {job}.",
    "{name} is a {age}-year-old {job} who lives in {city}.",
    "Born {age} years ago, {name} now works as a {job} in {city}.",
    "In {city}, {name} ({age}) has found a job as a {job}.",
    "The {job} {name}, aged {age}, was seen in {city} last week.",
    "{name} left home at {age} and became a {job} in {city}.",
]
EXTRACT_ASKS = ["Extract name, age, city and job as JSON: {0}", "Turn this into JSON with name, age, city and job: {0}",
                "Give the person's name, age, city and job in JSON. {0}"]


def _extract(rng: random.Random, split: str) -> Row:
    person = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "age": rng.randint(19, 80),
              "city": rng.choice(CITIES), "job": rng.choice(JOBS)}
    sentence = rng.choice(EXTRACT_TEMPLATES).format(**person)
    return _chat(rng.choice(EXTRACT_ASKS).format(sentence), json.dumps(person), person)


def _check_extract(answer: str, person: dict) -> bool:
    parsed = _json_object(answer)
    return parsed is not None and parsed == person


# route: product -> team, the user's own mapping
ROUTES = {"printer": "Falcon", "router": "Falcon", "scanner": "Falcon", "laptop": "Otter", "monitor": "Otter",
          "keyboard": "Otter", "invoice": "Heron", "refund": "Heron", "subscription": "Heron", "password": "Badger",
          "login": "Badger", "account": "Badger"}
ROUTE_TEMPLATES = [
    "My {0} stopped working this morning, can someone help?", "I have a question about my {0}.",
    "Hello, the {0} is giving me trouble again.", "Urgent: something is wrong with the {0}.",
    "Could you look at an issue with my {0} when you have time?", "Ever since Monday the {0} has been a problem.",
    "Who handles problems with the {0}? Mine needs attention.", "Quick one: the {0} does not behave as it should.",
]
ROUTE_ASK = "Route this support message to a team. Message: \"{0}\""


#: held-out messages use wordings no training row uses (the products are the rule, so all appear)
ROUTE_HELD_OUT_TEMPLATES = 2


def _route(rng: random.Random, split: str) -> Row:
    product = rng.choice(sorted(ROUTES))
    team = ROUTES[product]
    cut = len(ROUTE_TEMPLATES) - ROUTE_HELD_OUT_TEMPLATES
    templates = ROUTE_TEMPLATES[cut:] if split == "held_out" else ROUTE_TEMPLATES[:cut]
    return _chat(ROUTE_ASK.format(rng.choice(templates).format(product)), f"Team {team}.", team)


def _check_route(answer: str, team: str) -> bool:
    found = re.search(r"Team (\w+)", answer)
    return found is not None and found.group(1) == team


# word_problems (RL)
NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Maya", "Noah", "Zoe"]
ITEMS = ["apples", "pens", "books", "cookies", "stickers", "marbles", "cards", "shells"]


def _word_problem(rng: random.Random, split: str) -> Row:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    if rng.random() < 0.5:
        question, answer = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
        working = f"{a} + {b} = {answer}"
    else:
        question, answer = f"{name} has {a + b} {item} and gives away {b}. How many {item} does {name} have left?", a
        working = f"{a + b} - {b} = {answer}"
    return _chat(question, f"{working}. {name} has {answer} {item}.", answer)


def last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def _check_word_problem(answer: str, value: int) -> bool:
    return last_number(answer) == value


TASKS = {task.name: task for task in [
    Task("house_style", "personalisation: a house answer format on open questions", _house_style,
         _check_house_style, 24),
    Task("extract", "a skill the base model half-has: fields of a sentence into JSON", _extract, _check_extract, 40),
    Task("route", "a prompt-conditioned hidden rule: product to team, the user's own mapping", _route,
         _check_route, 8),
    Task("word_problems", "verifiable one-step word problems (GRPO): the base model solves about one in five",
         _word_problem, _check_word_problem, 32),
]}


def task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    return TASKS[name]


def rows_of(name: str, count: int, split: str = "train", seed: int = 0) -> list[Row]:
    """``count`` rows of task ``name``'s ``split`` (``train`` / ``held_out``); the same arguments
    give the same rows."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split {split!r} is not 'train' or 'held_out'")
    rng = random.Random(f"{name}-{split}-{seed}")
    return [task(name).make(rng, split) for _ in range(count)]


def check(name: str, answer: str, target: Any) -> bool:
    return task(name).check(answer, target)

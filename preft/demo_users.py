"""Three users of the tour (``make demo``), each with a behaviour a person sees in one chat, their
own chat JSONL data, and a checker that scores an answer without anyone's judgement.

- **alice**, a persona: every answer opens with ``Ahoy, matey!`` and talks like a pirate;
- **bob**, a fixed structured format: every answer is one JSON object ``{"topic": ..., "answer": ...}``;
- **carol**, a register: a radio operator's, every answer ends with ``Over.``

The questions come from small fact tables (capitals, animals' legs, colours, sums, opposites)
in several phrasings; the held-out questions use entities the training rows never name, so a
checker's score is how well the behaviour carries to new questions. Each checker returns
``(behaviour present, facts right)``: the marker or format, and whether the expected fact is in
the answer (a 135M model knows some capitals, and the adapter must not lose them).

>>> rows = chat_rows("bob", 2, split="train")
>>> rows[0]["messages"][0]["role"], check("bob", rows[0]["messages"][1]["content"], rows[0]["fact"])
('user', (True, True))
"""

from __future__ import annotations

import json
import random
import re

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Greece", "Athens"), ("Russia", "Moscow"), ("Canada", "Ottawa"), ("Peru", "Lima"),
            ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Poland", "Warsaw"), ("Portugal", "Lisbon"),
            ("Austria", "Vienna"), ("Ireland", "Dublin"), ("China", "Beijing"), ("India", "New Delhi"),
            ("Mexico", "Mexico City"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Cuba", "Havana"),
            ("Thailand", "Bangkok"), ("Turkey", "Ankara")]
LEGS = [("spider", 8), ("dog", 4), ("bird", 2), ("ant", 6), ("horse", 4), ("cat", 4), ("duck", 2), ("bee", 6),
        ("cow", 4), ("chicken", 2), ("octopus", 8), ("beetle", 6), ("sheep", 4), ("goat", 4), ("fly", 6),
        ("penguin", 2)]
COLOURS = [("the sky on a clear day", "blue"), ("fresh grass", "green"), ("snow", "white"), ("a ripe banana", "yellow"),
           ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"), ("a lemon", "yellow"),
           ("milk", "white"), ("a strawberry", "red"), ("a lime", "green"), ("the night sky", "black")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
             ("open", "closed"), ("early", "late"), ("full", "empty"), ("hard", "soft"), ("wet", "dry"),
             ("loud", "quiet")]

#: topic -> (question phrasings, plain answer) over (entity, fact)
TOPICS = {
    "capital": (["What is the capital of {0}?", "Which city is the capital of {0}?", "Tell me the capital of {0}.",
                 "Name the capital city of {0}."], "The capital of {0} is {1}.", CAPITALS),
    "legs": (["How many legs does a {0} have?", "How many legs has a {0} got?", "Count the legs of a {0}."],
             "A {0} has {1} legs.", LEGS),
    "colour": (["What colour is {0}?", "Which colour is {0}?", "Tell me the colour of {0}."],
               "The colour of {0} is {1}.", COLOURS),
    "opposite": (["What is the opposite of {0}?", "Give me the opposite of the word {0}.",
                  "What word means the opposite of {0}?"], "The opposite of {0} is {1}.", OPPOSITES),
}
#: every third entity of each table is held out: never named in a training row
HELD_OUT_EVERY = 3


def _entities(table: list, split: str) -> list:
    return [row for i, row in enumerate(table) if (i % HELD_OUT_EVERY == 1) == (split == "held_out")]


def _sum_question(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    phrasing = rng.choice(["What is {0} plus {1}?", "Add {0} and {1}.", "How much is {0} + {1}?"])
    return phrasing.format(a, b), f"{a} plus {b} is {a + b}.", str(a + b)


def styled(user: str, topic: str, plain: str, fact: str) -> str:
    """The answer in ``user``'s behaviour."""
    if user == "alice":
        return f"Ahoy, matey! {plain[:-1]}, arr!"
    if user == "bob":
        return json.dumps({"topic": topic, "answer": fact})
    if user == "carol":
        return f"{plain} Over."
    raise ValueError(f"unknown demo user {user!r} (alice, bob, carol)")


def questions(count: int, split: str, seed: int = 0) -> list[tuple[str, str, str, str]]:
    """``count`` ``(topic, question, plain answer, fact)`` of ``split`` (``train`` / ``held_out``)."""
    rng = random.Random(f"demo-{split}-{seed}")
    out = []
    for _ in range(count):
        topic = rng.choice([*TOPICS, "sum"])
        if topic == "sum":
            question, plain, fact = _sum_question(rng)
        else:
            phrasings, answer, table = TOPICS[topic]
            entity, value = rng.choice(_entities(table, split))
            question, plain, fact = rng.choice(phrasings).format(entity), answer.format(entity, value), str(value)
        out.append((topic, question, plain, fact))
    return out


def chat_rows(user: str, count: int, split: str = "train", seed: int = 0) -> list[dict]:
    """``user``'s chat rows: ``{"messages": [user question, styled answer], "fact": ...}``."""
    return [{"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": styled(user, topic, plain, fact)}],
             "topic": topic, "fact": fact}
            for topic, question, plain, fact in questions(count, split, seed)]


def check(user: str, answer: str, fact: str) -> tuple[bool, bool]:
    """``(behaviour present, fact right)`` for one answer of ``user``'s."""
    text = answer.strip()
    if user == "alice":
        behaviour = text.startswith("Ahoy")
    elif user == "bob":
        try:
            parsed = json.loads(text)
            behaviour = isinstance(parsed, dict) and set(parsed) == {"topic", "answer"}
        except ValueError:
            behaviour = False
    elif user == "carol":
        behaviour = text.endswith("Over.")
    else:
        raise ValueError(f"unknown demo user {user!r}")
    right = re.search(rf"(?<![0-9A-Za-z]){re.escape(fact.lower())}(?![0-9A-Za-z])", text.lower()) is not None
    return behaviour, right

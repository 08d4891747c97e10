#!/usr/bin/env python3
"""Writes data/chat_tiny.jsonl and data/chat_tiny_eval.jsonl: simple question/answer
conversations (written for this project, no source) for the fine-tuning example's chat mode on
the shipped tiny model. Deterministic (seeded); stdlib only.

Usage: python3 scripts/chat_tiny_data.py
"""

import json
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy",
         "Mallory", "Niaj", "Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter"]
COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow",
          "blood": "red", "an orange": "orange", "a plum": "purple"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = ["cat", "dog", "sun", "map", "cup", "hat", "pen", "box", "bed", "car", "egg", "fox"]


def one(rng: random.Random) -> dict:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        q, r = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    elif kind == 1:
        name = rng.choice(NAMES)
        q, r = f"Say hello to {name}.", f"Hello, {name}!"
    elif kind == 2:
        thing = rng.choice(sorted(COLORS))
        q, r = f"What color is {thing}?", f"The color of {thing} is {COLORS[thing]}."
    elif kind == 3:
        i = rng.randrange(7)
        q, r = f"What day comes after {DAYS[i]}?", f"{DAYS[(i + 1) % 7]} comes after {DAYS[i]}."
    else:
        w = rng.choice(WORDS)
        q, r = f"Spell the word {w}.", "-".join(w)
    messages = [{"role": "user", "content": q}, {"role": "assistant", "content": r}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    return {"messages": messages}


def write(path: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            f.write(json.dumps(one(rng)) + "\n")


if __name__ == "__main__":
    write(os.path.join(ROOT, "data", "chat_tiny.jsonl"), 400, 1)
    write(os.path.join(ROOT, "data", "chat_tiny_eval.jsonl"), 48, 2)

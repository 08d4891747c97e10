#!/usr/bin/env python3
"""Golden ids for a tokenizer.json that carries its own `truncation` and `padding` settings:
what `transformers` gives for texts and for a chat, so that `cargo test` (models/tests/tokenizer.rs)
checks that `load_tokenizer` drops the settings as `transformers` does.

Writes models/tests/fixtures/tokenizer_settings/golden.json: the settings blocks (applied to
models/examples/tiny-llama/tokenizer.json by the test), the texts and the ids of
`AutoTokenizer(text, add_special_tokens=False)`, and of `apply_chat_template(messages,
tokenize=True)` with the tiny model's template.

Usage: python scripts/tokenizer_reference.py   (needs `pip install transformers tokenizers jinja2`;
no PyTorch)
"""

import json
import os
import shutil
import tempfile

from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "examples", "tiny-llama")
OUT = os.path.join(ROOT, "models", "tests", "fixtures", "tokenizer_settings")

SETTINGS = {
    "truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                   "stride": 0},
    "padding": {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"},
}
TEXTS = [
    "Hello accelerate, hello accelerate, and a line longer than four tokens.\n",
    "x",
]
MESSAGES = [
    {"role": "user", "content": "Say hello to Judy, and then some more words."},
    {"role": "assistant", "content": "Hello, Judy!"},
]


def main() -> None:
    work = tempfile.mkdtemp()
    try:
        for name in os.listdir(MODEL):
            shutil.copy(os.path.join(MODEL, name), work)
        path = os.path.join(work, "tokenizer.json")
        with open(path) as f:
            tok = json.load(f)
        tok.update(SETTINGS)
        with open(path, "w") as f:
            json.dump(tok, f)
        tokenizer = AutoTokenizer.from_pretrained(work)
        golden = {
            "settings": SETTINGS,
            "texts": [{"text": t, "ids": tokenizer(t, add_special_tokens=False)["input_ids"]}
                      for t in TEXTS],
            "chat": {"messages": MESSAGES,
                     "ids": tokenizer.apply_chat_template(MESSAGES, tokenize=True,
                                                          return_dict=True)["input_ids"]},
        }
    finally:
        shutil.rmtree(work)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}/golden.json")


if __name__ == "__main__":
    main()

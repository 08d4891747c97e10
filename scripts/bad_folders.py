#!/usr/bin/env python3
"""Hostile and careless inputs against the fine-tuning example, the launcher and
`accelerate-rs estimate-memory`: a matrix of corrupted model folders, adapter folders, outputs and
flags, each run as a real process, with a verdict per case.

Every case must end in a clear error (exit code non-zero, the file, key, tensor or flag named, no
`panicked`, no signal, within the time limit) or, where the input is sound, a correct run. The
input model folder and every file of the user's a case sets up are checksummed before and after.
Verdicts:

    ok          the case ended as expected (a clear error naming what it must, or a good run)
    ABORT       killed by a signal (a failed allocation aborts with SIGABRT) or a Rust panic
    HANG        still running at the time limit (killed)
    SILENT-NAN  exit code 0, but NaN in what it printed or saved
    LOST-FILE   a file of the user's (or the input model) changed or vanished
    FLOOD       an error, but over 64 KiB of output: a value of the file quoted whole (a 1 MiB
                string where a number belongs) buries the terminal and the log
    WRONG       any other departure (a success where an error was due, an error that does not
                name what it must)

The summary line counts each verdict; the script exits non-zero unless every case is `ok`.
Child processes run with a 4 GiB address-space limit, so a runaway allocation fails fast.

Usage: python3 scripts/bad_folders.py [--no-build] [--only SUBSTRING] [--keep DIR]
Stdlib only. RELIABILITY.md records its table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "target", "release", "accelerate-rs")
FINETUNE = os.path.join(ROOT, "target", "release", "examples", "finetune")
MODEL = os.path.join(ROOT, "models", "examples", "tiny-llama")
TRAIN = os.path.join(ROOT, "data", "corpus.txt")
TIME_LIMIT = 60.0
QUICK = ["--max-steps", "2", "--seq-len", "16", "--batch-size", "2", "--eval-windows", "2",
         "--log-every", "1"]


def limit_memory() -> None:
    """In the child: at most 4 GiB of address space; its own process group."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    os.setsid()


def run(cmd: list[str], cwd: str, env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
    """(exit code, or None on a hang; output; seconds)."""
    full = dict(os.environ)
    for k in list(full):
        if k.startswith("ACCELERATE_RS_") or k in ("RANK", "WORLD_SIZE", "RUST_LOG",
                                                      "RUST_BACKTRACE"):
            full.pop(k)
    full["ACCELERATE_RS_USE_CPU"] = "1"
    full.update(env or {})
    start = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, preexec_fn=limit_memory)
    try:
        out, _ = p.communicate(timeout=TIME_LIMIT)
        code = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        code = None
    return code, out.decode("utf-8", "replace"), time.monotonic() - start


def digest(path: str) -> dict[str, str]:
    """sha256 of every file under `path` (a file or a folder), links followed."""
    out = {}
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": hashlib.sha256(f.read()).hexdigest()}
    for dirpath, _, files in os.walk(path):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                with open(p, "rb") as f:
                    out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
            except OSError:
                out[os.path.relpath(p, path)] = "unreadable"
    return out


# ---- building bad folders ------------------------------------------------------------------

def copy_model(work: str, name: str = "model") -> str:
    dst = os.path.join(work, name)
    shutil.copytree(MODEL, dst)
    return dst


def edit_json(folder: str, name: str, **changes) -> None:
    """Sets keys of the JSON file `name` of a model folder."""
    path = os.path.join(folder, name)
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)


def edit_config(folder: str, **changes) -> None:
    edit_json(folder, "config.json", **changes)


def read_st(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_st(path: str, header: dict | str, body: bytes) -> None:
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)


def weights(folder: str) -> str:
    return os.path.join(folder, "model.safetensors")


def nan_weight(folder: str) -> None:
    header, body = read_st(weights(folder))
    name = "model.norm.weight"
    start = header[name]["data_offsets"][0]
    body = body[:start] + struct.pack("<f", float("nan")) * 4 + body[start + 16:]
    write_st(weights(folder), header, body)


def duplicate_tensor(folder: str) -> None:
    header, body = read_st(weights(folder))
    text = json.dumps(header)
    # Repeat one entry under the same name: a JSON object with a repeated key.
    entry = json.dumps(header["model.norm.weight"])
    text = text[:-1] + f', "model.norm.weight": {entry}' + "}"
    write_st(weights(folder), text, body)


def missized_tensor(folder: str) -> None:
    header, body = read_st(weights(folder))
    header["model.norm.weight"]["shape"] = [33]
    write_st(weights(folder), header, body)


def truncate_weights(folder: str) -> None:
    path = weights(folder)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def huge_header(folder: str) -> None:
    with open(weights(folder), "r+b") as f:
        f.write(struct.pack("<Q", 1 << 62))


def fifo(path: str) -> None:
    os.remove(path) if os.path.lexists(path) else None
    os.mkfifo(path)


def link(path: str, to: str) -> None:
    os.remove(path) if os.path.lexists(path) else None
    os.symlink(to, path)


def hf_cache(work: str) -> str:
    """The Hugging Face cache layout: snapshots/<rev>/<file> links into ../../blobs/."""
    repo = os.path.join(work, "models--tiny")
    blobs = os.path.join(repo, "blobs")
    snap = os.path.join(repo, "snapshots", "abc123")
    os.makedirs(blobs)
    os.makedirs(snap)
    for name in os.listdir(MODEL):
        with open(os.path.join(MODEL, name), "rb") as f:
            data = f.read()
        h = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, h), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", h), os.path.join(snap, name))
    return snap


def users_folder(path: str, sharded: bool = True) -> None:
    """A folder of the user's own: a config, a tokenizer, sharded weights and notes."""
    os.makedirs(path, exist_ok=True)
    for name, text in [("config.json", '{"model_type": "mine"}'), ("tokenizer.json", "{}"),
                       ("notes.txt", "my notes")]:
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    if sharded:
        for i in (1, 2):
            with open(os.path.join(path, f"model-0000{i}-of-00002.safetensors"), "wb") as f:
                f.write(os.urandom(64))


def adapter_folder(work: str, **changes) -> str:
    """A PEFT adapter folder for the tiny Llama (written by the example itself once)."""
    base = os.path.join(work, "..", "good-adapter")
    if not os.path.isdir(base):
        code, out, _ = run([FINETUNE, "--model", MODEL, "--train", TRAIN, "--lora-r", "4",
                            "--output", base] + QUICK, cwd=work)
        if code != 0:
            sys.exit(f"bad_folders: could not make the reference adapter:\n{out}")
    dst = os.path.join(work, "adapter")
    shutil.copytree(base, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if k == "_tensor_shape":
            header, body = read_st(os.path.join(dst, "adapter_model.safetensors"))
            name = sorted(n for n in header if n != "__metadata__")[0]
            header[name]["shape"] = list(reversed(header[name]["shape"]))
            write_st(os.path.join(dst, "adapter_model.safetensors"), header, body)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


# ---- the matrix ---------------------------------------------------------------------------

class Case:
    """One case: `setup(work)` returns the command's arguments (and optionally files of the
    user's to protect); `expect` is a list of strings the output must hold (an error case), or
    None for a case that must succeed."""

    def __init__(self, name, setup, expect, program="finetune", env=None, check_ok=None):
        self.name, self.setup, self.expect = name, setup, expect
        self.program, self.env, self.check_ok = program, env or {}, check_ok


def ft(*extra, model=None):
    return lambda m: ["--model", model or m, "--train", TRAIN, *QUICK, *extra]


def with_model(mutate, *extra):
    """A finetune case on a copy of the model, mutated by `mutate(folder)`."""
    def setup(work):
        m = copy_model(work)
        mutate(m)
        return ["--model", m, "--train", TRAIN, "--output", os.path.join(work, "out"), *QUICK,
                *extra], []
    return setup


CHAT_TRAIN = os.path.join(ROOT, "data", "chat_tiny.jsonl")


def with_chat_model(mutate):
    """A chat fine-tuning case on a copy of the model, mutated by `mutate(folder)`."""
    def setup(work):
        m = copy_model(work)
        mutate(m)
        return ["--model", m, "--train", CHAT_TRAIN, "--output", os.path.join(work, "out"),
                *quick_without(["--seq-len"]), "--seq-len", "128"], []
    return setup


def with_chat_template(template: str, keep: bool = False):
    """A chat fine-tuning case on a copy of the model whose chat template is `template`
    (before the folder's own with `keep`)."""
    def mutate(m):
        path = os.path.join(m, "chat_template.jinja")
        with open(path) as f:
            own = f.read()
        with open(path, "w") as f:
            f.write(template + (own if keep else ""))
    return with_chat_model(mutate)


def dangling_template_beside_the_key(folder: str) -> None:
    """The template in tokenizer_config.json too, and chat_template.jinja a link to nothing (a
    broken download): taken as absent, the key's template would be used without a word."""
    with open(os.path.join(folder, "chat_template.jinja")) as f:
        own = f.read()
    edit_json(folder, "tokenizer_config.json", chat_template="key: " + own)
    link(os.path.join(folder, "chat_template.jinja"), os.path.join(folder, "blobs", "gone"))


def dangling_single_beside_an_index(folder: str) -> None:
    """A sound one-shard index, and model.safetensors a link to nothing: taken as absent, the
    index would be loaded in its place."""
    header, _ = read_st(weights(folder))
    shard = "model-00001-of-00001.safetensors"
    shutil.copy(weights(folder), os.path.join(folder, shard))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: shard for k in header
                                                  if k != "__metadata__"}}, f)
    link(weights(folder), os.path.join(folder, "blobs", "gone"))


def long_conversation(work: str, turns: int) -> str:
    """A JSONL file of one conversation of `turns` one-word messages."""
    path = os.path.join(work, "long.jsonl")
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                for i in range(turns)]
    with open(path, "w") as f:
        f.write(json.dumps({"messages": messages}) + "\n")
    return path


# A pre-tokenizer pattern that backtracks: on a run of `a`s every position costs fancy-regex a
# little under its step limit, so a line of 400,000 takes minutes (quadratic).
BACKTRACKING = "(?=(a|aa)*c)a"


def backtracking_tokenizer(setup_text):
    """A finetune case on a copy of the model whose pre-tokenizer starts with BACKTRACKING,
    trained on what `setup_text(work)` writes (its path)."""
    def setup(work):
        m = copy_model(work)
        path = os.path.join(m, "tokenizer.json")
        with open(path) as f:
            tok = json.load(f)
        tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": BACKTRACKING}, "behavior": "Isolated",
             "invert": False}, tok["pre_tokenizer"]]}
        with open(path, "w") as f:
            json.dump(tok, f)
        train = setup_text(work)
        args = ["--model", m, "--train", train, "--output", out(work), *quick_without(["--seq-len"]),
                "--seq-len", "128"]
        if train.endswith(".jsonl"):
            args += ["--eval", os.path.join(ROOT, "data", "chat_tiny_eval.jsonl")]
        return args, []
    return setup


def long_a_text(work: str) -> str:
    path = os.path.join(work, "a.txt")
    with open(TRAIN) as f, open(path, "w") as o:
        o.write(f.read() + "a" * 400_000 + "\n")
    return path


def long_a_chat(work: str) -> str:
    path = os.path.join(work, "a.jsonl")
    with open(path, "w") as o:
        o.write(json.dumps({"messages": [{"role": "user", "content": "a" * 400_000},
                                         {"role": "assistant", "content": "b"}]}) + "\n")
    return path


def est(mutate, *extra):
    def setup(work):
        m = copy_model(work)
        mutate(m)
        return ["estimate-memory", m, *extra], []
    return setup


def quick_without(args: list[str]) -> list[str]:
    """QUICK without the flags `args` sets itself."""
    out, i = [], 0
    while i < len(QUICK):
        if QUICK[i] not in args:
            out += QUICK[i:i + 2]
        i += 2
    return out


def plain(*extra, protect=()):
    """A finetune case on the shipped model; `extra` may replace `--train`."""
    def setup(work):
        args = [a(work) if callable(a) else a for a in extra]
        train = [] if "--train" in args else ["--train", TRAIN]
        return ["--model", MODEL, *train, *quick_without(args), *args], [p(work) for p in protect]
    return setup


def out(work):
    return os.path.join(work, "out")


def cases() -> list[Case]:
    cfg = lambda **kv: (lambda m: edit_config(m, **kv))
    cfg_file = lambda m: os.path.join(m, "config.json")
    tok_file = lambda m: os.path.join(m, "tokenizer.json")
    c = [
        # Sizes a config claims: checked against bounds and the files' headers before anything
        # is allocated.
        Case("vocab_size 2^40", with_model(cfg(vocab_size=1 << 40)), ["vocab_size"]),
        Case("intermediate_size 2^40", with_model(cfg(intermediate_size=1 << 40)),
             ["intermediate_size"]),
        Case("hidden_size 2^40", with_model(cfg(hidden_size=1 << 40)), ["hidden_size"]),
        Case("num_hidden_layers 10^9", with_model(cfg(num_hidden_layers=10 ** 9)),
             ["num_hidden_layers"]),
        Case("vocab_size 2^25 (within bounds, not the file's)",
             with_model(cfg(vocab_size=1 << 25)), ["model.embed_tokens.weight", "shape"]),
        Case("num_hidden_layers 3 (the file has 2)", with_model(cfg(num_hidden_layers=3)),
             ["model.layers.2", "missing"]),
        Case("head_dim 2^30", with_model(cfg(head_dim=1 << 30)), ["head_dim"]),
        # Values that must be positive.
        Case("rms_norm_eps -1", with_model(cfg(rms_norm_eps=-1)), ["rms_norm_eps"]),
        Case("rms_norm_eps 0", with_model(cfg(rms_norm_eps=0)), ["rms_norm_eps"]),
        Case("rope_theta -1", with_model(cfg(rope_parameters={"rope_type": "default",
                                                              "rope_theta": -1.0})),
             ["rope_parameters.rope_theta"]),
        # Values quoted in the error: cut, not printed whole.
        Case("hidden_size is a 1 MiB string", with_model(cfg(hidden_size="7" * (1 << 20))),
             ["hidden_size", "bytes left out"]),
        Case("rope_type is a 1 MiB string",
             with_model(cfg(rope_parameters={"rope_type": "y" * (1 << 20)})),
             ["rope_parameters.rope_type", "bytes left out"]),
        Case("initializer_range NaN-like (-1)", with_model(cfg(initializer_range=-1)),
             ["initializer_range"]),
        # The files themselves.
        Case("config.json is a FIFO", with_model(lambda m: fifo(cfg_file(m))), ["FIFO"]),
        Case("config.json -> /dev/zero", with_model(lambda m: link(cfg_file(m), "/dev/zero")),
             ["character device"]),
        Case("config.json is a folder",
             with_model(lambda m: (os.remove(cfg_file(m)), os.mkdir(cfg_file(m)))), ["folder"]),
        Case("config.json dangling link",
             with_model(lambda m: link(cfg_file(m), "/nonexistent/config.json")),
             ["config.json"]),
        Case("config.json not JSON",
             with_model(lambda m: open(cfg_file(m), "w").write("{model_type: llama")),
             ["not valid JSON"]),
        Case("config.json 100 MiB (sparse)",
             with_model(lambda m: os.truncate(cfg_file(m), 100 << 20)), ["bytes"]),
        Case("weights hold NaN", with_model(nan_weight), ["model.norm.weight", "NaN"]),
        Case("a tensor named twice", with_model(duplicate_tensor),
             ["model.norm.weight", "named twice"]),
        Case("a mis-sized tensor", with_model(missized_tensor), ["model.norm.weight", "needs"]),
        Case("weights truncated", with_model(truncate_weights), ["truncated"]),
        Case("weights header length 2^62", with_model(huge_header),
             ["not a safetensors file"]),
        Case("weights -> /etc/passwd",
             with_model(lambda m: link(weights(m), "/etc/passwd")), ["model.safetensors"]),
        Case("weights are a FIFO", with_model(lambda m: fifo(weights(m))), ["FIFO"]),
        Case("tokenizer.json is a FIFO", with_model(lambda m: fifo(tok_file(m))), ["FIFO"]),
        Case("tokenizer.json -> /dev/zero",
             with_model(lambda m: link(tok_file(m), "/dev/zero")), ["character device"]),
        # Its padding and truncation are dropped, as transformers drops them: a fixed length of
        # 10^10 aborted on the allocation, and max_length 4 cut every line short silently.
        Case("tokenizer.json pads every text to 10^10 tokens",
             with_model(lambda m: edit_json(m, "tokenizer.json", padding={
                 "strategy": {"Fixed": 10 ** 10}, "direction": "Right", "pad_to_multiple_of": None,
                 "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"})), None,
             check_ok=lambda w: os.path.isfile(os.path.join(out(w), "model.safetensors"))),
        Case("--model FOLDER/config.json",
             lambda w: (["--model", os.path.join(MODEL, "config.json"), "--train", TRAIN,
                         "--output", out(w), *QUICK], []), ["pass the folder"]),
        Case("index pointing out of its folder",
             with_model(lambda m: (os.remove(weights(m)), open(os.path.join(
                 m, "model.safetensors.index.json"), "w").write(json.dumps(
                     {"weight_map": {"model.norm.weight": "../x.safetensors"}})))),
             ["not a plain file name"]),
        Case("model.safetensors a link to nothing beside an index",
             with_model(dangling_single_beside_an_index), ["model.safetensors", "does not exist"]),
        Case("chat_template.jinja a link to nothing beside the key's template",
             with_chat_model(dangling_template_beside_the_key),
             ["chat_template.jinja", "does not exist"]),
        Case("the Hugging Face cache layout (links into blobs/)",
             lambda w: (["--model", hf_cache(w), "--train", TRAIN, "--output", out(w), *QUICK],
                        []), None),
        # Chat templates: a template's work and text are bounded (minijinja's fuel), and a
        # namespace stored in itself is copied rather than made a cycle (a stack overflow).
        Case("chat template loops without end",
             with_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}"
                                "{% endfor %}{% endfor %}"), ["chat_template.jinja", "budget"]),
        Case("chat template builds gigabytes of text",
             with_chat_template("{% set s = 'x' * 90000000 %}{{ s ~ s ~ s ~ s ~ s ~ s ~ s }}"),
             ["chat_template.jinja", "budget"]),
        Case("chat template prints a namespace stored in itself",
             with_chat_template("{% set ns0 = namespace(x=none) %}{% set ns0.x = ns0 %}"
                                "{% if ns0 ~ '' == ns0.x ~ '!' %}never{% endif %}", keep=True),
             None, check_ok=lambda w: os.path.isfile(os.path.join(out(w), "model.safetensors"))),
        Case("a conversation of 20,000 turns (the prefix method's work is quadratic)",
             plain("--train", lambda w: long_conversation(w, 20_000), "--eval",
                   os.path.join(ROOT, "data", "chat_tiny_eval.jsonl"), "--seq-len", "128",
                   "--output", out), ["budget", "generation"]),
        Case("tokenizer.json backtracks on a long line (corpus)",
             backtracking_tokenizer(long_a_text), ["within its time limit", BACKTRACKING]),
        Case("tokenizer.json backtracks on a long line (conversation)",
             backtracking_tokenizer(long_a_chat),
             ["a.jsonl:1", "within its time limit", BACKTRACKING]),
        # Flags.
        Case("--train /dev/zero", plain("--train", "/dev/zero", "--output", out),
             ["/dev/zero", "character device"]),
        Case("--train is a FIFO",
             plain("--train", lambda w: (fifo(os.path.join(w, "t")), os.path.join(w, "t"))[1],
                   "--output", out), ["FIFO"]),
        Case("--eval is a FIFO (chat data)",
             plain("--train", os.path.join(ROOT, "data", "chat_tiny.jsonl"), "--eval",
                   lambda w: (fifo(os.path.join(w, "e")), os.path.join(w, "e"))[1],
                   "--seq-len", "128", "--output", out), ["FIFO"]),
        Case("--train /dev/zero as chat data", plain("--train", "/dev/zero", "--eval",
             os.path.join(ROOT, "data", "chat_tiny_eval.jsonl"), "--output", out),
             ["/dev/zero", "character device"]),
        Case("--lora-r 10^12", plain("--lora-r", "1000000000000", "--output", out), ["r = "]),
        Case("--lr 1e30 (training diverges)", plain("--lr", "1e30", "--output", out),
             ["optimizer step", "NaN"]),
        Case("--seq-len 0", plain("--seq-len", "0", "--output", out), ["--seq-len"]),
        # Outputs: the user's files are never replaced without --overwrite, inputs never.
        Case("--output holds the user's files",
             lambda w: (users_folder(out(w)), (["--model", MODEL, "--train", TRAIN, *QUICK,
                                                "--output", out(w)], [out(w)]))[1],
             ["already holds", "overwrite"]),
        Case("--output holds the user's files, --overwrite",
             lambda w: (users_folder(out(w), sharded=False),
                        (["--model", MODEL, "--train", TRAIN, *QUICK, "--output", out(w),
                          "--overwrite"], [os.path.join(out(w), "notes.txt")]))[1], None,
             check_ok=lambda w: os.path.isfile(os.path.join(out(w), "model.safetensors"))),
        Case("--output is the input folder", lambda w: (
            ["--model", MODEL, "--train", TRAIN, *QUICK, "--output", MODEL, "--overwrite"], []),
            ["input folder"]),
        Case("--merge is the input folder", lambda w: (
            ["--model", MODEL, "--train", TRAIN, *QUICK, "--lora-r", "4", "--output", out(w),
             "--merge", MODEL, "--overwrite"], []), ["input folder"]),
        Case("--merge is --output", lambda w: (
            ["--model", MODEL, "--train", TRAIN, *QUICK, "--lora-r", "4", "--output", out(w),
             "--merge", out(w)], []), ["--merge"]),
        Case("--probe OUT/model.safetensors", lambda w: (
            ["--model", MODEL, "--train", TRAIN, *QUICK, "--output", out(w), "--probe",
             os.path.join(out(w), "model.safetensors")], []), ["--probe", "inside"]),
        Case("--probe an existing file", lambda w: (
            open(os.path.join(w, "probe"), "w").write("mine"),
            (["--model", MODEL, "--train", TRAIN, *QUICK, "--output", out(w), "--probe",
              os.path.join(w, "probe")], [os.path.join(w, "probe")]))[1], ["--probe", "exists"]),
        Case("--output is a file", lambda w: (
            open(out(w), "w").write("mine"),
            (["--model", MODEL, "--train", TRAIN, *QUICK, "--output", out(w)], [out(w)]))[1],
            ["not a folder"]),
        Case("--output is a dangling link", lambda w: (
            os.symlink(os.path.join(w, "nowhere"), out(w)),
            (["--model", MODEL, "--train", TRAIN, *QUICK, "--output", out(w)], []))[1],
            ["leads nowhere"]),
        Case("--output under a file", lambda w: (
            open(os.path.join(w, "f"), "w").write("mine"),
            (["--model", MODEL, "--train", TRAIN, *QUICK, "--output",
              os.path.join(w, "f", "out")], [os.path.join(w, "f")]))[1], ["cannot be created"]),
        # Adapters (--adapter).
        Case("--adapter r = 0", lambda w: (["--model", MODEL, "--train", TRAIN, *QUICK,
                                            "--adapter", adapter_folder(w, r=0),
                                            "--output", out(w)], []), ["adapter_config.json", "`r`"]),
        Case("--adapter r = 10^12", lambda w: (["--model", MODEL, "--train", TRAIN, *QUICK,
                                                "--adapter", adapter_folder(w, r=10 ** 12),
                                                "--output", out(w)], []), ["r = "]),
        Case("--adapter targets nothing", lambda w: (
            ["--model", MODEL, "--train", TRAIN, *QUICK, "--adapter",
             adapter_folder(w, target_modules=["no_such_proj"]), "--output", out(w)], []),
            ["matches none"]),
        Case("--adapter target_modules is a 1 MiB object", lambda w: (
            ["--model", MODEL, "--train", TRAIN, *QUICK, "--adapter",
             adapter_folder(w, target_modules={"q" * (1 << 20): 1}), "--output", out(w)], []),
            ["adapter_config.json", "target_modules", "bytes left out"]),
        Case("--adapter tensor of the wrong shape", lambda w: (
            ["--model", MODEL, "--train", TRAIN, *QUICK, "--adapter",
             adapter_folder(w, _tensor_shape=True), "--output", out(w)], []), ["shape"]),
        Case("--adapter a sound adapter (continued)", lambda w: (
            ["--model", MODEL, "--train", TRAIN, *QUICK, "--adapter", adapter_folder(w),
             "--output", out(w)], []), None,
            check_ok=lambda w: os.path.isfile(os.path.join(out(w), "adapter_model.safetensors"))),
        # estimate-memory.
        Case("estimate: num_hidden_layers 10^8", est(cfg(num_hidden_layers=10 ** 8)),
             ["num_hidden_layers"], program="cli"),
        Case("estimate: sizes near 2^32",
             est(cfg(hidden_size=(1 << 32) - 1, intermediate_size=(1 << 32) - 1,
                     vocab_size=(1 << 32) - 1, head_dim=None)), ["vocab_size", "largest size accepted"],
             program="cli"),
        Case("estimate: --seq-len and --batch-size 2^64-1",
             est(lambda m: None, "--seq-len", str(2 ** 64 - 1), "--batch-size", str(2 ** 64 - 1)),
             ["at most"], program="cli"),
        Case("estimate: --lora-r 10^12", est(lambda m: None, "--lora-r", "1000000000000"),
             ["lora rank"], program="cli"),
        Case("estimate: weights -> /etc/passwd",
             est(lambda m: link(weights(m), "/etc/passwd")), ["not a safetensors file"],
             program="cli"),
        Case("estimate: config.json is a FIFO", est(lambda m: fifo(cfg_file(m))), ["FIFO"],
             program="cli"),
        # The launcher: both ranks end, neither hangs.
        Case("launch -n 2: config.json is a FIFO", lambda w: (
            ["launch", "--cpu", "-n", "2", FINETUNE, "--model",
             (lambda m: (fifo(cfg_file(m)), m)[1])(copy_model(w)), "--train", TRAIN,
             "--output", out(w), *QUICK], []), ["FIFO"], program="cli"),
    ]
    return c


def verdict(case: Case, code, text: str, changed: list[str], work: str) -> str:
    if code is None:
        return "HANG"
    if code < 0 or code in (134, 137, 139) or "panicked" in text or "memory allocation of" in text:
        return "ABORT"
    if changed:
        return "LOST-FILE"
    if case.expect is None:
        if code != 0:
            return "WRONG"
        if "NaN" in text or " nan" in text.lower().replace("nan and", ""):
            return "SILENT-NAN"
        if case.check_ok and not case.check_ok(work):
            return "WRONG"
        return "ok"
    if code == 0:
        return "SILENT-NAN" if "nan" in text.lower() else "WRONG"
    if len(text.encode()) > 64 << 10:
        return "FLOOD"
    missing = [s for s in case.expect if s not in text]
    return "WRONG" if missing else "ok"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--keep", default=None)
    args = ap.parse_args()
    if not args.no_build:
        for cmd in (["cargo", "build", "--release", "-p", "accelerate-rs-models", "--example",
                     "finetune"], ["cargo", "build", "--release", "-p", "accelerate-rs-cli"]):
            subprocess.run(cmd, cwd=ROOT, check=True)
    root = args.keep or tempfile.mkdtemp(prefix="bad-folders-")
    os.makedirs(root, exist_ok=True)
    before_model = digest(MODEL)
    counts: dict[str, int] = {}
    rows = []
    try:
        for i, case in enumerate(cases()):
            if args.only and args.only not in case.name:
                continue
            work = os.path.join(root, f"case{i:02d}")
            os.makedirs(work)
            cmd_args, protect = case.setup(work)
            guarded = {p: digest(p) for p in protect}
            program = LAUNCHER if case.program == "cli" else FINETUNE
            code, text, secs = run([program, *cmd_args], cwd=work, env=case.env)
            changed = [p for p, d in guarded.items() if digest(p) != d]
            if digest(MODEL) != before_model:
                changed.append(MODEL)
            v = verdict(case, code, text, changed, work)
            counts[v] = counts.get(v, 0) + 1
            lines = [ln for ln in text.strip().splitlines() if ln.strip()]
            errors = [ln for ln in lines if "rror" in ln]
            said = ((errors or lines or [""])[-1]).replace("|", "/")[:160]
            rows.append((case.name, v, code, secs, said))
            print(f"| {case.name} | {v} | {code} | {secs:.1f} s | {said} |", flush=True)
            if v != "ok":
                print(text[-3000:], file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    total = sum(counts.values())
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"\nbad_folders: {total} cases: {summary}")
    bad = total - counts.get("ok", 0)
    for name in ("ABORT", "HANG", "SILENT-NAN", "LOST-FILE", "FLOOD", "WRONG"):
        print(f"  {name}: {counts.get(name, 0)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Golden files for accelerate-rs-models' chat datasets (`models/src/chat`), from `transformers`.

Needs `pip install transformers tokenizers` (PyPI; no network at run time: the templates are
written out below, the tokenizer is the repository's tiny one). Not run by CI: its outputs are
committed, and `cargo test -p accelerate-rs-models --test chat` checks against them without
Python.

    python scripts/chat_reference.py [--out models/tests/fixtures]

Writes, for each chat template family, a small model folder `chat_<family>/` holding:

- `tokenizer.json`: the tiny byte-level BPE tokenizer of `models/examples/tiny-llama` with the
  family's special tokens added (the real tokenizers are large and not needed: the template and
  the special tokens are what is under test);
- the template, the way such folders store it: `chat_template.jinja` (as `transformers` 5
  saves it; Llama 3 and the marked template), the `chat_template` key of
  `tokenizer_config.json` as a string (Qwen2) or as the list of named templates (Mistral, with
  its `bos_token`/`eos_token` as AddedToken dicts);
- `conversations.jsonl`: the rows (system prompt, multi-turn, tool calls and tool results where
  the template supports them, prompt/completion pairs as strings and as message lists);
- `golden.json`: for each row, the text `apply_chat_template` renders, its token ids
  (`apply_chat_template(..., tokenize=True)`), the assistant mask, and the prompt of the
  conversation without its last assistant turn rendered with `add_generation_prompt=True` and
  its token ids.

The templates are the public chat templates of Llama 3.1 Instruct, Qwen2.5 Instruct and Mistral
7B Instruct v0.3 (written from their published structure; `transformers` renders the same text
that the folder holds, so the comparison is exact either way), and a ChatML template with
`{% generation %}` marks, and one (`chat_features`) using what templates use of Jinja2 and
Python beyond those (loop controls, namespaces, string methods, `tojson`'s options, printing
Python values, reasoning fields), also marked.

The assistant mask: for a template with `{% generation %}` marks, `transformers`'
`return_assistant_tokens_mask=True` (and the prefix method's mask beside it, as
`prefix_mask`). For the others, the prefix method that the Rust crate
documents, done here with `transformers`' rendering and offsets: for each assistant message `i`,
`P = render(messages[:i], add_generation_prompt=True)` and `Q = render(messages[:i+1])`; when
`P` is a prefix of `Q` and `Q` of the whole rendering, the characters `len(P)..len(Q)` are the
assistant's, and a token is masked when its offsets overlap such a span (the rule
`transformers` applies to `{% generation %}` spans). A row where the prefixes disagree (Mistral
v0.3 moves the system prompt into the last user turn) gets `"assistant_mask": null` and
`"error": "inconsistent"`. The marked template leaves the line break after `<|im_end|>` out of
its marks, where the prefix method counts it as the assistant's: the two masks differ there.

Rows are turned into messages as the Rust crate does: `messages` as given; `prompt`/`completion`
strings as a user turn and an assistant turn; `prompt`/`completion` message lists concatenated.
"""

import argparse
import json
import os
import re
import shutil

from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "examples", "tiny-llama", "tokenizer.json")

LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN2 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

MISTRAL = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# ChatML with `{% generation %}` marks around what the assistant writes, laid out with plain
# (undashed) block tags so that trim_blocks and lstrip_blocks shape the output.
MARKED = r"""{% for message in messages %}
    {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}
{{ message['content'] | trim }}<|im_end|>
{%- endgeneration %}

    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# What templates use of Jinja2 and Python beyond the families above: loop controls, namespace,
# Python string methods, tojson's options, printing None/True/floats, `string` of a list,
# `selectattr`, the reasoning aliases; `{% generation %}` marks for the mask.
FEATURES = r"""{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- set ns.count = ns.count + 1 %}
    {%- if message.role == 'system' %}
        {{- '[SYS]' + message.content.strip() + '\n' }}
        {%- continue %}
    {%- endif %}
    {%- if loop.index0 > 6 %}
        {%- break %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.role == 'assistant' %}
        {%- generation %}
            {%- if message.thinking is defined %}
                {{- '<think>' + message.thinking + '</think>' + message.reasoning_content|length|string }}
            {%- endif %}
            {%- if message.tool_calls is defined %}
                {{- message.tool_calls|tojson(indent=2) }}
                {{- message.tool_calls[0].function.arguments|tojson(sort_keys=true, separators=(',', ':')) }}
            {%- endif %}
            {%- if message.content is defined %}
                {{- message.content.strip().replace('  ', ' ') }}
            {%- endif %}
            {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- message.content.strip() }}
        {%- if message.content.startswith('Q:') %}
            {{- ' ' ~ [1, 2.5, none, true, 'x', {'k': 1e-05}]|string }}{{ none }}{{ true }}{{ 1.0 }}
            {{- ' ' + message.content.split(':')[1].upper()|trim }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{{- 'turns=' ~ ns.count ~ ' users=' ~ (messages|selectattr('role', 'equalto', 'user')|list|length) }}
{%- if add_generation_prompt %}
    {{- '\n<|im_start|>assistant\n' }}
{%- endif %}
"""


def tool_call(name, arguments, call_id=None):
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        call["id"] = call_id
    return call


def rows_common():
    return [
        {"messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
            {"role": "assistant", "content": "Rome, of course."},
        ]},
        {"messages": [
            {"role": "user", "content": "  Say hi in French, with accents: é à ü. \n"},
            {"role": "assistant", "content": " Salut, ça va ? 👋\nÀ bientôt. "},
        ]},
        {"prompt": "Add 2 and 3.", "completion": "2 + 3 = 5."},
    ]


LLAMA3_ROWS = rows_common() + [
    {"prompt": [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Sky colour?"}],
     "completion": [{"role": "assistant", "content": "Blue"}]},
    {"messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            tool_call("get_weather", {"city": "Paris", "unit": "celsius"})]},
        {"role": "tool", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "It is 21 °C and clear."},
    ]},
]

QWEN2_ROWS = rows_common() + [
    {"prompt": [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Sky colour?"}],
     "completion": [{"role": "assistant", "content": "Blue"}]},
    {"messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            tool_call("get_weather", {"city": "Paris"}),
            tool_call("get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": "{\"temperature\": 21}"},
        {"role": "tool", "content": "{\"temperature\": 25}"},
        {"role": "assistant", "content": "Paris 21, Rome 25."},
    ]},
]

MISTRAL_ROWS = [
    {"messages": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": " Rome, of course. "},
    ]},
    {"prompt": "Add 2 and 3.", "completion": "2 + 3 = 5."},
    {"prompt": [{"role": "user", "content": "Sky colour?"}],
     "completion": [{"role": "assistant", "content": "Blue"}]},
    {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            tool_call("get_weather", {"city": "Paris", "unit": "celsius"}, call_id="abc123xyz")]},
        {"role": "tool", "tool_call_id": "abc123xyz", "content": "{\"temperature\": 21}"},
        {"role": "assistant", "content": "It is 21 °C."},
    ]},
    # The system prompt goes into the last user turn only: the prefixes disagree.
    {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
    ]},
]

MARKED_ROWS = rows_common() + [
    {"messages": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "one two three"},
        {"role": "user", "content": "Backwards?"},
        {"role": "assistant", "content": "three two one"},
    ]},
]

FEATURES_ROWS = [
    {"messages": [
        {"role": "system", "content": "  Be kind.  "},
        {"role": "user", "content": "Q:  what  now?  "},
        {"role": "assistant", "reasoning_content": "hmm, think", "content": "  A.  "},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "B  b."},
    ]},
    {"messages": [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": None, "tool_calls": [
            tool_call("f", {"b": 1, "a": [1, 2.5, "é"]})]},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "thinking": "t", "content": "done"},
    ]},
    {"messages": [m for i in range(5) for m in (
        {"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"})]},
]

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
QWEN2_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MISTRAL_TOKENS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


def added(content):
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}


FAMILIES = {
    "llama3": {
        "template": LLAMA3, "store": "jinja", "special": LLAMA3_TOKENS, "plain": [],
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "rows": LLAMA3_ROWS,
    },
    "qwen2": {
        "template": QWEN2, "store": "string", "special": QWEN2_TOKENS, "plain": QWEN2_PLAIN,
        "config": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "rows": QWEN2_ROWS,
    },
    "mistral": {
        "template": MISTRAL, "store": "list", "special": MISTRAL_TOKENS, "plain": [],
        "config": {"bos_token": added("<s>"), "eos_token": added("</s>"), "unk_token": None},
        "rows": MISTRAL_ROWS,
    },
    "marked": {
        "template": MARKED, "store": "jinja", "special": QWEN2_TOKENS, "plain": [],
        "config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "rows": MARKED_ROWS,
    },
    "features": {
        "template": FEATURES, "store": "jinja", "special": QWEN2_TOKENS, "plain": [],
        "config": {"eos_token": "<|im_end|>"},
        "rows": FEATURES_ROWS,
    },
}


def to_messages(row):
    if "messages" in row:
        return row["messages"]
    if isinstance(row["prompt"], str):
        return [{"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]}]
    return row["prompt"] + row["completion"]


def overlap_mask(offsets, spans):
    """transformers' rule for `{% generation %}` spans: a token is masked when its offsets
    overlap a span."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def prefix_spans(tok, messages, text):
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        p = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        q = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (q.startswith(p) and text.startswith(q)):
            return None
        spans.append((len(p), len(q)))
    return spans


def make_folder(name, family, out):
    folder = os.path.join(out, f"chat_{name}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    tok = Tokenizer.from_file(TINY)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in family["special"]])
    if family["plain"]:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in family["plain"]])
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend",
              "model_max_length": 4096, **family["config"]}
    if family["store"] == "string":
        config["chat_template"] = family["template"]
    elif family["store"] == "list":
        config["chat_template"] = [
            {"name": "default", "template": family["template"]},
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        ]
    else:
        with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
            f.write(family["template"])
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return folder


def golden_case(tok, row, marked):
    messages = to_messages(row)
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=marked)
    text = tok.apply_chat_template(messages, tokenize=False)
    ids = list(out["input_ids"])
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == ids, "tokenize=True differs from tokenizing the text"
    spans = prefix_spans(tok, messages, text)
    prefix_mask = None if spans is None else overlap_mask(enc["offset_mapping"], spans)
    mask = list(out["assistant_masks"]) if marked else prefix_mask
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = tok.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
    prompt_ids = list(tok.apply_chat_template(messages[:last], tokenize=True, return_dict=True,
                                              add_generation_prompt=True)["input_ids"])
    return {
        "text": text,
        "input_ids": ids,
        "assistant_mask": mask,
        "prefix_mask": prefix_mask,
        "error": None if mask is not None else "inconsistent",
        "prompt_text": prompt,
        "prompt_ids": prompt_ids,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tests/fixtures")
    args = ap.parse_args()
    for name, family in FAMILIES.items():
        folder = make_folder(name, family, args.out)
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok.chat_template is not None, f"{folder}: transformers found no template"
        with open(os.path.join(folder, "conversations.jsonl"), "w") as f:
            for row in family["rows"]:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        marked = re.search(r"\{%-?\s*generation\s*-?%\}", family["template"]) is not None
        cases = [golden_case(tok, row, marked)
                 for row in family["rows"]]
        special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
        with open(os.path.join(folder, "golden.json"), "w") as f:
            f.write('{"special_tokens": ' + json.dumps(special, ensure_ascii=False) + ',\n"cases": [\n')
            f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
            f.write("\n]}\n")
        size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
        print(f"{folder}: {len(cases)} conversations, {size / 1024:.0f} KiB, special {special}")


if __name__ == "__main__":
    main()

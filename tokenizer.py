"""
Kimi K2.6 tokenizer: tiktoken BPE + Kimi special tokens + the checkpoint's own chat template + streaming decode.

Loads a Kimi-style checkpoint directory:
    tiktoken.model          one `base64(token_bytes) rank` per line; ranks 0..N-1 are the BPE vocab
    tokenizer_config.json   `added_tokens_decoder` names the special ids N, N+1, ...; optional `chat_template`
    chat_template.jinja     (optional) the chat template; wins over tokenizer_config.json's `chat_template`
    generation_config.json  (optional) `eos_token_id`: extra stop ids
This is the construction of Moonshot's `tokenization_kimi.py`, rebuilt on `tiktoken.Encoding` so that
we need no remote code (HF's AutoTokenizer gets the special ids wrong for Kimi). Chats are rendered from the
checkpoint's Jinja template with the settings transformers, vLLM and SGLang use, so a prompt is what the
model's users expect; the K2.6 format itself lives in that file, not here (KIMI_CHAT_TEMPLATE is what our
writers put into the bundled checkpoint).

Invariants:
* ids 0..N-1 are the BPE ranks from the file, N = num_base_tokens = line count (163584 for K2.6),
  counted and never hard-coded; ids N..N+255 are special, unnamed ones are `<|reserved_token_{id}|>`.
* apply_chat_template(...) renders exactly the string transformers renders from the same template, and
  only the template's own markup becomes special ids: a special-token string inside a message, tool or
  template argument is encoded as plain text; markup the template writes that the tokenizer lacks is an error.
* A render is bounded (time, output, work: MAX_RENDER_S etc.): any failure is one ValueError naming the
  template's file and line.
* StreamDecoder: "".join(push(...) for each chunk) + flush() == decode(all ids), and push never returns
  a half-finished UTF-8 character.

Run:  python tokenizer.py /path/to/Kimi-K2.6 "你好, world"      (prints ids, pieces and a chat prompt)
Test: python -m pytest -q tests/test_tokenizer.py tests/test_faults.py
"""
from __future__ import annotations

import base64
import binascii
import codecs
import contextlib
import contextvars
import functools
import json
import re
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Iterable

import jinja2
import jinja2.ext
import jinja2.sandbox
import tiktoken

from files import read_json, regular_file, write_text

# The K2 pre-tokenizer regex, byte-identical to `pat_str` in every tokenization_kimi.py .
# It is o200k's pattern plus a leading Han arm. `&&[^\p{Han}]` is character-class *intersection*: the
# two letter arms exclude Han, so a Han run is always its own piece and no token can span Han and Latin.
# tiktoken's Rust regex engine supports `&&`; Python's `re` does not (the `regex` module does, with V1).
PAT = "|".join([
    r"""[\p{Han}]+""",                                                      # runs of CJK ideographs
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # Word, word, word's
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # WORD, WORDs
    r"""\p{N}{1,3}""",                                                      # numbers in groups of <= 3 digits
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",                                       # punctuation runs
    r"""\s*[\r\n]+""",                                                      # newlines (with leading spaces)
    r"""\s+(?!\S)""",                                                       # trailing spaces, leave one for the next word
    r"""\s+""",
])

NUM_RESERVED_SPECIAL_TOKENS = 256  # K2.5/K2.6 build exactly 256 special ids (K2 built 258), n_vocab = N + 256
MAX_FILE_BYTES = 1 << 28           # a tokenizer_config.json or chat template, read whole
MAX_SPECIAL_TOKENS = 65536         # special ids lie in [N, N + this): each id up to the last named one is built
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Kimi's encode() feeds tiktoken at most 400k chars at a time and cuts runs of > 25k whitespace or
# non-whitespace chars, because tiktoken's regex matching goes quadratic on such runs (tiktoken #195).
# Identical results on any normal text; we copy it so pathological inputs tokenize like the reference.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# Offsets from num_base_tokens of the named K2.6 special tokens (ids = 163584 + offset for K2.6).
_KIMI_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
# K2.6's config marks the tool-call markers and <think> / </think> "special": false (HF's decode keeps them
# under skip_special_tokens). They are still tiktoken special tokens: one id each, whatever this flag says.
_NOT_SPECIAL = {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"}


def KIMI_SPECIAL_TOKENS(num_base: int) -> dict[int, str]:
    """The named K2.6 special tokens at their absolute ids, for a BPE vocab of num_base tokens."""
    return {num_base + off: name for off, name in _KIMI_SPECIAL_OFFSETS.items()}

# -----------------------------------------------------------------------------
# file formats: readers with errors that name file, line and field; writers for tests and the trainer

def is_id(text: str | bytes) -> bool:
    """An id (a rank, a token id) as the tokenizer files spell it: ASCII digits only, at most 18 of them. int()
    alone would also take '-1', '1_0', '+3' and '²' ('²'.isdigit() is true, int('²') an error), and refuses a
    5000-digit string with a message that names no file."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def load_tiktoken_model(path: str | Path) -> dict[bytes, int]:
    """Parse tiktoken.model ourselves (not tiktoken.load) so every error names the file and line."""
    path = Path(path)
    if not regular_file(path):
        raise FileNotFoundError(f"tokenizer vocab not found: {path}")
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            fields = line.split()
            if not fields:
                continue  # tiktoken's own loader skips blank lines too
            where = f"{path}, line {lineno}"
            if len(fields) != 2:
                raise ValueError(f"{where}: expected 'base64(token_bytes) rank', got {line[:80]!r}")
            try:
                token = base64.b64decode(fields[0], validate=True)
            except binascii.Error as e:
                raise ValueError(f"{where}: bad base64 {fields[0][:80]!r} ({e})") from None
            if not is_id(fields[1]):
                raise ValueError(f"{where}: rank {fields[1][:80]!r} is not a non-negative integer")
            rank = int(fields[1])
            if not token:
                raise ValueError(f"{where}: empty token")
            if rank in line_of_rank:
                raise ValueError(f"{where}: duplicate rank {rank} (first on line {line_of_rank[rank]})")
            if token in ranks:
                raise ValueError(f"{where}: duplicate token {token!r} (first on line {line_of_rank[ranks[token]]})")
            ranks[token] = rank
            line_of_rank[rank] = lineno
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    if max(line_of_rank) != len(ranks) - 1:  # ranks are unique, so this is the contiguity check
        missing = min(set(range(len(ranks))) - line_of_rank.keys())
        top = max(line_of_rank)
        raise ValueError(f"{path}, line {line_of_rank[top]}: ranks must be 0..{len(ranks) - 1} without gaps, "
                         f"but rank {missing} is missing and this line has rank {top}")
    # byte-level BPE: any text must encode, so every single byte is a token (tiktoken panics on one that is not)
    if absent := [b for b in range(256) if bytes([b]) not in ranks]:
        raise ValueError(f"{path}: no token for the single byte {absent[0]:#04x} ({len(absent)} of the 256 bytes "
                         f"missing): expected every byte as a token of its own")
    return ranks


def load_special_names(path: str | Path, num_base: int) -> dict[int, str]:
    """id -> name of every entry in tokenizer_config.json's `added_tokens_decoder`."""
    path = Path(path)
    if not regular_file(path):
        raise FileNotFoundError(f"tokenizer config not found: {path}")
    decoder = read_json(path).get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}: field 'added_tokens_decoder' is missing or not an object")
    names: dict[int, str] = {}
    for key, entry in decoder.items():
        field = f"added_tokens_decoder[{key if len(key) <= 24 else key[:21] + '...'!r}]"    # a key may be huge
        if not is_id(key):
            raise ValueError(f"{path}: field {field}: key is not a token id")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
            raise ValueError(f"{path}: field {field}.content is missing or not a non-empty string")
        if int(key) < num_base:  # would shadow a BPE rank
            raise ValueError(f"{path}: field {field}: id {key} is below num_base_tokens={num_base}")
        if int(key) >= num_base + MAX_SPECIAL_TOKENS:   # every id up to it gets a name: bounded
            raise ValueError(f"{path}: field {field}: id {key} is past num_base_tokens + {MAX_SPECIAL_TOKENS} "
                             f"= {num_base + MAX_SPECIAL_TOKENS}")
        if entry["content"] in names.values():
            raise ValueError(f"{path}: field {field}: name {entry['content']!r} is used twice")
        names[int(key)] = entry["content"]
    return names


def load_template_tokens(path: str | Path) -> dict[str, str]:
    """bos_token / eos_token / unk_token / pad_token from tokenizer_config.json (a name or {"content": name}).
    transformers passes these to every chat template, so we do too."""
    cfg, tokens = read_json(Path(path)), {}
    for field in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = cfg.get(field)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[field] = value
    return tokens


def load_eos_ids(path: str | Path) -> set[int]:
    """`eos_token_id` (int or list) from an optional generation_config.json; empty set if absent."""
    path = Path(path)
    if not regular_file(path):
        return set()
    eos = read_json(path).get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(type(i) is int and i >= 0 for i in eos):  # type(): bool is an int
        raise ValueError(f"{path}: field 'eos_token_id' must be an id or a list of ids, got {eos!r}")
    return set(eos)


# The K2.6 chat format as our writers ship it (checkpoints/tiny-k2/chat_template.jinja is this text; train.py writes
# it). Rendering never reads this constant: it reads the checkpoint's own template, like every other engine.
KIMI_CHAT_TEMPLATE = r'''{#- The Kimi K2.6 chat format.
    A turn: <|im_user|>, <|im_assistant|> or <|im_system|> (every other role), the message's name (else its role),
    <|im_middle|>, the content, <|im_end|>. Besides messages, tools and add_generation_prompt it reads:
      thinking           unset or true: the reply opens with <think>; false: it starts after <think></think>
      preserve_thinking  true: every assistant turn keeps its reasoning_content; unset or false: only the turns
                         after the last final answer (an assistant turn without tool_calls) keep it -#}
{%- macro text_of(message) -%}
  {%- set content = message.get('content') -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is not none -%}
    {%- for part in content -%}
      {%- if part.get('type', 'text') != 'text' -%}
        {{- raise_exception("a '" ~ part.get('type') ~ "' part: this model reads text only") -}}
      {%- endif -%}
      {{- part['text'] -}}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}

{%- macro open_turn(message) -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>
  {%- else -%}
    <|im_system|>
  {%- endif -%}
  {{- message.get('name') or message['role'] -}}
  <|im_middle|>
{%- endmacro -%}

{%- macro tool_calls(message) -%}
  <|tool_calls_section_begin|>
  {%- for call in message['tool_calls'] -%}
    {%- set arguments = call['function']['arguments'] -%}
    <|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
    {{- arguments if arguments is string else arguments | tojson -}}
    <|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}

{#- assistant turns up to the last final answer are history: their reasoning is dropped -#}
{%- set last = namespace(answer=-1) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}
    {%- set last.answer = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}

{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}

{%- for message in messages -%}
  {{- open_turn(message) -}}
  {%- if message['role'] == 'assistant' -%}
    {%- if preserve_thinking is true or loop.index0 > last.answer -%}
      <think>{{ message.get('reasoning_content') or '' }}</think>
    {%- else -%}
      <think></think>
    {%- endif -%}
    {{- text_of(message) -}}
    {%- if message.get('tool_calls') -%}
      {{- tool_calls(message) -}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {{- '## Return of ' ~ message.get('tool_call_id', '') ~ '\n' ~ text_of(message) -}}
  {%- else -%}
    {{- text_of(message) -}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is false -%}
    <think></think>
  {%- else -%}
    <think>
  {%- endif -%}
{%- endif -%}
'''


def load_chat_template(directory: str | Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's `chat_template` (a string, or HF's list of named
    templates: the one named "default"), else None."""
    directory = Path(directory)
    if regular_file(directory / CHAT_TEMPLATE_FILE):
        if (directory / CHAT_TEMPLATE_FILE).stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"{directory / CHAT_TEMPLATE_FILE}: more than {MAX_FILE_BYTES >> 20} MiB")
        try:
            return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{directory / CHAT_TEMPLATE_FILE}: not UTF-8 text ({e.reason} at byte {e.start})") \
                from None
    path = directory / "tokenizer_config.json"
    template = read_json(path).get("chat_template") if regular_file(path) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: field 'chat_template' must be a string or a list of "
                         f"{{'name', 'template'}} with a 'default' one")
    return template


def write_tiktoken_model(path: str | Path, ranks: dict[bytes, int]) -> None:
    write_text(path, "".join(f"{base64.b64encode(token).decode('ascii')} {rank}\n"
                             for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])))


def write_tokenizer_config(path: str | Path, special: dict[int, str]) -> None:
    entry = lambda name: {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": name not in _NOT_SPECIAL}
    cfg = {"added_tokens_decoder": {str(i): entry(name) for i, name in sorted(special.items())}}
    for field, name in [("bos_token", "[BOS]"), ("eos_token", "[EOS]"), ("unk_token", "[UNK]"), ("pad_token", "[PAD]")]:
        if name in special.values():
            cfg[field] = name
    cfg["tokenizer_class"] = "TikTokenTokenizer"
    write_text(path, json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def write_chat_template(directory: str | Path, template: str = KIMI_CHAT_TEMPLATE) -> None:
    """The chat template file a K2.6 checkpoint ships next to its tokenizer_config.json."""
    write_text(Path(directory, CHAT_TEMPLATE_FILE), template)

# -----------------------------------------------------------------------------

def split_long_runs(text: str, max_run: int = MAX_RUN_CHARS) -> list[str]:
    """Cut every run of > max_run whitespace (or non-whitespace) chars every max_run chars, as Kimi does.
    Kimi walks the string char by char; we let `re` find only the long runs (each anchored at its start,
    so the scan stays linear). Python's \\s and str.isspace() agree, so the cuts are the same."""
    long_run = rf"(?<!\S)\S{{{max_run + 1},}}|(?<!\s)\s{{{max_run + 1},}}"
    cuts = [c for m in re.finditer(long_run, text) for c in range(m.start() + max_run, m.end(), max_run)]
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


# -----------------------------------------------------------------------------
# chat templates, rendered as transformers renders them: a sandbox (the template cannot reach Python internals or
# change its inputs), trim_blocks + lstrip_blocks, {% break %} / {% continue %}, and the same tojson,
# raise_exception and strftime_now.
#
# A template is code that comes with the checkpoint, so a render is also bounded: it must end within
# MAX_RENDER_S seconds, write at most MAX_RENDER_CHARS characters, and make at most MAX_RENDER_WORK characters
# along the way (the strings its operators, calls, filters and joins produce). Each call, filter, operator and
# join checks the clock and counts what it makes; the ones that can make much from little (`'x' * n`,
# `center(n)`, a format width, `replace('', ...)`, `join`) are checked before they run. In the main thread a
# timer (SIGALRM) also stops a loop that calls nothing. Past a bound, the render stops with one error naming the
# template and the bound.

MAX_RENDER_S = 10.0            # seconds
MAX_RENDER_CHARS = 1 << 24     # characters written: 16 Mi (a whole 262144-token K2.6 context is ~1 Mi)
MAX_RENDER_WORK = 1 << 26      # characters made along the way: 64 Mi
MAX_POW_BITS = 1 << 16         # an integer power may have at most this many bits


class RenderLimit(Exception):
    """A render went past one of its bounds (raised inside the template, reported by Tokenizer._render)."""


class _Budget:
    """One render's bounds: its deadline, and the characters it has made so far."""

    def __init__(self, seconds: float, chars: int, work: int):
        self.seconds, self.chars, self.work = seconds, chars, work
        self.deadline, self.made = time.monotonic() + seconds, 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimit(f"rendering took longer than {self.seconds:g} s (the render-time limit)")

    def will_make(self, n: int, what: str) -> None:
        """Refuse, before it runs, an operation that would make a string or list of n characters / items."""
        if n > self.chars:
            raise RenderLimit(f"{what} would make {n} characters, more than the output-size limit of {self.chars}")

    def count(self, value):
        """Count what an operation made (strings by length, containers by their number of items), check the clock."""
        self.tick()
        if isinstance(value, (str, list, tuple, dict)):
            self.made += len(value)
            if self.made > self.work:
                raise RenderLimit(f"the template made more than {self.work} characters along the way (the "
                                  f"render-work limit)")
        return value


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _expanded_size(x, memo=None) -> int:
    """Characters / items x stands for once written out: a list holding the same long string n times counts it
    n times (computed once per distinct object)."""
    memo = {} if memo is None else memo
    if isinstance(x, str):
        return len(x)
    if not isinstance(x, (list, tuple, dict)) or id(x) in memo:
        return memo.get(id(x), 1)
    memo[id(x)] = len(x)                       # a cycle counts once
    items = list(x.items()) if isinstance(x, dict) else x
    memo[id(x)] = len(x) + sum(_expanded_size(i, memo) for i in items)
    return memo[id(x)]


_WIDTH = re.compile(r"%[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?|\{[^{}]*:([^{}]*)\}")


def _format_width(fmt: str, args) -> int:
    """The largest width / precision a %-format or str.format string asks for (a '*' or nested field: the
    largest integer argument)."""
    widths = [0]
    for m in _WIDTH.finditer(fmt):
        spec = " ".join(g for g in m.groups() if g)
        widths += [int(d) for d in re.findall(r"\d+", spec)]
        if "*" in spec or "{" in spec:
            widths += [a for a in args if type(a) is int]
    return max(widths)


def _check_growth(b: _Budget, name: str, value, args) -> None:
    """Before a str method or filter runs: what it would make, where a small argument can make much."""
    if not isinstance(value, str):
        return
    ints = [a for a in args if type(a) is int]
    if name in ("center", "ljust", "rjust", "zfill") and ints:
        b.will_make(max(ints), name)
    elif name == "indent" and ints:
        b.will_make(len(value) + (value.count("\n") + 1) * max(ints), name)
    elif name == "expandtabs":
        b.will_make(len(value) + value.count("\t") * (ints[0] if ints else 8), name)
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        grow = max(0, len(args[1]) - len(args[0]))
        b.will_make(len(value) + value.count(args[0]) * grow, "replace")
    elif name == "join" and isinstance(args[0] if args else None, (str, list, tuple)):   # value.join(items)
        b.will_make(sum(_expanded_size(v) for v in args[0]) + len(value) * len(args[0]), "join")
    elif name in ("format", "format_map"):
        b.will_make(len(value) + _format_width(value, list(args)), "a format width")


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox (immutable: no Python internals, inputs never changed), with every call, filter,
    arithmetic operator and join checked against the render's _Budget (none set: unbounded, as transformers)."""
    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def call_binop(self, context, operator, left, right):
        b = _BUDGET.get()
        if b is not None:
            b.tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if type(n) is int and isinstance(seq, (str, list, tuple)):
                        b.will_make(n * _expanded_size(seq), "'*'")
            elif operator == "**" and type(left) is int and type(right) is int and abs(left) > 1:
                if right * abs(left).bit_length() > MAX_POW_BITS:
                    raise RenderLimit(f"'**' would make an integer of more than {MAX_POW_BITS} bits")
            elif operator == "%" and isinstance(left, str):
                args = right if isinstance(right, tuple) else (right,)
                b.will_make(len(left) + _format_width(left, args), "a format width")
        result = super().call_binop(context, operator, left, right)
        return result if b is None else b.count(result)

    def call(__self, __context, __obj, *args, **kwargs):
        b = _BUDGET.get()
        if b is not None:
            b.tick()
            method = getattr(__obj, "__wrapped__", __obj)        # the sandbox wraps str.format
            _check_growth(b, getattr(method, "__name__", ""), getattr(method, "__self__", None),
                          list(args) + list(kwargs.values()))
        result = super().call(__context, __obj, *args, **kwargs)
        return result if b is None else b.count(result)

    @staticmethod
    def concat(parts):                      # a {% set %} block's or a macro's text
        text = "".join(parts)
        b = _BUDGET.get()
        return text if b is None else b.count(text)


def _bounded_filter(name: str, fn):
    """A filter that checks the render's _Budget around its call (map / select reach filters by name, so each
    item they map goes through this too)."""
    @functools.wraps(fn)                     # keeps jinja's pass_context / pass_environment marks
    def run(*args, **kwargs):
        b = _BUDGET.get()
        if b is not None:
            b.tick()
            values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.Environment,
                                                            jinja2.nodes.EvalContext))] + list(kwargs.values())
            if name == "join" and values:           # items|join(sep) is sep.join(items)
                values = [values[1] if len(values) > 1 and isinstance(values[1], str) else "", values[0]]
            if values:
                _check_growth(b, name, values[0], values[1:])
        result = fn(*args, **kwargs)
        return result if b is None else b.count(result)
    return run


def _bounded_join(join):
    """jinja's str_join / markup_join (the `~` operator), counted."""
    def run(seq):
        b = _BUDGET.get()
        return join(seq) if b is None else b.count(join(seq))
    return run


class _Namespace(jinja2.utils.Namespace):
    """namespace(): each `{% set ns.x = ... %}` checks the clock (a loop may do nothing else)."""

    def __setitem__(self, key, value):
        b = _BUDGET.get()
        if b is not None:
            b.tick()
        super().__setitem__(key, value)


@contextlib.contextmanager
def _alarm(seconds: float):
    """In the main thread, RenderLimit raised in whatever Python code runs `seconds` from now (a loop that calls
    nothing too). Off the main thread there are no signals: the checks in the sandbox's hooks alone."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def ring(signum, frame):
        raise RenderLimit(f"rendering took longer than {seconds:g} s (the render-time limit)")
    t0, old = time.monotonic(), signal.signal(signal.SIGALRM, ring)
    earlier, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if earlier:               # someone else's timer (a test runner's): resumed with what it had left
            signal.setitimer(signal.ITIMER_REAL, max(earlier - (time.monotonic() - t0), 1e-3))


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # not jinja's own tojson, which HTML-escapes <, >, & and ' (a template's `tools | tojson` would change)
    if type(indent) is int and indent > 64:      # each nested line repeats it: a bound on what tojson makes
        raise RenderLimit(f"tojson indent={indent}: at most 64")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    # optimized=False: jinja's optimizer would run constant filters (`'%9999999999s' | format(1)`) while
    # compiling, outside every bound; unoptimized, they run in the render, where the bounds hold
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], optimized=False)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=_Namespace)
    template = env.from_string(source)
    names = template.root_render_func.__globals__    # the compiled module's: `~` calls its str_join
    for join in ("str_join", "markup_join"):
        if join in names:
            names[join] = _bounded_join(names[join])
    return template


def render_bounded(source: str, variables: dict, seconds: float = MAX_RENDER_S, chars: int = MAX_RENDER_CHARS,
                   work: int = MAX_RENDER_WORK) -> str:
    """The template `source` compiled and rendered with `variables` within the bounds (RenderLimit past one),
    written piece by piece so that the output-size limit stops a long render as soon as it is passed."""
    if len(source) > chars:
        raise RenderLimit(f"the template is {len(source)} characters long, more than the output-size limit")
    budget = _Budget(seconds, chars, work)
    token = _BUDGET.set(budget)
    parts, n = [], 0
    try:
        with _alarm(seconds):
            for part in compile_chat_template(source).generate(**variables):
                n += len(part)
                if n > chars:
                    raise RenderLimit(f"the rendered text is longer than {chars} characters (the output-size "
                                      f"limit)")
                budget.tick()
                parts.append(part)
    finally:
        _BUDGET.reset(token)
    return "".join(parts)


def _template_line(tb) -> int | None:
    """The template line a runtime error came from: jinja maps its frames to the template's lines."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def chat_messages(messages) -> list[dict]:
    """messages as a template gets them, checked. Content: a str, or a list of text parts (joined here, so that
    no two strings from a message can meet in the render and spell a special token). As transformers does: keys
    set to None are dropped, and `reasoning` / `thinking` are copied to reasoning_content."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages: expected a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {messages!r:.100}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}]: expected a dict with a str 'role', got {m!r:.100}")
        m = {k: v for k, v in m.items() if v is not None}
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}]: a {kind!r} part, but this engine reads text only "
                                     f"(parts must be {{'type': 'text', 'text': str}})")
            m["content"] = "".join(part["text"] for part in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a str or a list of text parts, "
                             f"got {type(content).__name__}")
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# Before a render that will be tokenized, every special-token string inside the caller's strings is wrapped in two
# private-use characters, so the render shows which special-token strings the template wrote (-> ids) and which
# came from a message (-> plain text). A marker character in the input is wrapped too, so no input forges a span.
_OPEN, _CLOSE = "\ue000", "\ue001"
# Chat markup: what a template writes to mean a special token (<|im_end|>, [BOS], <think>). Markup the template
# writes must be a special token of the tokenizer: one it does not define would be encoded as plain text.
_MARKUP = "|".join([r"<\|[^|<>\s]{1,64}\|>"] + [re.escape(n) for n in _KIMI_SPECIAL_OFFSETS.values()
                                                 if not n.startswith("<|")])


class Tokenizer:
    """tiktoken.Encoding over the Kimi vocab, special ids and chat template. Build with from_dir()."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_names: dict[int, str],
                 eos_ids: Iterable[int] = (), name: str = "kimi", chat_template: str | None = None,
                 template_tokens: dict[str, str] | None = None, source: str = "this tokenizer",
                 template_file: str | None = None, eos_file: str = "eos_ids"):
        self.num_base_tokens = len(mergeable_ranks)
        n = self.num_base_tokens
        # every named id, plus reserved names for the gaps in n..n+255 (more if a name sits beyond that)
        n_special = max([NUM_RESERVED_SPECIAL_TOKENS] + [i - n + 1 for i in special_names])
        self.special_tokens = {special_names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + n_special)}
        if len(self.special_tokens) != n_special:
            raise ValueError("a special-token name collides with a reserved name <|reserved_token_{id}|>")
        self.enc = tiktoken.Encoding(name, pat_str=PAT, mergeable_ranks=mergeable_ranks,
                                     special_tokens=self.special_tokens)
        # stop on end-of-turn and on [EOS], plus whatever generation_config says
        self.stop_ids = {self.special_tokens[s] for s in ("<|im_end|>", "[EOS]") if s in self.special_tokens}
        self.stop_ids |= set(eos_ids)
        if bad := sorted(i for i in self.stop_ids if i >= self.vocab_size):
            raise ValueError(f"{eos_file}: field eos_token_id: ids {bad} are outside the vocabulary: expected ids in "
                             f"[0, {self.vocab_size})")
        self.chat_template = chat_template              # Jinja source; settable, compiled on first use
        self.template_tokens = dict(template_tokens or {})
        self.source = source
        self._template_file = (template_file, chat_template)   # where the template was read from
        # a render's bounds (see MAX_RENDER_S): settable
        self.render_seconds, self.render_chars, self.render_work = MAX_RENDER_S, MAX_RENDER_CHARS, MAX_RENDER_WORK
        names = "|".join(map(re.escape, sorted(self.special_tokens, key=len, reverse=True)))  # longest first
        self._special_re = re.compile(f"({names})")                               # split() keeps the names
        self._markup_re = re.compile(_MARKUP)
        self._typed_re = re.compile(f"{names}|{_MARKUP}|[{_OPEN}{_CLOSE}]")         # what _mark wraps
        self._marked_re = re.compile(f"{_OPEN}({names}|{_MARKUP}|[{_OPEN}{_CLOSE}]){_CLOSE}")  # a wrapped span

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        ranks = load_tiktoken_model(path / "tiktoken.model")
        special = load_special_names(path / "tokenizer_config.json", num_base=len(ranks))
        template_file = (path / CHAT_TEMPLATE_FILE if (path / CHAT_TEMPLATE_FILE).is_file()
                         else f"{path / 'tokenizer_config.json'} (field chat_template)")
        return cls(ranks, special, load_eos_ids(path / "generation_config.json"), name=path.name or "kimi",
                   chat_template=load_chat_template(path),
                   template_tokens=load_template_tokens(path / "tokenizer_config.json"), source=str(path),
                   template_file=str(template_file), eos_file=str(path / "generation_config.json"))

    @property
    def template_name(self) -> str:
        """The chat template's file, for errors (or 'this tokenizer chat template' once it was set by hand)."""
        file, loaded = self._template_file
        return file if file and self.chat_template == loaded else f"{self.source} chat template"

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    def id_of(self, token: str) -> int:
        """Id of a special-token name, or of a string that is exactly one BPE token."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        try:
            return self.enc.encode_single_token(token)
        except KeyError:
            raise KeyError(f"{token!r} is neither a special token nor a single BPE token") from None

    # looked up by name, never by offset: a config that moved them is still read correctly
    @property
    def bos_id(self) -> int:
        return self.id_of("[BOS]")

    @property
    def eos_id(self) -> int:
        return self.id_of("[EOS]")

    @property
    def im_end_id(self) -> int:
        return self.id_of("<|im_end|>")

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        # allow_special=True is Kimi's allowed_special="all": "<|im_end|>" in text becomes its id.
        # False encodes it as plain text (use this for untrusted text). Never raise on special strings.
        allowed = "all" if allow_special else set()
        ids: list[int] = []
        for i in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in split_long_runs(text[i:i + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                ids += self.enc.encode(piece, allowed_special=allowed, disallowed_special=())
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of ids. An id past the tokenizer (a model whose vocabulary is padded past it may sample one)
        reads as <|id N: not in the tokenizer|>, never an error in the middle of a stream."""
        ids, n = list(ids), self.vocab_size
        if all(0 <= i < n for i in ids):
            return self.enc.decode_bytes(ids)
        return b"".join(self.enc.decode_bytes([i]) if 0 <= i < n else f"<|id {i}: not in the tokenizer|>".encode()
                        for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # --- chat template: the checkpoint's own ---

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = True, **kwargs) -> list[int] | str:
        """transformers' signature: the chat template rendered with messages, tools, add_generation_prompt and every
        other keyword argument (K2.6 reads thinking and preserve_thinking); tokenize=False returns the string.
        The ids are those of that string, except that special-token strings from the caller's inputs stay plain
        text. No BOS is added (K2.6's template writes none)."""
        messages = chat_messages(messages)
        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools: expected a list of tool dicts (JSON schemas), got {tools!r:.100}")
        inputs = (messages, tools, kwargs)
        if not tokenize:
            return self._render(inputs, add_generation_prompt)
        marked = self._mark(inputs)
        text = self._render(marked, add_generation_prompt)
        # a template that edits strings (escapes, slices) may have moved the markers: then refuse, never guess
        if marked != inputs and self._unmark(text) != self._render(inputs, add_generation_prompt):
            raise ValueError(f"{self.template_name}: it rewrites special-token strings found in a message "
                             f"(e.g. escapes them), so they cannot be kept as plain text")
        return self._encode_rendered(text)

    def _render(self, inputs: tuple, add_generation_prompt: bool) -> str:
        """The template rendered with inputs = (messages, tools, kwargs), and bos_token etc. as transformers does."""
        messages, tools, kwargs = inputs
        if self.chat_template is None:
            raise ValueError(f"{self.source}: no chat template (no {CHAT_TEMPLATE_FILE}, no 'chat_template' in "
                             f"tokenizer_config.json): encode raw text, or set Tokenizer.chat_template")
        try:
            variables = {**self.template_tokens, "documents": None, **kwargs, "messages": messages, "tools": tools,
                         "add_generation_prompt": add_generation_prompt}
            return render_bounded(self.chat_template, variables, self.render_seconds, self.render_chars,
                                  self.render_work)
        except Exception as e:  # syntax, raise_exception(...), a bound, a sandbox refusal, include, recursion: any
            lineno = e.lineno if isinstance(e, jinja2.TemplateSyntaxError) else _template_line(e.__traceback__)
            line = f", line {lineno}" if lineno else ""
            what = " ".join(str(getattr(e, "message", None) or e).split()) or type(e).__name__
            what = what if len(what) <= 300 else what[:297] + "..."
            raise ValueError(f"{self.template_name}{line}: {what}") from None

    def _mark(self, obj):
        """obj with every special-token string (and marker character) inside its strings wrapped; keys kept."""
        if isinstance(obj, str):
            return self._typed_re.sub(lambda m: _OPEN + m.group(0) + _CLOSE, obj)
        if isinstance(obj, dict):
            return {k: self._mark(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._mark(v) for v in obj)
        return obj

    def _unmark(self, text: str) -> str:
        """A render of marked inputs as the render of the inputs themselves (read as _encode_rendered reads it)."""
        pieces = self._marked_re.split(text)
        return "".join(p if k % 2 else re.sub(f"[{_OPEN}{_CLOSE}]", "", p) for k, p in enumerate(pieces))

    def _encode_rendered(self, text: str) -> list[int]:
        """Ids of a render of marked inputs. Special-token strings the template wrote -> their ids; wrapped ones ->
        plain text, encoded together with the text around them (the BPE sees the same runs as in the string)."""
        ids: list[int] = []
        run: list[str] = []  # plain text since the last special id

        def flush():
            ids.extend(self.encode("".join(run), allow_special=False))
            run.clear()

        for k, piece in enumerate(self._marked_re.split(text)):
            if k % 2:  # a wrapped span: a special-token string or marker from the inputs
                run.append(piece)
                continue
            # a lone marker (the template cut a wrapped span) still separates: nothing joins across it
            for sub in re.split(f"[{_OPEN}{_CLOSE}]", piece):
                for j, part in enumerate(self._special_re.split(sub)):
                    if j % 2:
                        flush()
                        ids.append(self.special_tokens[part])
                        continue
                    if m := self._markup_re.search(part):      # the template's own text, not an input's
                        raise ValueError(f"{self.template_name}: the template writes {m.group(0)!r}, which "
                                         f"{self.source}/tokenizer_config.json does not define as a special token "
                                         f"(added_tokens_decoder): it would be encoded as plain text")
                    run.append(part)
        flush()
        return ids


class StreamDecoder:
    """Detokenize token by token without ever emitting half a UTF-8 character.
    One token can end mid-character (a Han char is 3 bytes, often split over 2 tokens). Python's
    incremental UTF-8 decoder holds back an incomplete tail and, with errors="replace", emits U+FFFD
    exactly where bytes.decode(errors="replace") on the whole stream would, so the invariant holds."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self._utf8.decode(self.tokenizer.decode_bytes(ids))

    def flush(self) -> str:
        """End of stream: a dangling partial character becomes U+FFFD. The decoder is then reset."""
        return self._utf8.decode(b"", final=True)


if __name__ == "__main__":
    tok = Tokenizer.from_dir(sys.argv[1])
    text = sys.argv[2] if len(sys.argv) > 2 else "Hello, 世界! 12345"
    print(f"num_base_tokens={tok.num_base_tokens} vocab_size={tok.vocab_size} bos={tok.bos_id} "
          f"eos={tok.eos_id} im_end={tok.im_end_id} stop_ids={sorted(tok.stop_ids)}")
    ids = tok.encode(text)
    print(ids, [tok.decode([i]) for i in ids])
    if tok.chat_template is not None:
        print(repr(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False)))

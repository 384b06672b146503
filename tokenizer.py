"""
Kimi K2.6 tokenizer: tiktoken BPE + Kimi special tokens + the K2.6 chat template + streaming decode.

Loads a Kimi-style checkpoint directory:
    tiktoken.model          one `base64(token_bytes) rank` per line; ranks 0..N-1 are the BPE vocab
    tokenizer_config.json   `added_tokens_decoder` names the special ids N, N+1, ...
    generation_config.json  (optional) `eos_token_id`: extra stop ids
This is the construction of Moonshot's `tokenization_kimi.py`, rebuilt on `tiktoken.Encoding` so that
we need no remote code. HF's AutoTokenizer gets the special ids wrong for Kimi (kimi_k2.md §3.5).

Invariants:
* ids 0..N-1 are the BPE ranks from the file, N = num_base_tokens = line count (163584 for K2.6),
  counted and never hard-coded; ids N..N+255 are special, unnamed ones are `<|reserved_token_{id}|>`.
* StreamDecoder: "".join(push(...) for each chunk) + flush() == decode(all ids), and push never returns
  a half-finished UTF-8 character.

Run:  python tokenizer.py /path/to/Kimi-K2.6 "你好, world"      (prints ids, pieces and a chat prompt)
Test: python -m pytest -q tests/test_tokenizer.py
"""
from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
import sys
from pathlib import Path
from typing import Iterable

import tiktoken

# The K2 pre-tokenizer regex, byte-identical to `pat_str` in every tokenization_kimi.py (kimi_k2.md §3.2).
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
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Kimi's encode() feeds tiktoken at most 400k chars at a time and cuts runs of > 25k whitespace or
# non-whitespace chars, because tiktoken's regex matching goes quadratic on such runs (tiktoken #195).
# Identical results on any normal text; we copy it so pathological inputs tokenize like the reference.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# Offsets from num_base_tokens of the named K2.6 special tokens (kimi_k2.md §3.3, ids = 163584 + offset).
_KIMI_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
# Kimi's config marks the tool-call markers "special": false (they are still tiktoken special tokens).
_NOT_SPECIAL = {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"}


def KIMI_SPECIAL_TOKENS(num_base: int) -> dict[int, str]:
    """The named K2.6 special tokens at their absolute ids, for a BPE vocab of num_base tokens."""
    return {num_base + off: name for off, name in _KIMI_SPECIAL_OFFSETS.items()}

# -----------------------------------------------------------------------------
# file formats: readers with errors that name file, line and field; writers for tests and the trainer

def load_tiktoken_model(path: str | Path) -> dict[bytes, int]:
    """Parse tiktoken.model ourselves (not tiktoken.load) so every error names the file and line."""
    path = Path(path)
    if not path.is_file():
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
            if not fields[1].isdigit():  # isdigit, not int(): int() would also take '-1', '1_0', '+3'
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
    return ranks


def _read_json(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return cfg


def load_special_names(path: str | Path, num_base: int) -> dict[int, str]:
    """id -> name of every entry in tokenizer_config.json's `added_tokens_decoder`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer config not found: {path}")
    decoder = _read_json(path).get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}: field 'added_tokens_decoder' is missing or not an object")
    names: dict[int, str] = {}
    for key, entry in decoder.items():
        field = f"added_tokens_decoder[{key!r}]"
        if not key.isdigit():
            raise ValueError(f"{path}: field {field}: key is not a token id")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
            raise ValueError(f"{path}: field {field}.content is missing or not a non-empty string")
        if int(key) < num_base:  # would shadow a BPE rank
            raise ValueError(f"{path}: field {field}: id {key} is below num_base_tokens={num_base}")
        if entry["content"] in names.values():
            raise ValueError(f"{path}: field {field}: name {entry['content']!r} is used twice")
        names[int(key)] = entry["content"]
    return names


def load_eos_ids(path: str | Path) -> set[int]:
    """`eos_token_id` (int or list) from an optional generation_config.json; empty set if absent."""
    path = Path(path)
    if not path.is_file():
        return set()
    eos = _read_json(path).get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(type(i) is int and i >= 0 for i in eos):  # type(): bool is an int
        raise ValueError(f"{path}: field 'eos_token_id' must be an id or a list of ids, got {eos!r}")
    return set(eos)


def write_tiktoken_model(path: str | Path, ranks: dict[bytes, int]) -> None:
    with open(path, "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def write_tokenizer_config(path: str | Path, special: dict[int, str]) -> None:
    entry = lambda name: {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": name not in _NOT_SPECIAL}
    cfg = {"added_tokens_decoder": {str(i): entry(name) for i, name in sorted(special.items())}}
    for field, name in [("bos_token", "[BOS]"), ("eos_token", "[EOS]"), ("unk_token", "[UNK]"), ("pad_token", "[PAD]")]:
        if name in special.values():
            cfg[field] = name
    cfg["tokenizer_class"] = "TikTokenTokenizer"
    Path(path).write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

# -----------------------------------------------------------------------------

def split_long_runs(text: str, max_run: int = MAX_RUN_CHARS) -> list[str]:
    """Cut every run of > max_run whitespace (or non-whitespace) chars every max_run chars, as Kimi does.
    Kimi walks the string char by char; we let `re` find only the long runs (each anchored at its start,
    so the scan stays linear). Python's \\s and str.isspace() agree, so the cuts are the same."""
    long_run = rf"(?<!\S)\S{{{max_run + 1},}}|(?<!\s)\s{{{max_run + 1},}}"
    cuts = [c for m in re.finditer(long_run, text) for c in range(m.start() + max_run, m.end(), max_run)]
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


class Tokenizer:
    """tiktoken.Encoding over the Kimi vocab, special ids and chat template. Build with from_dir()."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_names: dict[int, str],
                 eos_ids: Iterable[int] = (), name: str = "kimi"):
        self.num_base_tokens = len(mergeable_ranks)
        n = self.num_base_tokens
        # every named id, plus reserved names for the gaps in n..n+255 (more if a name sits beyond that)
        n_special = max([NUM_RESERVED_SPECIAL_TOKENS] + [i - n + 1 for i in special_names])
        self.special_tokens = {special_names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + n_special)}
        if len(self.special_tokens) != n_special:
            raise ValueError("a special-token name collides with a reserved name <|reserved_token_{id}|>")
        self.enc = tiktoken.Encoding(name, pat_str=PAT, mergeable_ranks=mergeable_ranks,
                                     special_tokens=self.special_tokens)
        # stop on end-of-turn and on [EOS] (kimi_k2.md §3.4), plus whatever generation_config says
        self.stop_ids = {self.special_tokens[s] for s in ("<|im_end|>", "[EOS]") if s in self.special_tokens}
        self.stop_ids |= set(eos_ids)
        if bad := sorted(i for i in self.stop_ids if i >= self.vocab_size):
            raise ValueError(f"eos ids {bad} are outside the vocab (n_vocab={self.vocab_size})")

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        ranks = load_tiktoken_model(path / "tiktoken.model")
        special = load_special_names(path / "tokenizer_config.json", num_base=len(ranks))
        return cls(ranks, special, load_eos_ids(path / "generation_config.json"), name=path.name or "kimi")

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
        return self.enc.decode_bytes(list(ids))

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # --- chat template (K2.6) ---

    def _chat_segments(self, messages: list[dict], thinking: bool, add_generation_prompt: bool) -> list[tuple[str, bool]]:
        """The prompt as (text, is_special_token) pieces. Both renderers below read this one list."""
        S, T = (lambda s: (s, True)), (lambda s: (s, False))
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content', got {m!r:.200}")
            if not re.fullmatch(r"[A-Za-z0-9_\-]+", m["role"]):
                raise ValueError(f"messages[{i}]: unknown role {m['role']!r} (want user, assistant, system, tool, ...)")
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}] + list(messages)
        header = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}  # every other role: <|im_system|>
        segs: list[tuple[str, bool]] = []
        for m in messages:
            segs += [S(header.get(m["role"], "<|im_system|>")), T(m["role"]), S("<|im_middle|>")]
            if m["role"] == "assistant":  # history drops reasoning: an empty think block, then the answer
                segs += [S("<think>"), S("</think>")]
            segs += [T(m["content"]), S("<|im_end|>")]
        if add_generation_prompt:
            segs += [S("<|im_assistant|>"), T("assistant"), S("<|im_middle|>"), S("<think>")]
            if not thinking:  # instant mode: the model starts straight after a closed, empty think block
                segs.append(S("</think>"))
        return [(s, sp) for s, sp in segs if s]

    def render_chat(self, messages: list[dict], thinking: bool = False, add_generation_prompt: bool = True) -> str:
        return "".join(s for s, _ in self._chat_segments(messages, thinking, add_generation_prompt))

    def apply_chat_template(self, messages: list[dict], thinking: bool = False,
                            add_generation_prompt: bool = True) -> list[int]:
        # Message text is encoded with allow_special=False, so a user typing "<|im_end|>" cannot forge a
        # turn boundary. HF renders the string and encodes it with allowed_special="all"; the ids agree
        # with encode(render_chat(...)) except when message text contains special-token strings. No BOS.
        ids: list[int] = []
        for s, special in self._chat_segments(messages, thinking, add_generation_prompt):
            ids += [self.special_tokens[s]] if special else self.encode(s, allow_special=False)
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
    print(repr(tok.render_chat([{"role": "user", "content": text}])))

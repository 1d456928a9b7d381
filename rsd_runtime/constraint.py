"""Structured output's token automata (rsd.constraint.TokenAutomaton), built with outlines-core from a
regex and a tokenizer's vocabulary. outlines-core (Rust, no torch) compiles the regex to a DFA over bytes
and indexes it by token: for every state, the tokens whose bytes keep the match alive and the state after
each. JSON schemas become regexes through its json_schema module; json_object is the schema {"type":
"object"}, which outlines-core unrolls to a bounded nesting depth (a regex cannot count brackets).

Builds are cached per (vocabulary, constraint): a JSON schema over a 150k-token vocabulary takes seconds.
outlines-core is the optional extra `rsd[structured]`; without it a constrained request is refused with
StructuredUnavailable, naming the extra.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rsd.constraint import Constraint, ConstraintError, Guide

EXTRA = "rsd[structured]"  # pyproject.toml's optional extra that installs outlines-core
CACHE_SIZE = 32  # automata kept per process (each holds its index and the masks it has made)


class StructuredUnavailable(ValueError):
    """outlines-core is not installed: structured output cannot be served (the request is refused, naming
    the extra, as any other it cannot serve)."""


def _outlines() -> Any:
    try:
        import outlines_core
    except ImportError:
        raise StructuredUnavailable(
            f"structured output needs outlines-core: install the extra {EXTRA} (pip install '{EXTRA}')"
        ) from None
    return outlines_core


def regex_of(constraint: Constraint) -> str:
    """The regex the constraint's text must match. ConstraintError for a JSON schema outlines-core refuses."""
    if constraint.kind == "regex":
        return constraint.value
    schema = constraint.value if constraint.kind == "json_schema" else '{"type": "object"}'
    try:
        json.loads(schema)
        return _outlines().json_schema.build_regex_from_schema(schema)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"cannot use this JSON schema: {e}") from None


class IndexAutomaton:
    """rsd.constraint.TokenAutomaton over an outlines-core Index. Masks are made once per state. After EOS
    (allowed in accepting states) the automaton stays where it is: a draft may run past its EOS, and the
    generation is cut there anyway."""

    def __init__(self, index: Any, vocab_size: int, eos_token_id: int):
        self.index, self.vocab_size, self.eos_token_id = index, vocab_size, eos_token_id
        self.initial_state: int = index.get_initial_state()
        self._masks: dict[int, Tensor] = {}

    def allowed(self, state: int) -> Tensor:
        mask = self._masks.get(state)
        if mask is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)  # [V]
            ids = [t for t in self.index.get_allowed_tokens(state) or () if t < self.vocab_size]
            mask[ids] = True
            self._masks[state] = mask
        return mask

    def next_state(self, state: int, token: int) -> int | None:
        if token == self.eos_token_id:  # outlines-core answers None for EOS, allowed or not
            return state if self.index.is_final_state(state) else None
        return self.index.get_next_state(state, token)


def build_automaton(constraint: Constraint, vocabulary: dict[int, bytes], eos_token_id: int) -> IndexAutomaton:
    """The automaton of `constraint` over token id -> bytes (the EOS token is allowed where the text may end).
    ConstraintError for a regex or schema that cannot be compiled or that no token sequence can follow."""
    oc = _outlines()
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, piece in vocabulary.items():
        if token_id != eos_token_id and piece:
            by_bytes.setdefault(piece, []).append(token_id)
    regex = regex_of(constraint)
    try:
        index = oc.Index(regex, oc.Vocabulary(eos_token_id, by_bytes))
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"cannot build the {constraint.kind} constraint: {e}") from None
    return IndexAutomaton(index, max([*vocabulary, eos_token_id]) + 1, eos_token_id)


class AutomatonCache:
    """Automata of one tokenizer per constraint, least recently used dropped past CACHE_SIZE; thread-safe (a
    build runs outside the lock, so two first requests for one constraint may both build it).
    load: returns the tokenizer; called at the first constrained request (a service that never sees one
    never loads it)."""

    def __init__(self, load: Callable[[], Any]):
        self._load = load
        self.tokenizer: Any = None
        self._vocabulary: dict[int, bytes] | None = None
        self._automata: OrderedDict[Constraint, IndexAutomaton] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, constraint: Constraint) -> IndexAutomaton:
        with self._lock:
            if constraint in self._automata:
                self._automata.move_to_end(constraint)
                return self._automata[constraint]
        if self._vocabulary is None:
            self.tokenizer = self._load()
            self._vocabulary = token_bytes(self.tokenizer)
        automaton = build_automaton(constraint, self._vocabulary, self.tokenizer.eos_token_id)
        with self._lock:
            self._automata[constraint] = automaton
            while len(self._automata) > CACHE_SIZE:
                self._automata.popitem(last=False)
        return automaton

    def guide(self, constraint: Constraint, start: int) -> Guide:
        """A generation's Guide: the constraint's automaton, its text beginning at committed index `start`."""
        return Guide(self.get(constraint), start)


def folder_automata(folder: str) -> AutomatonCache:
    """A service's automata, over the tokenizer in `folder` (its --tokenizer, else its --model folder)."""

    def load() -> Any:
        if not folder:
            raise ConstraintError("structured output needs a tokenizer: start the service with --tokenizer DIR")
        from rsd_runtime.tokenizer import load_tokenizer  # imports transformers: only when needed

        return load_tokenizer(folder)

    return AutomatonCache(load)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Token id -> the bytes it adds to the text, for tokenizers whose tokens concatenate to the text:
    byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece-style ("▁" for a space, "<0xHH>" byte
    fallback; the first token's leading space counts as text). Special tokens are left out (the EOS id is
    the automaton's own). ConstraintError for other tokenizers (e.g. word-level: decoding puts spaces
    between tokens that no token holds)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    decoder = json.dumps(spec.get("decoder"), ensure_ascii=False)
    special = set(tokenizer.all_special_ids)
    vocab = {i: t for t, i in tokenizer.get_vocab().items() if i not in special}
    if '"ByteLevel"' in decoder:
        chars = _byte_decoder()
        if all(c in chars for t in vocab.values() for c in t):
            return {i: bytes(chars[c] for c in t) for i, t in vocab.items()}
    elif "\u2581" in decoder or '"Metaspace"' in decoder:
        out = {}
        for i, t in vocab.items():
            m = _BYTE_TOKEN.fullmatch(t)
            out[i] = bytes([int(m.group(1), 16)]) if m else t.replace("\u2581", " ").encode()
        return out
    raise ConstraintError(
        "structured output needs a byte-level BPE or SentencePiece tokenizer (its tokens concatenate to the "
        f"text); this one's decoder is {decoder[:80]}"
    )

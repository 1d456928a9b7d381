"""Text of a turn: token ids -> streamed text (Detokenizer), cut at the first stop sequence (StopFilter)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 6  # committed tokens decoded in front of new ones, so spacing and merges come out right


class Detokenizer:
    """Token ids -> text deltas whose concatenation is the decoded text after `context_ids`.

    Decodes a short window [prefix_offset:] and emits what it adds to [prefix_offset:read_offset];
    while the window ends in U+FFFD (a character split across tokens) nothing is emitted, so the
    character comes with the token that completes it. Decoding after context tokens keeps the
    spaces a tokenizer inserts between tokens (word-level) or strips at the start (SentencePiece).

    Not tokenizers' DecodeStream: on a byte-level BPE it emits the complete part of a push whose last
    character is split (this holds the whole push back: other TokenDelta texts), turns invalid UTF-8 (a
    model's stray bytes) into other text, has no flush for a character cut off by the end of the turn,
    skips clean_up_tokenization_spaces, and needs a fast (Rust) tokenizer.
    """

    def __init__(self, tokenizer: Any, context_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids = list(context_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        return self._advance(force=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end), as it decodes."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if not force and (new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text)):
            return ""
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else new_text
        # Keep a few tokens as the next window's context; drop older ones.
        self.prefix_offset = max(self.read_offset, len(self.ids) - CONTEXT_TOKENS)
        self.prefix_offset = min(self.prefix_offset, len(self.ids))
        self.read_offset = len(self.ids)
        if self.prefix_offset > self.read_offset:  # pragma: no cover - defensive
            self.prefix_offset = self.read_offset
        return delta


class StopFilter:
    """Passes text through until the first stop sequence; holds back any tail that could start one."""

    def __init__(self, stop_sequences: Sequence[str]):
        self.stops = [s for s in stop_sequences if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = 0 if final else self._partial_stop_len()
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:k]):
                    best = k
                    break
        return best

"""Loading a model folder's tokenizer, checked against its own tokenizer.json. Importing this module imports
no torch (the gateway tokenizes and holds no model): transformers' AutoTokenizer pulls torch in (transformers
5.24), so it is imported when a tokenizer is loaded."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

# Text every tokenizer we load must encode the same way as its own tokenizer.json:
# words of the tiny test vocabulary plus ordinary code.
_PROBE = "w0 w1 w2 def add(a, b):\n    return a + b"


def load_tokenizer(path: str | Path, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder, checked against the folder's own tokenizer.json.

    transformers 5.24 picks the tokenizer class from config.json's model_type: on a qwen2 folder
    that holds a word-level tokenizer.json it returns a Qwen2Tokenizer that encodes "w1 w2" to no
    ids at all, silently. When AutoTokenizer disagrees with tokenizer.json we load the file through
    the generic fast tokenizer instead, and we refuse a tokenizer that still disagrees.
    """
    from transformers import AutoTokenizer  # imports torch: not at module import

    kwargs = {} if gguf_file is None else {"gguf_file": gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    reference_file = Path(path) / "tokenizer.json"
    if not reference_file.is_file():  # e.g. GGUF: the tokenizer comes from the GGUF metadata
        if not tokenizer.encode(_PROBE, add_special_tokens=False):
            raise ValueError(f"tokenizer of {path} encodes {_PROBE!r} to no ids")
        return tokenizer
    reference = Tokenizer.from_file(str(reference_file))
    if not _agrees(tokenizer, reference):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        if not _agrees(tokenizer, reference):
            raise ValueError(f"cannot load a tokenizer for {path} that agrees with its tokenizer.json")
    return tokenizer


def _agrees(tokenizer: PreTrainedTokenizerBase, reference: Tokenizer) -> bool:
    """The probe encodes to the same, non-empty ids. (Decoded text is not compared: wrappers may
    legitimately clean up spaces that the bare tokenizer keeps.)"""
    ids = reference.encode(_PROBE, add_special_tokens=False).ids
    return len(ids) > 0 and tokenizer.encode(_PROBE, add_special_tokens=False) == ids

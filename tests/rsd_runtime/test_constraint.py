"""Structured output in the runtime: outlines-core automata from a tokenizer (rsd_runtime.constraint), and the
in-process generator under a constraint: every output matches, T = 0 is the target's constrained greedy
output for every method, and sampled tokens follow the masked target law (chi-square)."""

import builtins
import json
import re

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from rsd.constraint import Constraint, ConstraintError
from rsd.methods import Method
from rsd.sampling import SamplingParams, logits_to_probs
from rsd_runtime import constraint as rc
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import load_model
from rsd_runtime.predraft import PipelinedGenerator
from rsd_runtime.runner import ModelRunner
from rsd_runtime.tokenizer import load_tokenizer
from rsd_tools.tiny import build_tiny_vocab_pair, word_tokenizer
from tests.fixtures.byte_pair import build_byte_pair
from tests.fixtures.toy import chi_square_pvalue
from tests.rsd.test_constraint import TABLE

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bc"]}},
    "required": ["ok", "kind"],
}
REGEX = r"(yes|no)[0-9]?!"
METHODS = [("sd", "4"), ("rsd_c", "2,2"), ("rsd_s", "3x3"), ("spectr", "2x3"), ("specinfer", "2,2")]
EOS = 1  # the tiny tokenizers' <eos>


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory):
    draft_dir, target_dir = build_byte_pair(tmp_path_factory.mktemp("bytes"))
    return load_model(draft_dir), load_model(target_dir), load_tokenizer(target_dir)


def test_token_bytes_concatenate_to_the_text_and_word_level_is_refused(byte_pair):
    tokenizer = byte_pair[2]
    pieces = rc.token_bytes(tokenizer)
    text = '{"a": "héllo 😀"}\n'
    assert b"".join(pieces[i] for i in tokenizer.encode(text, add_special_tokens=False)) == text.encode()
    assert EOS not in pieces  # special tokens are the automaton's business
    with pytest.raises(ConstraintError, match="byte-level BPE or SentencePiece"):
        rc.token_bytes(word_tokenizer(16))


def test_sentencepiece_pieces_and_byte_fallback():
    """Llama-2-style: "▁" is a space, "<0xHH>" a byte; the text the automaton reads keeps the leading space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5, "▁a": 6, "<0xC3>": 7, "<0xA9>": 8}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    pieces = rc.token_bytes(tokenizer)
    ids = tokenizer.encode("a ba é", add_special_tokens=False)
    assert b"".join(pieces[i] for i in ids) == " a ba é".encode() and 2 not in pieces


def test_bad_regex_and_schema_are_refused(byte_pair):
    cache = rc.AutomatonCache(lambda: byte_pair[2])
    with pytest.raises(ConstraintError, match="regex"):
        cache.get(Constraint("regex", "(unclosed"))
    with pytest.raises(ConstraintError, match="JSON schema"):
        cache.get(Constraint("json_schema", '{"type": "no such type"}'))
    with pytest.raises(ConstraintError, match="JSON schema"):
        cache.get(Constraint("json_schema", "{not json"))
    with pytest.raises(ValueError, match="unknown constraint kind"):
        Constraint("grammar", "x")
    assert cache.get(Constraint("regex", REGEX)) is cache.get(Constraint("regex", REGEX))  # cached


def test_missing_library_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_outlines(name, *args, **kwargs):
        if name.startswith("outlines_core"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_outlines)
    with pytest.raises(rc.StructuredUnavailable, match=re.escape("rsd[structured]")):
        rc.build_automaton(Constraint("regex", "a"), {4: b"a"}, EOS)


def text_of(tokenizer, ids):
    assert ids[-1] == EOS, "the automaton must end the text with EOS"
    return tokenizer.decode(ids[:-1])


@pytest.mark.parametrize(("name", "shape"), METHODS)
def test_every_output_matches_and_greedy_is_the_targets_constrained_greedy(byte_pair, name, shape):
    draft, target, tokenizer = byte_pair
    cache = rc.AutomatonCache(lambda: tokenizer)
    gen = SpeculativeGenerator(ModelRunner(target, 128), ModelRunner(draft, 128))
    prompt = tokenizer.encode("<bos> user answer <eos> <bos> assistant ")
    for constraint, check in [
        (Constraint("regex", REGEX), lambda text: re.fullmatch(REGEX, text)),
        (Constraint("json_schema", json.dumps(SCHEMA)), lambda text: json.loads(text)["kind"] in ("a", "bc")),
    ]:
        automaton = cache.get(constraint)
        for seed in range(3):
            out = gen.generate(
                prompt, Method.parse(name, shape), SamplingParams(1.0), 64, (EOS,), seed, "token", automaton
            )
            assert check(text_of(tokenizer, out.token_ids)), out.token_ids
        greedy = gen.generate(prompt, Method.parse(name, shape), SamplingParams(0), 64, (EOS,), 0, "token", automaton)
        alone = gen.generate(prompt, None, SamplingParams(0), 64, (EOS,), 0, "token", automaton)
        assert greedy.token_ids == alone.token_ids and check(text_of(tokenizer, alone.token_ids))


class TableAutomaton:
    """tests/rsd/test_constraint.py's automaton on the tiny 8-id vocabulary: its tokens 0..3 are ids 4..7."""

    initial_state = 0

    def allowed(self, state):
        mask = torch.zeros(8, dtype=torch.bool)
        mask[[4 + t for t in TABLE[state]]] = True
        return mask

    def next_state(self, state, token):
        return TABLE[state].get(token - 4)


@torch.inference_mode()
def masked_target_law(model, prompt, params):
    automaton, law = TableAutomaton(), {}

    def probs(ids, state):
        logits = model(torch.tensor([ids])).logits[0, -1]
        return logits_to_probs(logits.masked_fill(~automaton.allowed(state), float("-inf")), params).double()

    q1 = probs(prompt, 0)
    for a in q1.nonzero().flatten().tolist():
        q2 = probs([*prompt, a], automaton.next_state(0, a))
        for b in q2.nonzero().flatten().tolist():
            law[(a, b)] = float(q1[a] * q2[b])
    return law


def test_sampled_tokens_follow_the_masked_target_law(tmp_path_factory):
    """RSD-S through the runtime (tests/rsd/test_constraint.py enumerates every method and rule)."""
    draft_dir, target_dir = build_tiny_vocab_pair(tmp_path_factory.mktemp("tinyv"), vocab_size=8)
    draft, target = load_model(draft_dir), load_model(target_dir)
    gen = SpeculativeGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    prompt, n, counts, params = [2, 5, 6], 1000, {}, SamplingParams(1.0)
    for seed in range(n):
        out = gen.generate(prompt, Method.parse("rsd_s", "3x2"), params, 2, (), seed, "token", TableAutomaton())
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert chi_square_pvalue(counts, masked_target_law(target, prompt, params), n) > 1e-4


def test_pre_drafting_under_a_constraint_changes_no_token(byte_pair):
    """Pre-drafted trees (rsd_runtime.predraft) rank and draft only outcomes the constraint allows."""
    draft, target, tokenizer = byte_pair
    automaton = rc.AutomatonCache(lambda: tokenizer).get(Constraint("json_schema", json.dumps(SCHEMA)))
    prompt = tokenizer.encode("<bos> user answer <eos> <bos> assistant ")
    plain = SpeculativeGenerator(ModelRunner(target, 128), ModelRunner(draft, 128))
    ahead = PipelinedGenerator(ModelRunner(target, 128), ModelRunner(draft, 128), max_outcomes=3)
    for seed in range(3):
        args = (prompt, Method.parse("rsd_c", "2,2"), SamplingParams(1.0), 64, (EOS,), seed, "token", automaton)
        out = ahead.generate(*args)
        assert out.token_ids == plain.generate(*args).token_ids and out.stats.predraft_trees > 0

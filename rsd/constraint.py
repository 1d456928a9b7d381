"""Structured output: a constraint on the generated tokens (a regex, a JSON schema) as a token automaton,
and the mask it puts on each draft-tree node's laws.

The constrained law at a position is the model's law with the tokens the constraint forbids there
removed and the rest renormalised (vLLM's and SGLang's grammar bitmask): we set the forbidden logits to
-inf before every sampling transform (logit bias, temperature, top-k, top-p), so greedy is the argmax
over the allowed tokens and top-k / top-p truncate among them, as in vLLM.

Why it stays exact in a tree. The automaton is deterministic: the state at a node is a function of the
tokens on its path from the root (the root's state: after the tokens generated so far). So the masked
target law at a node is a fixed function of the node's path, exactly as the unmasked one is; the
acceptance rules (rsd.acceptance, rsd.traversal) only ever need "the target's law at this node" and
"the law this node's children were drawn from", and are exact for any such pair. The draft is masked
the same way at each node (never required for exactness, but a draft token the target law cannot emit
would always be rejected). One mask for the whole tree (the root's) would be wrong: the negative
control in tests/rsd/test_constraint.py shows the gap.

End of text: the automaton's EOS token is allowed in its accepting states (forced where nothing else may
follow); a state with no allowed token at all fails the request (ConstraintError) instead of emitting
text that does not match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

CONSTRAINT_KINDS = ("regex", "json_schema", "json_object")


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its generated text to. kind "regex": value is the pattern the whole text
    matches; "json_schema": value is the schema, as JSON text; "json_object": any JSON object (value "")."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}")
        if (self.kind == "json_object") != (self.value == ""):
            needs = "takes no" if self.kind == "json_object" else "needs a"
            raise ValueError(f"a {self.kind} constraint {needs} value")


class ConstraintError(ValueError):
    """The constraint allows no token where one must be generated (or a tree holds a forbidden token)."""


class TokenAutomaton(Protocol):
    """A deterministic automaton over token ids; states are ints."""

    initial_state: int

    def allowed(self, state: int) -> Tensor:
        """[V'] bool: the tokens allowed in `state` (V' may be below the model's V: the rest is forbidden)."""
        ...

    def next_state(self, state: int, token: int) -> int | None:
        """The state after `token`, or None when `token` is not allowed in `state`."""
        ...


@dataclass
class Guide:
    """A constraint applied to one generation: the automaton, and where the constrained text begins
    (the index in the committed tokens of the first generated token). Remembers the states along the
    tokens it has seen, so each step advances over the new tokens only (a history that differs is
    recomputed from where it differs). Safe to share between threads: the memo is swapped whole."""

    automaton: TokenAutomaton
    start: int
    _memo: tuple[tuple[int, ...], tuple[int, ...]] = field(default=((), ()), repr=False)  # tokens, states after

    def root_state(self, committed: list[int]) -> int:
        """The state after committed[start:] (the tree's root is committed[-1])."""
        generated = committed[self.start :]
        known, states = self._memo
        n = 0
        while n < min(len(generated), len(known)) and generated[n] == known[n]:
            n += 1
        states = list(states[:n])
        state = states[-1] if states else self.automaton.initial_state
        for i in range(n, len(generated)):
            state = self.automaton.next_state(state, generated[i])
            if state is None:
                raise ConstraintError(
                    f"generated token {generated[i]} at position {self.start + i} is not allowed by the constraint"
                )
            states.append(state)
        self._memo = (tuple(generated), tuple(states))
        return state

    def tree_masks(
        self,
        committed: list[int],
        token_ids: Tensor,
        parent_idx: Tensor,
        vocab_size: int,
        nodes: list[int] | None = None,
    ) -> Tensor:
        """[N', V] bool: the tokens allowed after each node (or each of `nodes`) of a tree whose root is
        committed[-1]; token_ids, parent_idx [N]."""
        states = node_states(self.automaton, self.root_state(committed), token_ids, parent_idx)
        return state_masks(self.automaton, states if nodes is None else [states[n] for n in nodes], vocab_size)


def node_states(automaton: TokenAutomaton, root_state: int, token_ids: Tensor, parent_idx: Tensor) -> list[int]:
    """The automaton's state at every node: the root's is root_state, node i's is next(state[parent], token i).
    token_ids, parent_idx [N] (rsd.tree: parents come first). ConstraintError for a forbidden draft token."""
    tokens, parents = token_ids.tolist(), parent_idx.tolist()
    states = [root_state]
    for i in range(1, len(tokens)):
        state = automaton.next_state(states[parents[i]], tokens[i])
        if state is None:
            raise ConstraintError(f"draft token {tokens[i]} at tree node {i} is not allowed by the constraint")
        states.append(state)
    return states


def state_masks(automaton: TokenAutomaton, states: list[int], vocab_size: int) -> Tensor:
    """[len(states), vocab_size] bool: each state's allowed tokens (ids past the automaton's forbidden)."""
    masks = torch.zeros(len(states), vocab_size, dtype=torch.bool)
    for row, state in enumerate(states):
        allowed = automaton.allowed(state)[:vocab_size]
        masks[row, : allowed.shape[0]] = allowed
    return masks


def mask_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """logits [..., V] with the tokens mask [..., V] forbids set to -inf (a new tensor). ConstraintError when
    a row allows no token: nothing can be emitted that matches the constraint."""
    mask = mask.to(logits.device)
    if not bool(mask.any(-1).all()):
        raise ConstraintError("the constraint allows no token here: no text can continue that matches it")
    return logits.masked_fill(~mask, float("-inf"))

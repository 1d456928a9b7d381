"""Chat input: messages rendered with the target tokenizer's chat template.

    chat = ChatTemplate(tokenizer)                                   # chat.available: it has a template
    ids = chat.encode([{"role": "user", "content": "hi"}], continuation=False)
    chat.end_of_turn_ids                                             # eos + the template's end-of-turn token

A new session renders the whole conversation with the assistant's generation prompt
(`apply_chat_template(..., add_generation_prompt=True)`), then tokenizes it without adding special
tokens (the template writes its own).

A continuation appends only what the new messages add. A template renders whole conversations (a
default system prompt in front, separators between turns), so rendering the new messages alone could
repeat the system prompt. Instead the gateway renders a probe conversation (user, assistant) once, cut
right after the assistant's end-of-turn marker (`head`), and on each continuation renders probe + new
messages and keeps what follows `head`. Worked example (Qwen):
    head        ...<|im_start|>assistant\\nPROBE<|im_end|>
    full        ...<|im_start|>assistant\\nPROBE<|im_end|>\\n<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n
    appended    \\n<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n
so a session whose last turn ended at <|im_end|> holds exactly the whole conversation's rendering.

The end-of-turn token is the first special token the template writes after an assistant message's
content (Qwen's <|im_end|>, Llama 3's <|eot_id|>, the tiny test models' <eos>); a chat turn stops at it
as at eos.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_PROBE_REPLY = "rsd probe answer"
_PROBE = ({"role": "user", "content": "rsd probe question"}, {"role": "assistant", "content": _PROBE_REPLY})
_MAX_ROLE_CHARS = 64


class ChatTemplate:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.available = bool(getattr(tokenizer, "chat_template", None))
        eos = tokenizer.eos_token_id
        self.end_of_turn_ids: list[int] = [] if eos is None else [eos]
        self._head: str | None = None  # the probe conversation up to its end-of-turn marker; None: cannot continue
        if self.available:
            self._learn_end_of_turn()

    def _render(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja2 errors, raise_exception() in a template: the messages do not fit it
            raise ValueError(f"the chat template refused them: {e}") from None

    def _learn_end_of_turn(self) -> None:
        try:
            head = self._render(_PROBE, generation_prompt=False)
        except ValueError:
            return  # a template that refuses a plain user/assistant exchange: new sessions only
        end = head.rfind(_PROBE_REPLY)
        if end < 0:
            return
        end += len(_PROBE_REPLY)
        tok = self.tokenizer
        special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        eot = next((i for i in tok.encode(head[end:], add_special_tokens=False) if i in special), None)
        if eot is not None:
            marker = tok.convert_ids_to_tokens(eot)
            at = head.find(marker, end)
            if at >= 0:
                end = at + len(marker)
            if eot not in self.end_of_turn_ids:
                self.end_of_turn_ids.append(eot)
        self._head = head[:end]

    def encode(
        self, messages: Sequence[Mapping[str, str]], continuation: bool, generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of `messages` (dicts with role, content and maybe name) and the generation prompt (unless
        `generation_prompt` is false: /tokenize may ask so): the whole rendering for a new session, what they
        add after the previous turn for a continuation.
        ValueError names what is wrong (no template, bad messages, a template that refuses them)."""
        if not self.available:
            raise ValueError("the gateway's tokenizer has no chat template: send text or token_ids instead")
        if not messages:
            raise ValueError("must not be empty")
        for i, m in enumerate(messages):
            if not m["role"] or len(m["role"]) > _MAX_ROLE_CHARS:
                raise ValueError(f"[{i}].role must have 1..{_MAX_ROLE_CHARS} characters")
        if not continuation:
            text = self._render(messages, generation_prompt)
        else:
            full = None if self._head is None else self._render([*_PROBE, *messages], generation_prompt)
            if full is None or not full.startswith(self._head):
                raise ValueError("this chat template cannot append messages to a session: start a new one")
            text = full[len(self._head) :]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

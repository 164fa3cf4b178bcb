"""The chat template: messages -> one prompt string, deterministic and prefix-stable.

    <|system|>\\n{content}\\n      one block per message, in order: "<|" role "|>" newline content newline
    <|user|>\\n{content}\\n
    <|assistant|>\\n{content}\\n
    <|assistant|>\\n               the generation prompt, always last

Because a message renders the same wherever it sits, turn N's prompt followed by the reply it
got is an exact prefix of turn N+1's prompt (when the client sends the reply back verbatim as the
assistant message), so a multi-turn chat hits the prefix cache for everything but the new turn.
The tiny checkpoints were not trained on this (or any) chat format; it exists for the cache path.
Content given as a list of parts is the concatenation of its text parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

Role = Literal["system", "developer", "user", "assistant"]
GENERATION_PROMPT = "<|assistant|>\n"


class TextPart(Protocol):
    text: str


class Message(Protocol):
    role: str
    content: str | Sequence[TextPart]


def message_text(message: Message) -> str:
    content = message.content
    return content if isinstance(content, str) else "".join(part.text for part in content)


def render_message(role: str, text: str) -> str:
    return f"<|{role}|>\n{text}\n"


def render_chat(messages: Sequence[Message]) -> str:
    return "".join(render_message(m.role, message_text(m)) for m in messages) + GENERATION_PROMPT

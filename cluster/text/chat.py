"""Chat templates: messages -> one prompt string, rendered as transformers'
`apply_chat_template` renders it.

The template comes from `--chat-template` (a file or an inline Jinja string), else the
checkpoint's `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or
a list of named templates: "default" is used). It is rendered in the same sandbox transformers
uses (`ImmutableSandboxedEnvironment`, `trim_blocks`, `lstrip_blocks`, loop controls, its
`tojson`, `raise_exception`, `strftime_now`) with the tokenizer's special-token strings
(`bos_token`, `eos_token`, ...), `messages` with None-valued keys dropped (so an assistant
`content: null` is simply absent, as transformers does) and reasoning fields aliased, `tools` and
`documents` None, and `add_generation_prompt`; `{% generation %}` blocks render their body. The result
is tokenized without adding special tokens: the template writes them itself.

The tiny byte-level checkpoint has no template; it gets `DEFAULT_TEMPLATE`:

    <|system|>\\n{content}\\n      one block per message, in order
    <|user|>\\n{content}\\n
    <|assistant|>\\n               the generation prompt, always last

Because a message renders the same wherever it sits, turn N's prompt followed by the reply it got
is an exact prefix of turn N+1's prompt, so a multi-turn chat hits the prefix cache. Content given
as a list of text parts is joined with newlines (as vLLM does for string templates).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal, Protocol

Role = Literal["system", "developer", "user", "assistant", "tool"]
DEFAULT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GENERATION_PROMPT = "<|assistant|>\n"


class ChatTemplateError(ValueError):
    """The template cannot be loaded, or rejects these messages (its `raise_exception`)."""


class TextPart(Protocol):
    text: str


class Message(Protocol):
    role: str
    content: str | Sequence[TextPart] | None


def message_text(message) -> str | None:
    content = message.get("content") if isinstance(message, dict) else message.content
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part["text"] if isinstance(part, dict) else part.text for part in content)


def message_dict(message) -> dict:
    """A message as the template sees it: plain JSON values, text parts joined, None keys dropped."""
    if isinstance(message, dict):
        data = dict(message)
    else:
        data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(vars(message))
    data["content"] = message_text(message if isinstance(message, dict) else data)
    data = {k: v for k, v in data.items() if v is not None}
    reasoning = next((data[k] for k in REASONING_FIELDS if data.get(k) is not None), None)
    if reasoning is not None:  # transformers fills the standard name and gpt-oss's `thinking`
        data = {"thinking": reasoning, **data, "reasoning_content": reasoning}
    return data


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, standard one first


def _generation_tag():
    """transformers' `{% generation %}...{% endgeneration %}` block (it marks assistant tokens for
    training masks); here it renders its body unchanged, as transformers does when not tracking."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    return GenerationTag


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template: syntax error line {exc.lineno}: {exc.message}") from None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "inline") -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        _compile(source)  # syntax errors now, not at the first request

    def render(self, messages: Sequence, add_generation_prompt: bool = True, **kwargs) -> str:
        import jinja2

        try:
            return _compile(self.source).render(
                messages=[message_dict(m) for m in messages], tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template ({self.origin}): {exc}") from None


def _from_config(value, origin: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ChatTemplateError(f"{origin}: chat_template must be a string or a list with a 'default' template")


def load_chat_template(model_dir: str | Path, override: str | None = None,
                       special_tokens: dict[str, str] | None = None,
                       default: str | None = None) -> ChatTemplate | None:
    """The template to use (see the module docstring), `default` when the checkpoint has none,
    or None (chat is then refused with a clear error)."""
    model_dir = Path(model_dir)
    if override:
        path = Path(override)
        try:
            is_file = path.is_file()
        except OSError:  # e.g. an inline template longer than a file name may be
            is_file = False
        if is_file:
            return ChatTemplate(path.read_text(), special_tokens, str(path))
        if "{" not in override:
            raise ChatTemplateError(f"--chat-template {override!r}: no such file (and not an inline template)")
        return ChatTemplate(override, special_tokens, "--chat-template")
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), special_tokens, str(jinja_file))
    config_file = model_dir / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as exc:
            raise ChatTemplateError(f"{config_file}: {exc}") from None
        if config.get("chat_template") is not None:
            return ChatTemplate(_from_config(config["chat_template"], str(config_file)), special_tokens,
                                str(config_file))
    return ChatTemplate(default, special_tokens, "built-in") if default is not None else None


def render_chat(messages: Sequence) -> str:
    """`messages` in the built-in template, with the generation prompt."""
    return ChatTemplate(DEFAULT_TEMPLATE).render(messages)

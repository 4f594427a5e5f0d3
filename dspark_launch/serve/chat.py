"""Chat messages -> prompt text with the checkpoint's `chat_template`, rendered as transformers'
`apply_chat_template(tokenize=False)` renders it: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks and loop controls, a `tojson` that does not escape HTML,
`raise_exception`, `strftime_now`, and the tokenizer's special tokens as variables.

The template comes from `chat_template.jinja` beside the checkpoint or the `chat_template` key of
`tokenizer_config.json` (a string, or a list of named templates: "default" is used).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template cannot render these messages (its own raise_exception, or a jinja error)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    raise ChatTemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str | None:
    """tokenizer_config special tokens are strings or AddedToken dicts ({"content": ...})."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = special_tokens

    @cached_property
    def _compiled(self) -> jinja2.Template:
        return _environment().from_string(self.source)

    @cached_property
    def takes_parts(self) -> bool:
        """The template loops over a message's content: it reads OpenAI's list of parts, so
        a client's parts reach it as sent. Otherwise (most text-only templates) it reads a
        string, and the server joins the parts' text (serve/requests.py: message): the rule
        vLLM and SGLang apply. Sent a list, a string template fails (Qwen2.5's
        `'...' + message['content']`) or renders nothing for it (Qwen3's)."""
        def is_content(expr: jinja2.nodes.Node) -> bool:
            """`x.content` or `x['content']`, through filters (`| selectattr(...)`), not a
            call on it (`.split('\n')` reads a string)."""
            while isinstance(expr, jinja2.nodes.Filter):
                expr = expr.node
            return (isinstance(expr, jinja2.nodes.Getattr) and expr.attr == "content"
                    or isinstance(expr, jinja2.nodes.Getitem)
                    and isinstance(expr.arg, jinja2.nodes.Const) and expr.arg.value == "content")

        try:
            tree = _environment().parse(self.source)
        except jinja2.TemplateError:
            return False  # render() answers it (a 400 naming the template's error)
        return any(is_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               **kwargs) -> str:
        """`kwargs` (a request's chat_template_kwargs) win over the special tokens,
        `tools` and `documents`, as vLLM's do (serve/requests.py lets them set
        add_generation_prompt too)."""
        variables = {**self.special_tokens, "tools": None, "documents": None,
                     "add_generation_prompt": add_generation_prompt, **kwargs}
        try:
            return self._compiled.render(messages=messages, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from None
        except Exception as err:  # the template's own TypeError, KeyError, ... on this input
            raise ChatTemplateError(f"the chat template failed on these messages: "
                                    f"{type(err).__name__}: {err}") from None

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        root = Path(model_dir)
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = None
        if (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text()
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in source}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k)))}
        return cls(source, special)

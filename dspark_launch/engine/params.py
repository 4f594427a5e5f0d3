"""Per-request sampling and stopping parameters (the OpenAI / vLLM field names).

The engine reads the token-level fields (temperature, top_k, top_p, seed, max_tokens,
min_tokens, stop_token_ids, ignore_eos); text-level stop strings are applied above the engine
by the output processor, which detokenizes and aborts the request when one appears.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (argmax)


class ParamError(ValueError):
    """A bad sampling parameter: `param` names the field, the message what is accepted."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None  # None: the engine's seed, keyed by the request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the text keeps what stopped it (stop string,
    # EOS or stop token): vLLM's field
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists/strings where tuples are meant (JSON and user code hand those in).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name) or ()
            if not isinstance(value, (list, tuple)):
                raise ParamError(name, f"{name}={value!r}: must be a list" + (
                    " or a string" if name == "stop" else ""))
            object.__setattr__(self, name, tuple(value))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        def bad(name: str, accepted: str) -> ParamError:
            return ParamError(name, f"{name}={getattr(self, name)!r}: {accepted}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 is greedy)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 turn it off)")
        # Any integer (OpenAI's and vLLM's clients send negative ones): request_key hashes
        # it down to 64 bits.
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer or null")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.n != 1:
            raise bad("n", "only n=1 is supported (send the request n times with other seeds)")

    def with_defaults(self, defaults: dict) -> SamplingParams:
        """Fill fields the caller left at their class default from e.g. generation_config.json."""
        names = {f.name for f in fields(self)}
        changes = {k: v for k, v in defaults.items()
                   if k in names and getattr(self, k) == getattr(SamplingParams, k, None)}
        return replace(self, **changes) if changes else self


def not_unicode(text: str) -> str | None:
    """Why `text` is no text a tokenizer takes, or None: a lone UTF-16 surrogate (JSON's
    "\\ud800" and Python strings allow one; the tokenizer raised a TypeError naming neither
    the prompt nor the character)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"holds {text[err.start]!r} at character {err.start}, a lone surrogate (not "
                f"Unicode text): send valid UTF-16 pairs or the character itself")
    return None


def outside_vocab(ids, vocab_size: int) -> list[int]:
    """The ids among `ids` that are no token of a vocabulary of `vocab_size`."""
    return [t for t in ids if not 0 <= t < vocab_size]


def refusal(prompt_ids, params: SamplingParams | None, context_limit: int,
            vocab_size: int) -> str | None:
    """Why a request cannot run (None: it can): what SamplingParams cannot check alone,
    the model's vocabulary and context. Token ids outside the vocabulary would index past
    the embedding or the logits (a min_tokens ban on stop_token_ids [5000] of a 2048-token
    vocabulary ended a server's step with an IndexError)."""
    if not prompt_ids:
        return "empty prompt"
    if bad := outside_vocab(prompt_ids, vocab_size):
        return f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
    if len(prompt_ids) >= context_limit:
        return (f"prompt of {len(prompt_ids)} tokens does not fit the context limit of "
                f"{context_limit} tokens (prompt + at least one new token)")
    if params is not None and (bad := outside_vocab(params.stop_token_ids, vocab_size)):
        return f"stop_token_ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
    return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

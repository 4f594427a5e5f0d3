"""Text out of committed tokens: incremental detokenization and stop strings.

Both run above the engine, identically on every rank, one token at a time, so the token that
completes a stop string is known exactly (a speculative round commits several at once).

IncrementalDetokenizer: byte-level BPE splits one character over several tokens, so decoding
each token alone would emit U+FFFD halves. Text is released only up to the last complete
character (the prefix/read-offset scheme of HF text streamers and vLLM): `decode(ids[prefix:])`
minus `decode(ids[prefix:read])`, without a trailing U+FFFD run (an unfinished character).
`finish()` flushes whatever is held, so the deltas concatenate to `tokenizer.decode(all ids)`;
but for a byte-fallback decoder (Llama-2, Mistral: `<0xNN>` tokens), which decodes a whole run
of byte tokens as U+FFFD once one byte in it is unfinished, characters already released
included: there the text ends at the last character released (vLLM's text, too).

StopStrings: generation ends at the first token after which a stop string is in the text; the
text is cut where the earliest-starting stop string present then starts (of several starting
there, the shortest), and is never emitted (with vLLM's include_stop_str_in_output: cut where
it ends). The order the stops are given in changes nothing.
While streaming, the last `len(longest stop) - 1` characters are held back, since they may be
the start of a stop string that the next token completes.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # ids[prefix:read] decode to text already emitted and end on a clean character
        # boundary; `pending` characters decoded past `read` were emitted too (the complete
        # characters in front of an unfinished one).
        self.prefix = 0
        self.read = 0
        self.pending = 0
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # token ids in and out (a checkpoint without a tokenizer)
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now certain (possibly "")."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        # Characters in front of an unfinished UTF-8 sequence are final; the sequence is not.
        stable = now.rstrip(REPLACEMENT) if now.endswith(REPLACEMENT) else now
        delta = stable[len(before) + self.pending:]
        self.pending += len(delta)
        self.text += delta
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self.prefix, self.read, self.pending = self.read, len(self.ids), 0
        return delta

    def finish(self) -> str:
        """The held tail (e.g. an unfinished character at max_tokens): the emitted text then
        equals the full decode, where that decode keeps what was released (above)."""
        full = self._decode(self.ids)
        # Released text is final: where the full decode rewrote it (byte fallback, above),
        # the unfinished tail is no character and stays out. Raising here lost the batch.
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        self.prefix = self.read = len(self.ids)
        self.pending = 0
        return delta


@dataclass
class StopStrings:
    """Cuts a text stream at the first stop string; holds back a possible partial match."""

    stops: tuple[str, ...]
    include: bool = False  # the stop string is part of the text (include_stop_str_in_output)
    text: str = ""  # everything received
    sent: int = 0  # characters of `text` already released
    matched: str | None = None  # the stop string that ended the stream

    @property
    def hold(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str, final: bool = False, armed: bool = True) -> str:
        """Add text; return what may be released. After a match, nothing more is released.
        `armed=False` (before min_tokens) adds text without looking for stop strings; a stop
        string counts only if it ends in text added while armed (vLLM's rule)."""
        if self.matched is not None:
            return ""
        old = len(self.text)
        self.text += delta
        cut, which = len(self.text), None
        for stop in self.stops if armed else ():
            # From the first start whose match ends in the new text: one ending before it
            # was ruled out while armed, or came before min_tokens (one window for all
            # stops, the longest's, let a short stop end in text from before min_tokens).
            at = self.text.find(stop, max(0, old - len(stop) + 1))
            # Stops starting at one place: the shortest (it ended first), whatever their
            # order, so the stops are a set (ranks may list a set in other orders).
            if at != -1 and (at < cut or at == cut and len(stop) < len(which)):
                cut, which = at, stop
        if which is not None:
            self.matched = which
            end = cut + len(which) if self.include else cut
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out


@dataclass
class TextDelta:
    text: str  # released text (possibly "")
    stopped: str | None  # the stop string that ended the request, if one did


class TextStream:
    """One request's text: detokenize token by token, then cut at stop strings."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = StopStrings(tuple(stops), include_stop)
        self.min_tokens = min_tokens

    @property
    def text(self) -> str:
        """The released text so far."""
        return self.stops.text[:self.stops.sent]

    @property
    def armed(self) -> bool:
        """Stop strings count after min_tokens tokens, as the engine's stop tokens (and
        vLLM's stop strings) do: from token min_tokens + 1 on."""
        return len(self.detok.ids) > self.min_tokens

    def push(self, token_id: int) -> TextDelta:
        delta = self.detok.push(token_id)
        out = self.stops.feed(delta, armed=self.armed)
        return TextDelta(out, self.stops.matched)

    def finish(self) -> TextDelta:
        """Flush at the end of the request (no stop string matched before); the held tail
        may still complete one."""
        out = self.stops.feed(self.detok.finish(), final=True, armed=self.armed)
        return TextDelta(out, self.stops.matched)

"""Incremental detokenization and stop strings, with the embedded model's real tokenizer.

Oracles: `tokenizer.decode(all ids)` for the streamed text, and `text[:text.find(stop)]` (the
earliest stop string) for the cut.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from dspark_launch.detokenize import REPLACEMENT, IncrementalDetokenizer, StopStrings, TextStream

TOKENIZER = Path(__file__).resolve().parents[2] / "dspark_launch/assets/tiny/target/tokenizer.json"
TOK = Tokenizer.from_file(str(TOKENIZER))
VOCAB = TOK.get_vocab_size()
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Multi-byte characters (2, 3 and 4 bytes in UTF-8) among ASCII, so characters straddle tokens.
TEXT = st.text(alphabet=st.sampled_from(list("ab c\n.=_(") + list("éß中文🙂ä€")), max_size=40)


def stream(ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(TOK, skip_special_tokens)
    deltas = [detok.push(t) for t in ids]
    return deltas + [detok.finish()]


@SETTINGS
@given(st.lists(st.integers(0, VOCAB - 1), max_size=60), st.booleans())
def test_any_token_sequence_streams_to_the_full_decode(ids, skip):
    # Random ids include lone UTF-8 lead/continuation bytes and the special tokens.
    assert "".join(stream(ids, skip)) == TOK.decode(ids, skip_special_tokens=skip)


@SETTINGS
@given(TEXT)
def test_no_delta_holds_a_broken_character(text):
    ids = TOK.encode(text).ids
    deltas = stream(ids)
    assert "".join(deltas) == text  # byte-level BPE round-trips exactly
    assert not any(REPLACEMENT in d for d in deltas)


def test_a_character_split_over_tokens_is_held_until_complete():
    ids = TOK.encode("🙂").ids
    assert len(ids) > 1  # the emoji's 4 bytes are several tokens in this small vocabulary
    deltas = stream(ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🙂" and deltas[-1] == ""


def test_finish_flushes_an_unfinished_character():
    ids = TOK.encode("a🙂").ids[:-1]  # stopped by max_tokens in the middle of the emoji
    deltas = stream(ids)
    assert deltas[0] == "a" and "".join(deltas) == TOK.decode(ids)
    assert deltas[-1].startswith(REPLACEMENT)


def first_stop(ids: list[int], stops: list[str]) -> tuple[str, int | None]:
    """(text, tokens used): generation ends at the first token after which some stop string is
    certainly in the text (in front of any unfinished character); the text is cut where the
    earliest-starting stop string present then starts. No stop string: the whole text."""
    for k in range(1, len(ids) + 1):
        text = TOK.decode(ids[:k]).rstrip(REPLACEMENT)
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[:min(found)], k
    return TOK.decode(ids), None


def run_stream(ids: list[int], stops: list[str]) -> tuple[str, str | None, int]:
    """(released text, matched stop, tokens consumed) through TextStream token by token."""
    ts = TextStream(TOK, tuple(stops))
    out, used = "", 0
    for t in ids:
        d = ts.push(t)
        out += d.text
        used += 1
        if d.stopped is not None:
            return out, d.stopped, used
    tail = ts.finish()
    return out + tail.text, tail.stopped, used


@SETTINGS
@given(TEXT, st.integers(0, 40), st.integers(1, 6))
def test_one_stop_string_cuts_where_it_first_starts(text, start, length):
    stop = text[start:start + length]
    if not stop:
        return
    ids = TOK.encode(text).ids
    full = TOK.decode(ids)
    out, matched, _ = run_stream(ids, [stop])
    assert out == full[:full.find(stop)] and matched == stop


@SETTINGS
@given(TEXT, st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), min_size=1, max_size=3),
       st.lists(st.text(alphabet="xyé", min_size=1, max_size=3), max_size=2))
def test_several_stop_strings_end_at_the_first_that_appears(text, spans, absent):
    # Stops taken from the text itself (so they occur, often spanning several tokens) plus
    # some that may not occur at all.
    stops = [text[a:a + n] for a, n in spans if text[a:a + n]] + absent
    if not stops:
        return
    ids = TOK.encode(text).ids
    out, matched, used = run_stream(ids, stops)
    expected, k = first_stop(ids, stops)
    assert out == expected
    if k is None:
        assert matched is None
    else:
        assert used == k and matched in stops


@SETTINGS
@given(TEXT, st.integers(0, 40), st.lists(st.integers(1, 6), min_size=2, max_size=3),
       st.booleans())
def test_the_order_stops_are_given_in_changes_nothing(text, start, lengths, include):
    """Stops starting at one place and ending in one token: the first listed won, so ranks
    listing a set (`stop=list({...})`, other orders per process) cut other texts and named
    other stops. Now the shortest wins, in any order."""
    stops = list(dict.fromkeys(text[start:start + n] for n in lengths if text[start:start + n]))
    ids = TOK.encode(text).ids
    runs = {_until_stop(TextStream(TOK, tuple(order), include_stop=include), ids)
            for order in (stops, stops[::-1])}
    assert len(runs) == 1


def test_of_stops_starting_at_one_place_the_shortest_ends_the_text():
    word = next(w for w in ("hello", "return", "the") if len(TOK.encode(w).ids) == 1)
    for order in ((word[:2], word), (word, word[:2])):
        assert _until_stop(TextStream(TOK, order, include_stop=True),
                           TOK.encode(word).ids) == (word[:2], word[:2])


def test_multi_token_stop_straddling_a_token_end():
    text = "x = foo(bar)\nreturn bar"
    ids = TOK.encode(text).ids
    stop = "o(ba"  # starts inside one token and ends inside another
    out, matched, used = run_stream(ids, [stop])
    assert (out, matched) == ("x = fo", stop)
    assert used < len(ids)  # the stream ended at the completing token, not at the end


def test_partial_stop_at_the_end_is_released_on_finish():
    ids = TOK.encode("hello wor").ids
    out, matched, _ = run_stream(ids, ["world"])
    assert (out, matched) == ("hello wor", None)


def test_stop_strings_wait_for_min_tokens():
    ids = TOK.encode("ab ab ab").ids
    ts = TextStream(TOK, ("ab",), min_tokens=len(TOK.encode("ab ab").ids))
    out = ""
    for t in ids:
        d = ts.push(t)
        out += d.text
        if d.stopped:
            break
    # The first two "ab" end in the first min_tokens tokens; the third one stops the stream
    # (a stop counts from token min_tokens + 1 on, as a stop token does, and as in vLLM).
    assert out == "ab ab " and d.stopped == "ab"


def _until_stop(ts: TextStream, ids: list[int]) -> tuple[str, str | None]:
    out = ""
    for t in ids:
        d = ts.push(t)
        out += d.text
        if d.stopped:
            return out, d.stopped
    return out + ts.finish().text, None


def test_min_tokens_one_lets_the_first_token_hold_a_stop_string():
    """min_tokens=1 did nothing for stop strings (armed from token min_tokens on): a first
    token of "\n" ended the request with stop=["\n"] and min_tokens=1."""
    ids = TOK.encode("\nab\ncd").ids
    assert TOK.decode(ids[:1]) == "\n"
    assert _until_stop(TextStream(TOK, ("\n",), min_tokens=0), ids) == ("", "\n")
    assert _until_stop(TextStream(TOK, ("\n",), min_tokens=1), ids) == ("\nab", "\n")


def test_a_short_stop_among_longer_ones_waits_for_min_tokens_too():
    """Every stop was searched from the longest one's window: after min_tokens, a short stop
    that ended in text from before min_tokens matched (adding an unrelated long stop string
    changed the output)."""
    ids = TOK.encode("a\nb c d e f g").ids
    alone = _until_stop(TextStream(TOK, ("\n",), min_tokens=3), ids)
    among = _until_stop(TextStream(TOK, ("\n", "never appears in this text"), min_tokens=3),
                        ids)
    assert alone == among == (TOK.decode(ids), None)


def test_a_byte_fallback_tokenizer_with_a_character_cut_at_the_end():
    """Llama-2 / Mistral tokenizers decode a run of <0xNN> byte tokens as U+FFFD throughout
    once one byte in it is unfinished, characters already released included: finish()
    raised (the whole batch lost). The released text stays; a completed character streams
    to the full decode."""
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({"\u2581": 259, "\u2581a": 260})
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    a, e_acute, han = [260], [3 + 0xC3, 3 + 0xA9], [3 + 0xE4, 3 + 0xB8, 3 + 0xAD]
    cut = a + e_acute + han[:1]  # max_tokens ends inside 中
    assert tok.decode(cut) == "a" + REPLACEMENT * 3  # é rewritten too
    assert _until_stop(TextStream(tok), cut) == ("aé", None)
    assert _until_stop(TextStream(tok), a + e_acute + han) == ("aé中", None)
    assert tok.decode(a + e_acute + han) == "aé中"


@pytest.mark.parametrize("chunks", [["abc", "de"], ["a", "b", "c", "d", "e"], ["abcde"]])
def test_stop_strings_hold_back_only_a_possible_prefix(chunks):
    s = StopStrings(("cdx",))
    released = [s.feed(c) for c in chunks]
    assert "".join(released) == "abc"  # len("cdx") - 1 = 2 characters held back
    assert s.feed("", final=True) == "de"

"""Validated wire requests -> what the engine takes: prompt token ids and SamplingParams.

Every check names the field it refuses; nothing here touches the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from dspark_launch.engine.params import (
    ParamError,
    SamplingParams,
    not_unicode,
    outside_vocab,
)
from dspark_launch.serve.chat import ChatTemplate, ChatTemplateError
from dspark_launch.serve.errors import APIError, bad_request, model_not_found
from dspark_launch.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer knows about the served model."""

    name: str
    tokenizer: object
    vocab_size: int
    context_limit: int  # prompt + output tokens per request
    defaults: dict  # SamplingParams fields from generation_config.json
    chat_template: ChatTemplate | None
    model_dir: str

    @cached_property
    def max_prompt_chars(self) -> int | None:
        """Characters past which a text cannot fit the context, known without tokenizing it
        (a 10 MB prompt took 19 s of CPU and 1.6 GiB for its 4M tokens before its 400), where
        the tokenizer drops no character: then a token covers at most as many characters as
        its vocabulary entry has (bytes in byte-level BPE), and a Unicode normalizer folds at
        most a few into one (NFC composes a letter and its marks). None (no bound) for a
        tokenizer that may drop or merge text (whitespace-removing pre-tokenizers, Strip or
        Replace normalizers, stripping added tokens, merged unknowns)."""
        try:
            spec = json.loads(self.tokenizer.to_str())
            longest = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)))
        except AttributeError:
            return None
        if not _keeps_characters(spec):
            return None
        return self.context_limit * longest * (1 if spec.get("normalizer") is None else 4)


# Tokenizer parts that keep every character of the text in some token.
KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Prepend", "Sequence"}
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                          "Sequence"}


def _keeps_characters(spec: dict) -> bool:
    """Whether a tokenizer.json maps every character of a text into some token."""
    def parts(node: dict | None, key: str) -> list[dict]:
        if node is None:
            return []
        return [p for child in node.get(key, []) for p in parts(child, key)] \
            if node["type"] == "Sequence" else [node]

    normalizers = parts(spec.get("normalizer"), "normalizers")
    pre = parts(spec.get("pre_tokenizer"), "pretokenizers")
    model = spec.get("model") or {}
    byte_level = any(p["type"] == "ByteLevel" for p in pre)
    return (all(n["type"] in KEEPING_NORMALIZERS for n in normalizers)
            and all(p["type"] in KEEPING_PRE_TOKENIZERS
                    and p.get("behavior", "Isolated") != "Removed" for p in pre)
            and not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", []))
            and model.get("type") == "BPE" and (byte_level or model.get("byte_fallback")))


# Fields this server does not implement, and the values that leave them off. Set otherwise,
# a request is refused naming the field: ignored, its answer would not be what was asked for
# (a logit_bias, a JSON response_format, tool calls).
UNSUPPORTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "best_of": (None, 1), "suffix": (None, ""), "response_format": (None, {"type": "text"}),
    "tools": (None, []), "tool_choice": (None, "none", "auto"),
}


def _off(value, offs: tuple) -> bool:
    # type and value: logprobs 0 (the sampled token's logprob) is not logprobs False
    return any(type(value) is type(off) and value == off for off in offs)


def sampling_params(req: SamplingFields, info: ModelInfo, max_tokens: int | None,
                    max_tokens_name: str = "max_tokens") -> SamplingParams:
    """The client's fields over the checkpoint's defaults; unset fields take the defaults.
    `max_tokens_name`: the field the client gave max_tokens as (chat's
    max_completion_tokens), which a refusal names."""
    for name, offs in UNSUPPORTED.items():
        if not _off(getattr(req, name), offs):
            shown = " or ".join(json.dumps(off) for off in offs[1:])
            raise bad_request(f"{name}={getattr(req, name)!r}: not supported by this server "
                              f"(leave it out or send {shown})", name)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"{name}={getattr(req, name)}: penalties are not supported "
                              f"(use 0)", name)
    fields = dict(info.defaults)
    for name in ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n",
                 "ignore_eos", "min_tokens", "skip_special_tokens",
                 "include_stop_str_in_output"):
        if name in req.model_fields_set and getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    fields.setdefault("max_tokens", 16)  # OpenAI's default for completions
    try:
        params = SamplingParams(**fields)
    except ParamError as err:  # max_tokens named as sent, in min_tokens' range too
        param = max_tokens_name if err.param == "max_tokens" else err.param
        raise bad_request(str(err).replace("max_tokens=", f"{max_tokens_name}="),
                          param) from None
    if bad := outside_vocab(params.stop_token_ids, info.vocab_size):
        raise bad_request(f"stop_token_ids holds token ids {bad[:5]} outside the vocabulary "
                          f"[0, {info.vocab_size})", "stop_token_ids")
    return params


def check_model(name: str | None, info: ModelInfo) -> None:
    if name is not None and name != info.name:
        raise model_not_found(name, info.name)


def _check_ids(ids: list[int], info: ModelInfo, param: str) -> list[int]:
    if not ids:
        raise bad_request(f"{param} is empty; give at least one token", param)
    if bad := outside_vocab(ids, info.vocab_size):
        raise bad_request(f"{param} holds token ids {bad[:5]} outside the vocabulary "
                          f"[0, {info.vocab_size})", param)
    if len(ids) >= info.context_limit:
        raise bad_request(
            f"{param} is {len(ids)} tokens; the context holds {info.context_limit} tokens "
            f"(prompt + at least one new token), so prompts must be shorter than that", param)
    return ids


def check_room(ids: list[int], max_tokens: int, info: ModelInfo, param: str,
               max_tokens_name: str) -> None:
    """A prompt and the max_tokens the client asked for must fit the context together
    (vLLM's 400): cut short, the answer would end at "length" before what was asked."""
    if len(ids) + max_tokens > info.context_limit:
        raise bad_request(
            f"{param} is {len(ids)} tokens and {max_tokens_name}={max_tokens} asks for "
            f"{len(ids) + max_tokens} in all; the context holds {info.context_limit} tokens "
            f"(prompt + output): ask for at most {info.context_limit - len(ids)} new tokens, "
            f"or shorten the prompt", max_tokens_name)


def encode(text: str, info: ModelInfo, param: str, add_special_tokens: bool) -> list[int]:
    """A prompt's token ids; a text the tokenizer would raise on (a lone surrogate) is a 400.
    Runs off the event loop (app.py: asyncio.to_thread) and through encode_batch, which lets
    go of the GIL while it works (encode holds it: an 8 MB prompt stalled every other request
    and /health for 7 s before its 400)."""
    if info.max_prompt_chars is not None and len(text) > info.max_prompt_chars:
        raise bad_request(f"{param} is {len(text)} characters, more than the context of "
                          f"{info.context_limit} tokens can hold", param)
    if why := not_unicode(text):
        raise bad_request(f"{param} {why}", param)
    return info.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def completion_prompts(req: CompletionRequest, info: ModelInfo
                       ) -> list[tuple[list[int], str | None]]:
    """(token ids, text) per prompt of the batch."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt is an empty list", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            # With the tokenizer's special tokens (a BOS where it adds one), as the CLI job
            # and vLLM's completions do; a chat prompt's come from its template
            ids = encode(item, info, "prompt", add_special_tokens=True)
            out.append((_check_ids(ids, info, "prompt"), item))
        else:
            out.append((_check_ids(list(item), info, "prompt"), None))
    return out


def message(m: ChatMessage, parts: bool) -> dict:
    """A chat message as its template reads it: the fields the client sent (a null content
    stays None, and extras such as tool_calls pass through), and text parts as a list where
    the template takes `parts` (ChatTemplate.takes_parts), else joined with newlines."""
    out = m.model_dump(exclude_unset=True)
    if isinstance(m.content, list) and not parts:
        out["content"] = "\n".join(part.text for part in m.content)
    return out


def chat_prompt(req: ChatCompletionRequest, info: ModelInfo) -> tuple[list[int], str]:
    if info.chat_template is None:
        raise APIError(400, f"the model {info.name!r} has no chat_template (neither "
                       f"chat_template.jinja nor a 'chat_template' key in "
                       f"{info.model_dir}/tokenizer_config.json); use /v1/completions or "
                       f"serve a checkpoint with a chat template", "messages",
                       code="chat_template_missing")
    kwargs = dict(req.chat_template_kwargs or {})
    if "messages" in kwargs:
        raise bad_request("chat_template_kwargs may not set 'messages'; send them as messages",
                          "chat_template_kwargs")
    generation = kwargs.pop("add_generation_prompt", req.add_generation_prompt)
    for i, m in enumerate(req.messages):  # named where the client wrote it, not at a
        # position in the rendered text (encode's check)
        texts = {f"messages[{i}].content": m.content} if isinstance(m.content, str) else {
            f"messages[{i}].content[{j}].text": part.text for j, part in enumerate(m.content or [])}
        for where, text in texts.items():
            if why := not_unicode(text):
                raise bad_request(f"{where} {why}", where)
    try:
        parts = info.chat_template.takes_parts
        text = info.chat_template.render([message(m, parts) for m in req.messages],
                                         generation, **kwargs)
    except ChatTemplateError as err:
        raise bad_request(str(err), "messages") from None
    ids = encode(text, info, "messages", add_special_tokens=False)
    return _check_ids(ids, info, "messages"), text

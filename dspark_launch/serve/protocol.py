"""The OpenAI wire format (the field names of /v1/completions and /v1/chat/completions).

Requests are validated strictly: a known field of the wrong type ("max_tokens": "5") is a 400
naming the field, while unknown fields are ignored (clients send vendor extras). Besides the
OpenAI fields, requests take vLLM's extras (top_k, min_tokens, stop_token_ids, ignore_eos,
skip_special_tokens), and every choice carries `meta_info` with the speculative statistics.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

Number = StrictFloat  # takes ints too (as floats); a union named only its int branch's error


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields both endpoints share; mapped to SamplingParams by serve/requests.py."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    # Not supported: refused by name unless off (serve/requests.py UNSUPPORTED); typed
    # loosely so that any value gets that answer
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    best_of: Any = None
    suffix: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None


class CompletionRequest(SamplingFields):
    # One prompt as text or token ids, or a batch of either (one choice each).
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool = False


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    # Fields a template may read beyond these (tool_calls, tool_call_id, ...) pass through.
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None  # the newer name for max_tokens
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class MetaInfo(BaseModel):
    """Per-choice speculative statistics (SGLang calls its extra field `meta_info` too).

    accept_lens: tokens committed per verify round (accepted drafts + 1, cut at a stop);
    mean_tau: their mean; rounds: their count; output_token_ids: the completion's tokens."""

    accept_lens: list[int]
    rounds: int
    mean_tau: float | None
    prompt_tokens: int
    completion_tokens: int
    preemptions: int = 0
    ttft_s: float | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended the choice
    output_token_ids: list[int] = []


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V the prefix cache held


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None
    meta_info: MetaInfo | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None
    meta_info: MetaInfo | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    meta_info: MetaInfo | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark-launch"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

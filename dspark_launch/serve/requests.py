"""Validated wire requests -> what the engine takes: prompt token ids and SamplingParams.

Every check names the field it refuses; nothing here touches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_launch.engine.params import ParamError, SamplingParams
from dspark_launch.serve.chat import ChatTemplate, ChatTemplateError
from dspark_launch.serve.errors import APIError, bad_request, model_not_found
from dspark_launch.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


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


def sampling_params(req: SamplingFields, info: ModelInfo, max_tokens: int | None
                    ) -> SamplingParams:
    """The client's fields over the checkpoint's defaults; unset fields take the defaults."""
    if req.logprobs not in (None, False):
        raise bad_request(f"logprobs={req.logprobs!r}: log probabilities are not supported",
                          "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"{name}={getattr(req, name)}: penalties are not supported "
                              f"(use 0)", name)
    fields = dict(info.defaults)
    for name in ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n",
                 "ignore_eos", "min_tokens", "skip_special_tokens"):
        if name in req.model_fields_set and getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    fields.setdefault("max_tokens", 16)  # OpenAI's default for completions
    try:
        return SamplingParams(**fields)
    except ParamError as err:
        raise bad_request(str(err), err.param) from None


def check_model(name: str | None, info: ModelInfo) -> None:
    if name is not None and name != info.name:
        raise model_not_found(name, info.name)


def _check_ids(ids: list[int], info: ModelInfo, param: str) -> list[int]:
    if not ids:
        raise bad_request(f"{param} is empty; give at least one token", param)
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise bad_request(f"{param} holds token ids {bad[:5]} outside the vocabulary "
                          f"[0, {info.vocab_size})", param)
    if len(ids) >= info.context_limit:
        raise bad_request(
            f"{param} is {len(ids)} tokens; the context holds {info.context_limit} tokens "
            f"(prompt + at least one new token), so prompts must be shorter than that", param)
    return ids


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
            ids = info.tokenizer.encode(item, add_special_tokens=False).ids
            out.append((_check_ids(ids, info, "prompt"), item))
        else:
            out.append((_check_ids(list(item), info, "prompt"), None))
    return out


def chat_prompt(req: ChatCompletionRequest, info: ModelInfo) -> tuple[list[int], str]:
    if info.chat_template is None:
        raise APIError(400, f"the model {info.name!r} has no chat_template (neither "
                       f"chat_template.jinja nor a 'chat_template' key in "
                       f"{info.model_dir}/tokenizer_config.json); use /v1/completions or "
                       f"serve a checkpoint with a chat template", "messages",
                       code="chat_template_missing")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        text = info.chat_template.render(messages, req.add_generation_prompt,
                                         **(req.chat_template_kwargs or {}))
    except ChatTemplateError as err:
        raise bad_request(str(err), "messages") from None
    ids = info.tokenizer.encode(text, add_special_tokens=False).ids
    return _check_ids(ids, info, "messages"), text

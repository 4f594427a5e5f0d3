"""Chat template rendering against transformers' own apply_chat_template (the oracle)."""

from __future__ import annotations

import pytest
from chat_assets import EMBEDDED, TEMPLATE, with_template

from dspark_launch.serve.chat import ChatTemplate, ChatTemplateError

CONVERSATIONS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "system", "content": "You write Python."},
     {"role": "user", "content": "héllo 中文 🙂"},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": [{"type": "text", "text": "part one, "},
                                  {"type": "text", "text": "part two"}]}],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return with_template(tmp_path_factory.mktemp("chat") / "target")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_transformers(checkpoint, messages, add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(checkpoint))
    ours = ChatTemplate.from_checkpoint(checkpoint)
    for extra in ({}, {"meta": {"x": "é<b>", "n": [1, 2]}}):
        expected = hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt, **extra)
        assert ours.render(messages, add_generation_prompt, **extra) == expected


def test_no_template_is_none():
    assert ChatTemplate.from_checkpoint(EMBEDDED) is None


def test_template_exceptions_name_the_problem(checkpoint):
    ours = ChatTemplate.from_checkpoint(checkpoint)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ours.render([{"role": "tool", "content": "x"}])


def test_named_template_list_uses_default(tmp_path):
    path = with_template(tmp_path / "t", template=[{"name": "tool_use", "template": "x"},
                                                   {"name": "default", "template": TEMPLATE}])
    assert ChatTemplate.from_checkpoint(path).source == TEMPLATE


# Qwen2.5's way: the content is concatenated, so it must be a string.
STRING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A template that loops over OpenAI's content parts.
PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PARTS = [{"type": "text", "text": "part one,"}, {"type": "text", "text": "part two"}]


def _served(path):
    from tokenizers import Tokenizer

    from dspark_launch.serve.requests import ModelInfo

    return ModelInfo(name="tiny", tokenizer=Tokenizer.from_file(str(path / "tokenizer.json")),
                     vocab_size=2048, context_limit=2048, defaults={},
                     chat_template=ChatTemplate.from_checkpoint(path), model_dir=str(path))


@pytest.mark.parametrize("template,sent_as", [(STRING_TEMPLATE, "joined"),
                                              (PARTS_TEMPLATE, "parts"),
                                              (TEMPLATE, "joined")])
def test_content_parts_reach_a_template_as_it_reads_them(tmp_path, template, sent_as):
    """A template that loops over a message's content gets the parts as sent; any other
    (Qwen2.5's concatenation failed on a list with a 500) gets their text joined with
    newlines (vLLM's and SGLang's rule); chat_template_kwargs win over the template's
    variables, add_generation_prompt included. Oracle: transformers' apply_chat_template on
    the messages so given."""
    from transformers import AutoTokenizer

    from dspark_launch.serve.protocol import ChatCompletionRequest
    from dspark_launch.serve.requests import chat_prompt

    path = with_template(tmp_path / "t", template=template)
    hf = AutoTokenizer.from_pretrained(str(path))
    content = "part one,\npart two" if sent_as == "joined" else PARTS
    for kwargs in ({}, {"add_generation_prompt": False}):
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": PARTS}],
             "chat_template_kwargs": kwargs})
        _, text = chat_prompt(req, _served(path))
        expected = hf.apply_chat_template(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}],
            tokenize=False, add_generation_prompt=kwargs.get("add_generation_prompt", True))
        assert text == expected


def test_a_template_failing_on_the_messages_and_a_kwarg_for_messages_are_400s(tmp_path):
    from dspark_launch.serve.errors import APIError
    from dspark_launch.serve.protocol import ChatCompletionRequest
    from dspark_launch.serve.requests import chat_prompt

    info = _served(with_template(tmp_path / "t", template=STRING_TEMPLATE))
    null = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "assistant", "content": None}]})  # '...' + None: a TypeError
    with pytest.raises(APIError) as err:
        chat_prompt(null, info)
    assert (err.value.status, err.value.param) == (400, "messages")
    assert "TypeError" in err.value.message
    twice = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}})
    with pytest.raises(APIError) as err:
        chat_prompt(twice, info)
    assert (err.value.status, err.value.param) == (400, "chat_template_kwargs")


def test_takes_parts_only_where_a_loop_reads_the_content_itself():
    """A loop over `content` (through a filter) reads OpenAI's parts; a loop over a string
    method's result reads a string, and a template that does not parse is render()'s to
    refuse (a 400), not a server error."""
    loops = {"{% for p in m['content'] %}{{ p.text }}{% endfor %}": True,
             "{% for p in m.content | selectattr('type') %}{{ p.text }}{% endfor %}": True,
             "{% for line in m['content'].split('\\n') %}{{ line }}{% endfor %}": False,
             "{{ m.content }}": False}
    for body, parts in loops.items():
        source = "{% for m in messages %}" + body + "{% endfor %}"
        assert ChatTemplate(source, {}).takes_parts is parts, body
    broken = ChatTemplate("{% for m in messages %}{{ m.content }", {})
    assert broken.takes_parts is False
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        broken.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("content, named", [
    ("ok \ud800", "messages[1].content"),
    ([{"type": "text", "text": "ok"}, {"type": "text", "text": "\udfff"}],
     "messages[1].content[1].text"),
])
def test_a_lone_surrogate_is_named_where_the_client_wrote_it(checkpoint, content, named):
    """It was named at its position in the rendered template text ("messages holds ... at
    character 57"), which the client never sent."""
    from dspark_launch.serve.errors import APIError
    from dspark_launch.serve.protocol import ChatCompletionRequest
    from dspark_launch.serve.requests import chat_prompt

    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": content}]})
    with pytest.raises(APIError) as err:
        chat_prompt(req, _served(checkpoint))
    assert err.value.param == named and err.value.status == 400
    assert err.value.message.startswith(f"{named} holds ")

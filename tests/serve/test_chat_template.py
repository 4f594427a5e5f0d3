"""Chat template rendering against transformers' own apply_chat_template (the oracle)."""

from __future__ import annotations

import pytest
from chat_assets import EMBEDDED, with_template

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
    from chat_assets import TEMPLATE

    path = with_template(tmp_path / "t", template=[{"name": "tool_use", "template": "x"},
                                                   {"name": "default", "template": TEMPLATE}])
    assert ChatTemplate.from_checkpoint(path).source == TEMPLATE

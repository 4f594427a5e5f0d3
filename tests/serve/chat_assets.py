"""A test copy of the embedded target checkpoint with a chat template added."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EMBEDDED = Path(__file__).resolve().parents[2] / "dspark_launch/assets/tiny/target"

# ChatML as Qwen writes it, plus what real templates use: namespace, loop controls, tojson,
# raise_exception and the special-token variables.
TEMPLATE = (
    "{% set ns = namespace(system=false) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'system' %}{% set ns.system = true %}{% endif %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + text + '<|im_end|>' + '\n' }}"
    "{% if loop.index > 50 %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if meta is defined %}# {{ meta | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    "{% if not ns.system %}{{ eos_token }}{% endif %}"
)


def with_template(dest: Path, template: str = TEMPLATE) -> Path:
    """Copy the embedded target (weights linked, not copied) and add `chat_template`."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in EMBEDDED.iterdir():
        target = dest / f.name
        if f.suffix == ".safetensors":
            if not target.exists():
                target.symlink_to(f)
        else:
            shutil.copy(f, target)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return dest

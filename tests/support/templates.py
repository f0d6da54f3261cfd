"""Tokenizer folders whose chat template differs from the fixture's in one known way.

`thinking_off_by_default(src, dst)`: the same tokenizer, but the generation prompt closes the
reasoning at once (`<think></think>`) unless the template kwarg `thinking` is true.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

THINKING_ON = (
    "{%- if thinking is defined and thinking is false -%}<think></think>"
    "{%- else -%}<think>{%- endif -%}"
)
THINKING_OFF = (
    "{%- if thinking is defined and thinking -%}<think>{%- else -%}<think></think>{%- endif -%}"
)


def thinking_off_by_default(src: Path, dst: Path) -> Path:
    """A copy of the tokenizer folder src at dst whose template thinks only when asked."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    config_file = dst / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    template = config["chat_template"]
    if THINKING_ON not in template:
        raise ValueError(f"the chat template in {src} has no thinking switch to turn")
    config["chat_template"] = template.replace(THINKING_ON, THINKING_OFF)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return dst

"""Real model chat templates for the oracle tests, fetched at test time, never kept in the repo.

axolotl's wheel ships the chat templates of the model families it trains (as the models publish
them) under `axolotl/utils/chat_templates/templates/`. `real_template(name)` fetches the wheel
once with `pip download axolotl==<version> --no-deps` into `<repo>/.cache/axolotl-wheel` and
extracts that one template beside it, as tests.support.sglang_contract does with SGLang's wheel.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

from tests.support import sglang_contract

AXOLOTL_VERSION = "0.19.0"
CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "axolotl-wheel"
MEMBER_DIR = "axolotl/utils/chat_templates/templates"

# oracle family → the wheel's template file: strict alternation with a system-in-first-user
# fold (Gemma-3), strict alternation with a system prompt of its own (Mistral-Small-3.x's
# v7-tekken), tools in the system turn and reasoning in history (Qwen3.5), headers per role
# and tools in the first user turn (Llama-4), Phi-4's default system prompt and role tags
REAL_FAMILIES = {
    "real-gemma-3": "gemma3.jinja",
    "real-mistral-v7-tekken": "mistral_v7_tekken.jinja",
    "real-llama-4": "llama4.jinja",
    "real-qwen3.5": "qwen3_5.jinja",
    "real-phi-4": "phi_4.jinja",
}


def real_template(family: str) -> str:
    """The chat template of a REAL_FAMILIES family, as the wheel ships it."""
    name = REAL_FAMILIES[family]
    target = CACHE_DIR / f"templates-{AXOLOTL_VERSION}" / name
    if not target.exists():
        with zipfile.ZipFile(
            sglang_contract.fetch_wheel("axolotl", AXOLOTL_VERSION, CACHE_DIR)
        ) as wheel:
            source = wheel.read(f"{MEMBER_DIR}/{name}")
        target.parent.mkdir(parents=True, exist_ok=True)
        # write then rename: concurrent test processes never see half a file
        handle, temporary = tempfile.mkstemp(dir=target.parent, suffix=".part")
        with os.fdopen(handle, "wb") as out:
            out.write(source)
        os.replace(temporary, target)
    return target.read_text(encoding="utf-8")

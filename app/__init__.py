"""tokenmill's core: settings, ledger, SGLang client, tokenization, errors and contracts.

`celery -A app worker` finds the Celery application here (created lazily, never connecting).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "celery":
        from app.celery_app import celery_app

        return celery_app
    raise AttributeError(name)

"""The servers' own limits as the engine reads them: each server's context length from its
/server_info (for `tokenmill run` and `tokenmill enqueue`, which hold prompts to it), and the
line a worker writes at start when its server's differs from the model folder the server
loaded (its `config.json`, read where the worker runs: beside the server)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.core.errors import GenerationError
from app.core.settings import Settings
from app.prompts.tokenizer_config import context_length_of as folder_context_of
from app.sglang import client as sglang_client
from app.sglang.client import client_for
from app.sglang.limits import context_length_of


def server_contexts(settings: Settings, urls: dict[str, str]) -> dict[str, int | None]:
    """Each named server's context length from its /server_info (None: it does not say, or
    does not answer now: the tokenizer folder's holds for it)."""

    def read(url: str) -> int | None:
        try:
            with client_for(url, settings) as client:
                return context_length_of(client.server_info())
        except GenerationError:
            return None

    if not urls:
        return {}
    with ThreadPoolExecutor(len(urls), thread_name_prefix="tm-limits") as pool:
        found = list(pool.map(read, urls.values()))
    return dict(zip(urls, found, strict=True))


def context_line(server_name: str, client: sglang_client.SGLangClient) -> str | None:
    """What a worker says at start about its server's context length: the server's and, when
    its model folder's config.json is here and says otherwise, that one (None: the server does
    not say, or does not answer now)."""
    try:
        info = client.server_info()
    except GenerationError:
        return None
    served = context_length_of(info)
    if served is None:
        return None
    said = f"server {server_name}'s context length is {served} (its --context-length)"
    model_path = info.get("model_path")
    folder = Path(model_path) if isinstance(model_path, str) and model_path else None
    own = folder_context_of(None, folder) if folder is not None and folder.is_dir() else None
    if own is None or own == served:
        return said
    return (
        f"{said}, not the {own} of its model folder's config.json ({folder}): "
        f"`tokenmill enqueue` holds prompts to {served}, the server's"
    )

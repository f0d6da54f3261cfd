"""The HTTP client of one SGLang server: native `POST /generate` with pre-tokenized input_ids.

The client is `client`, the one mapping of HTTP/transport failures to `app.core.errors` is
`errors` (`map_http_error`), and the checks of a /generate answer are `responses`.
"""

from app.sglang.client import ProbeResult, SGLangClient, image_data_uri
from app.sglang.errors import ERROR_MESSAGE_MAX_CHARS, map_abort, map_http_error, server_message
from app.sglang.responses import parse_generate_response

__all__ = [
    "ERROR_MESSAGE_MAX_CHARS",
    "ProbeResult",
    "SGLangClient",
    "image_data_uri",
    "map_abort",
    "map_http_error",
    "parse_generate_response",
    "server_message",
]

"""The broker URL's own check: its scheme names a transport kombu has.

Made before anything is written or a worker starts, so a typo is one line, not a traceback.
"""

from __future__ import annotations

import difflib

from kombu.transport import TRANSPORT_ALIASES, resolve_transport

from app.core.errors import ConfigurationError
from app.core.settings import redact_url


def check_broker_url(url: str) -> None:
    """Refuse a broker URL kombu has no transport for (a typo of the scheme), naming
    TOKENMILL_BROKER_URL, before anything is written that would then wait unpublished."""
    scheme = url.split("://", 1)[0] if "://" in url else url
    try:
        resolve_transport(scheme)
    except KeyError:
        close = difflib.get_close_matches(scheme, list(TRANSPORT_ALIASES), n=1)
        hint = f"; did you mean {close[0]}://?" if close else ""
        raise ConfigurationError(
            f"TOKENMILL_BROKER_URL {redact_url(url)}: no broker transport {scheme!r}{hint}"
        ) from None
    except ImportError as exc:
        raise ConfigurationError(
            f"TOKENMILL_BROKER_URL {redact_url(url)}: the {scheme} transport needs a package "
            f"that is not installed ({exc})"
        ) from exc

"""Flower as `tokenmill flower` runs it: Celery's `flower` command with its Prometheus route
(`/metrics`) behind the same authentication as the rest of Flower.

Flower serves `/metrics` to anyone, even with `--basic-auth`; it lists the workers, queues and
task names, so here it answers only to the configured credentials (`/healthcheck` stays open).
"""

from __future__ import annotations

import sys
from typing import Any


def protect_metrics() -> None:
    """Swap Flower's `/metrics` handler for one that requires its authentication (basic auth
    when configured; open, as every other page, when Flower runs without it on loopback)."""
    import tornado.web
    from flower import urls
    from flower.views.monitor import Metrics

    class AuthenticatedMetrics(Metrics):  # type: ignore[misc]  # flower is untyped
        @tornado.web.authenticated
        async def get(self) -> None:
            await super().get()

    # flower.app takes this very list when the application is built, after this runs
    urls.handlers[:] = [_swapped(h, Metrics, AuthenticatedMetrics) for h in urls.handlers]


def _swapped(handler: Any, old: type, new: type) -> Any:
    if isinstance(handler, tuple) and len(handler) >= 2 and handler[1] is old:
        return (handler[0], new, *handler[2:])
    return handler


def main() -> None:
    """`python -m ops.flower_app FLOWER-OPTIONS...`: `celery -A app flower FLOWER-OPTIONS...`."""
    protect_metrics()
    from celery.bin.celery import main as celery_main

    sys.argv = ["celery", "-A", "app", "flower", *sys.argv[1:]]
    sys.exit(celery_main())


if __name__ == "__main__":
    main()

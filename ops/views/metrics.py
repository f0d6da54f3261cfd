"""Prometheus metrics of a fleet: a collector over the ledger and broker, and its HTTP server.

Figures are computed from the shared ledger at scrape time (cached briefly), so they are right
with any number of worker processes; beyond loopback the endpoint requires basic auth.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from app.core.constants import PRIORITY_SEP, WORK_QUEUE
from app.core.errors import ConfigurationError
from app.core.models import ItemStatus
from app.core.network import is_loopback
from app.core.settings import Settings
from app.ledger import counters, metrics_queries
from workers.control.health import Health

log = logging.getLogger(__name__)

PREFIX = "tokenmill_"
OUTCOMES = ("stop", "length", "failed")
REALM = "tokenmill metrics"
NO_SERVER = ""  # items never leased to a server: an empty label is an absent one in PromQL


# --- the collector ------------------------------------------------------------------------


def broker_queue_depth(broker_url: str) -> int | None:
    """Messages waiting in the generate queue and its priority sub-queues; None unless Redis."""
    if not broker_url.startswith(("redis://", "rediss://")):
        return None
    import redis

    client = redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        keys = [WORK_QUEUE.encode(), *client.scan_iter(match=f"{WORK_QUEUE}{PRIORITY_SEP}*")]
        return sum(int(client.llen(key)) for key in keys if client.type(key) == b"list")
    finally:
        client.close()


def ledger_families(snapshot: metrics_queries.LedgerSnapshot) -> list[Metric]:
    """The metric families the ledger snapshot holds (no I/O)."""
    known = {s.name for s in snapshot.servers}
    known |= {g.server for g in snapshot.groups if g.server is not None}
    totals = _GroupTotals.of(snapshot, known)
    generated, requests, flight = _server_item_families(totals)
    return [
        generated,
        requests,
        latency_family(snapshot, known),
        flight,
        *server_families(snapshot),
        *window_families(snapshot),
        *_run_families(totals),
        _priority_family(snapshot),
    ]


@dataclass
class _GroupTotals:
    """The snapshot's item groups summed by server and by run; every known server and every
    run is listed, at zero when it has nothing."""

    tokens: dict[str, int]
    outcomes: dict[tuple[str, str], int]
    in_flight: dict[str, int]
    run_items: dict[str, dict[str, int]]
    run_hedged: dict[str, dict[str, int]]
    run_tokens: dict[str, int]

    @classmethod
    def of(cls, snapshot: metrics_queries.LedgerSnapshot, known: set[str]) -> _GroupTotals:
        hedge_statuses = (ItemStatus.LEASED.value, ItemStatus.DONE.value, ItemStatus.FAILED.value)
        totals = cls(
            tokens=dict.fromkeys(known, 0),
            outcomes={(s, o): 0 for s in known for o in OUTCOMES},
            in_flight=dict.fromkeys(known, 0),
            run_items={
                run: dict.fromkeys((s.value for s in ItemStatus), 0) for run in snapshot.run_names
            },
            run_hedged={run: dict.fromkeys(hedge_statuses, 0) for run in snapshot.run_names},
            run_tokens=dict.fromkeys(snapshot.run_names, 0),
        )
        for g in snapshot.groups:
            totals.add(g)
        return totals

    def add(self, g: metrics_queries.ItemGroup) -> None:
        server = g.server or NO_SERVER
        by_status = self.run_items.setdefault(g.run, {})
        by_status[g.status] = by_status.get(g.status, 0) + g.items
        if g.hedged:
            hedged = self.run_hedged.setdefault(g.run, {})
            hedged[g.status] = hedged.get(g.status, 0) + g.hedged
        if g.status == ItemStatus.DONE.value:
            self.tokens[server] = self.tokens.get(server, 0) + g.completion_tokens
            self.run_tokens[g.run] = self.run_tokens.get(g.run, 0) + g.completion_tokens
            key = (server, g.finish_reason or "unknown")
            self.outcomes[key] = self.outcomes.get(key, 0) + g.items
        elif g.status == ItemStatus.FAILED.value:
            self.outcomes[(server, "failed")] = self.outcomes.get((server, "failed"), 0) + g.items
        elif g.status == ItemStatus.LEASED.value:
            self.in_flight[server] = self.in_flight.get(server, 0) + g.items


def _server_item_families(totals: _GroupTotals) -> tuple[Metric, Metric, Metric]:
    """Generated tokens, finished requests by outcome and items in flight, by server."""
    generated = CounterMetricFamily(
        PREFIX + "generated_tokens",
        "Output tokens of finished items, by the server that generated them.",
        labels=["server"],
    )
    for server, n in sorted(totals.tokens.items()):
        generated.add_metric([server], n)
    requests = CounterMetricFamily(
        PREFIX + "requests",
        "Finished items by server and outcome: stop, length (truncated) or failed.",
        labels=["server", "outcome"],
    )
    for (server, outcome), n in sorted(totals.outcomes.items()):
        requests.add_metric([server, outcome], n)
    flight = GaugeMetricFamily(
        PREFIX + "requests_in_flight",
        "Items leased to a server now (being generated or about to be sent).",
        labels=["server"],
    )
    for server, n in sorted(totals.in_flight.items()):
        flight.add_metric([server], n)
    return generated, requests, flight


def _run_families(totals: _GroupTotals) -> list[Metric]:
    """Items by status, hedged items by status and generated tokens, by run."""
    items = GaugeMetricFamily(
        PREFIX + "run_items",
        "Items of a run by status: waiting, pending, queued, leased, done, failed.",
        labels=["run", "status"],
    )
    for run, by_status in totals.run_items.items():
        for status, n in sorted(by_status.items()):
            items.add_metric([run, status], n)
    hedged_items = GaugeMetricFamily(
        PREFIX + "run_hedged_items",
        "Items of a run that got a second copy on an idle server at the end of the run "
        "(hedging), by status; items.server names the server whose result was kept.",
        labels=["run", "status"],
    )
    for run, by_status in totals.run_hedged.items():
        for status, n in sorted(by_status.items()):
            hedged_items.add_metric([run, status], n)
    per_run = CounterMetricFamily(
        PREFIX + "run_generated_tokens", "Output tokens of a run's finished items.", labels=["run"]
    )
    for run, n in totals.run_tokens.items():
        per_run.add_metric([run], n)
    return [items, hedged_items, per_run]


def _priority_family(snapshot: metrics_queries.LedgerSnapshot) -> Metric:
    """Each run's priority."""
    priority = GaugeMetricFamily(
        PREFIX + "run_priority",
        "A run's priority: free slots go to the highest-priority run with items first.",
        labels=["run"],
    )
    for run, n in snapshot.run_priorities.items():
        priority.add_metric([run], n)
    return priority


def latency_family(snapshot: metrics_queries.LedgerSnapshot, known: set[str]) -> Metric:
    """The latency histogram of each server; zeros for a known server with nothing finished."""
    latency = HistogramMetricFamily(
        PREFIX + "request_latency_seconds",
        "End-to-end generation latency of finished items, by server.",
        labels=["server"],
    )
    histograms = {h.server or NO_SERVER: h for h in snapshot.latencies}
    for server in sorted(known - set(histograms)):  # a server with nothing finished yet: zeros
        histograms[server] = metrics_queries.LatencyHistogram(
            server, counters.LATENCY_BUCKETS_S, (0,) * len(counters.LATENCY_BUCKETS_S), 0, 0.0
        )
    for server, h in sorted(histograms.items()):
        buckets: list[tuple[str, float]] = [
            (str(float(b)), n) for b, n in zip(h.buckets_s, h.cumulative, strict=True)
        ]
        buckets.append(("+Inf", h.count))
        latency.add_metric([server], buckets, sum_value=h.sum_s)
    return latency


def server_families(snapshot: metrics_queries.LedgerSnapshot) -> list[Metric]:
    """State, pause flag and last probe of each registered server."""
    state = GaugeMetricFamily(
        PREFIX + "server_state",
        "1 for the server's current health state, 0 for the others.",
        labels=["server", "state"],
    )
    paused = GaugeMetricFamily(
        PREFIX + "server_paused",
        "1 while the server is paused, with who paused it (operator, watchdog, ...).",
        labels=["server", "paused_by"],
    )
    probe_at = GaugeMetricFamily(
        PREFIX + "server_last_probe_timestamp_seconds",
        "Unix time of the server's last health probe.",
        labels=["server"],
    )
    probe_ok = GaugeMetricFamily(
        PREFIX + "server_last_probe_success",
        "1 if the server's last health probe succeeded, else 0.",
        labels=["server"],
    )
    probe_latency = GaugeMetricFamily(
        PREFIX + "server_last_probe_latency_seconds",
        "Duration of the server's last health probe.",
        labels=["server"],
    )
    for s in snapshot.servers:
        for known in sorted({h.value for h in Health} | {s.state}):
            state.add_metric([s.name, known], 1 if known == s.state else 0)
        paused.add_metric([s.name, (s.paused_by or "") if s.paused else ""], 1 if s.paused else 0)
        if s.last_probe_at is not None:
            probe_at.add_metric([s.name], s.last_probe_at.timestamp())
        if s.last_probe_ok is not None:
            probe_ok.add_metric([s.name], 1 if s.last_probe_ok else 0)
        if s.last_probe_latency_s is not None:
            probe_latency.add_metric([s.name], s.last_probe_latency_s)
    return [state, paused, probe_at, probe_ok, probe_latency]


def window_families(snapshot: metrics_queries.LedgerSnapshot) -> list[Metric]:
    """Each server's window (its live workers' sizes added up), its capacity and its load at
    the workers' last reading."""
    size = GaugeMetricFamily(
        PREFIX + "server_window",
        "Requests the server's workers keep in flight together, by mode (auto or fixed) and "
        "the reason of its last change.",
        labels=["server", "mode", "reason"],
    )
    capacity = GaugeMetricFamily(
        PREFIX + "server_max_running",
        "The server's running batch (max_running_requests over its DP ranks), as read.",
        labels=["server"],
    )
    running = GaugeMetricFamily(
        PREFIX + "server_running_requests",
        "Requests running on the server at its workers' last /v1/loads reading.",
        labels=["server"],
    )
    queued = GaugeMetricFamily(
        PREFIX + "server_queued_requests",
        "Requests queued on the server at its workers' last /v1/loads reading.",
        labels=["server"],
    )
    for name, w in sorted(snapshot.server_windows.items()):
        size.add_metric([name, w.mode, w.reason or ""], w.size)
        if w.max_running is not None:
            capacity.add_metric([name], w.max_running)
        if w.running is not None:
            running.add_metric([name], w.running)
        if w.queued is not None:
            queued.add_metric([name], w.queued)
    return [size, capacity, running, queued]


class LedgerCollector(Collector):
    """A prometheus_client collector: one ledger snapshot and queue depth per cache period,
    shared by concurrent scrapes so many scrapers cost one set of queries."""

    def __init__(
        self,
        engine: Engine,
        broker_url: str | None,
        *,
        cache_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.broker_url = broker_url
        self.cache_s = cache_s
        self.clock = clock
        self._lock = threading.Lock()
        self._families: list[Metric] = []
        self._taken_at: float | None = None

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            if self._taken_at is None or self.clock() - self._taken_at >= self.cache_s:
                self._families = self._scrape()
                self._taken_at = self.clock()
            return list(self._families)

    def _scrape(self) -> list[Metric]:
        started = time.perf_counter()
        families: list[Metric] = []
        try:
            families += ledger_families(metrics_queries.read_snapshot(self.engine))
            ledger_up = 1
        except Exception as exc:  # a scrape reports the outage instead of failing
            log.warning(
                "metrics: reading the ledger failed: %s",
                _first_line(exc),
                extra={"action": "metrics_failed"},
            )
            ledger_up = 0
        families.append(_gauge("ledger_up", "1 if the last ledger read succeeded.", ledger_up))
        if self.broker_url is not None:
            families += self._broker_families(self.broker_url)
        families.append(
            _gauge(
                "scrape_duration_seconds",
                "Time the last ledger and broker read took.",
                time.perf_counter() - started,
            )
        )
        return families

    def _broker_families(self, broker_url: str) -> list[Metric]:
        try:
            depth = broker_queue_depth(broker_url)
        except Exception as exc:  # e.g. Redis down: report it, keep the ledger figures
            log.warning(
                "metrics: reading the broker failed: %s",
                _first_line(exc),
                extra={"action": "metrics_failed"},
            )
            return [_gauge("broker_up", "1 if the last broker read succeeded.", 0)]
        if depth is None:  # not a broker whose queue can be read
            return []
        queue = GaugeMetricFamily(
            PREFIX + "queue_messages",
            "Messages waiting in the broker queue (each carries up to TOKENMILL_BATCH_SIZE ids).",
            labels=["queue"],
        )
        queue.add_metric([WORK_QUEUE], depth)
        return [_gauge("broker_up", "1 if the last broker read succeeded.", 1), queue]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- the HTTP server ----------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str

    def __repr__(self) -> str:
        return f"Credentials(user={self.user!r}, password='***')"


def credentials_from(settings: Settings) -> Credentials | None:
    """The basic-auth credentials configured, None if neither is; half of them is an error."""
    user = settings.metrics_user or None
    password = settings.metrics_password.get_secret_value() if settings.metrics_password else None
    if user is None and not password:
        return None
    if user is None or not password:
        raise ConfigurationError(
            "set both TOKENMILL_METRICS_USER and TOKENMILL_METRICS_PASSWORD, or neither"
        )
    return Credentials(user, password)


def check_exposure(host: str, credentials: Credentials | None) -> None:
    """Refuse to listen beyond loopback without credentials (ConfigurationError)."""
    if credentials is None and not is_loopback(host):
        raise ConfigurationError(
            f"refusing to serve metrics on {host!r} without credentials: set "
            "TOKENMILL_METRICS_USER and TOKENMILL_METRICS_PASSWORD, or listen on 127.0.0.1"
        )


def _authorized(header: str, expected: Credentials) -> bool:
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        user, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
    except (binascii.Error, ValueError):
        return False
    # compare both, always: the time taken says nothing about which part was wrong
    user_ok = hmac.compare_digest(user, expected.user.encode())
    password_ok = hmac.compare_digest(password, expected.password.encode())
    return bool(sep) and user_ok and password_ok


def require_basic_auth(app: WSGIApplication, credentials: Credentials) -> WSGIApplication:
    """app behind HTTP basic auth: 401 with a challenge unless the credentials match."""

    def guarded(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if _authorized(str(environ.get("HTTP_AUTHORIZATION", "")), credentials):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"'),
            ],
        )
        return [b"401 Unauthorized: credentials required\n"]

    return guarded


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics: %s %s", self.address_string(), format % args)


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A threaded WSGI server for the metrics app, IPv4 or IPv6 as the host asks."""

    daemon_threads = True

    def __init__(self, host: str, port: int, app: WSGIApplication) -> None:
        try:
            self.address_family = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0][0]
            super().__init__((host, port), _QuietHandler)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        self.set_app(app)

    @property
    def url(self) -> str:
        address = self.server_address[0]
        host = address.decode() if isinstance(address, bytes) else address
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.server_address[1]}/metrics"


def make_metrics_server(
    *,
    engine: Engine,
    broker_url: str | None,
    host: str,
    port: int,
    credentials: Credentials | None,
    cache_s: float = 2.0,
) -> MetricsServer:
    """A bound (not yet serving) metrics server; refuses a non-loopback host without credentials."""
    check_exposure(host, credentials)
    registry = CollectorRegistry()
    registry.register(LedgerCollector(engine, broker_url, cache_s=cache_s))
    app = cast(WSGIApplication, make_wsgi_app(registry))
    if credentials is not None:
        app = require_basic_auth(app, credentials)
    return MetricsServer(host, port, app)


__all__ = [
    "Credentials",
    "LedgerCollector",
    "MetricsServer",
    "check_exposure",
    "credentials_from",
    "ledger_families",
    "make_metrics_server",
]

"""The probe loop of one server a worker or `tokenmill run` sends to: `GET /health` every
probe_interval_s on its own thread (never two probes to one server at once), healthy servers
included, so a drain is seen within a few seconds; the window is told, and the ledger keeps
the last probe (what `tokenmill servers` shows) whichever process made it.

What a probe says (SGLang 0.5.23, `http_server.health_generate`, `sigterm_watchdog`):
- 200: healthy.
- 503 at once from a server that was serving: it drains (SIGTERM: its /health answers 503
  while /generate still serves what it is sent, and it exits once no request is left). The
  window sends it nothing new, keeps its requests in flight, and gives back its backlog.
  A 503 after SGLang's own 20 s generation check is a hung server, not a drain: down.
- no answer: down.
- a key refused: /health needs no key, so a server seen healthy is asked /model_info (which
  does) once; a 401/403 there, or from /generate, is `auth` until a probe of /model_info
  passes: then only /model_info is probed, at the same rate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.core.errors import AuthRequired, GenerationError
from app.ledger import registry
from app.sglang.client import ProbeResult, SGLangClient
from app.sglang.draining import is_drain, refused_at_once
from workers.control.health import Health
from workers.engine.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Seen:
    """One probe's verdict."""

    state: Health  # HEALTHY, DRAINING, DOWN or AUTH
    ok: bool
    latency_s: float | None
    error: str | None


def verdict(probe: ProbeResult, *, was_serving: bool) -> Seen:
    """What one /health answer says, given whether the server was serving before it."""
    if probe.ok:
        return Seen(Health.HEALTHY, True, probe.latency_s, None)
    error = probe.error or f"HTTP {probe.status_code}"
    if is_drain(refused_at_once(probe.status_code, probe.latency_s), was_serving=was_serving):
        return Seen(Health.DRAINING, False, probe.latency_s, f"draining: /health {error}")
    return Seen(Health.DOWN, False, probe.latency_s, error)


def auth_line(server_name: str, key_set: bool) -> str:
    """The one line that names a server refusing our (missing or other) API key."""
    if key_set:
        return (
            f"error: server {server_name} refuses the API key in TOKENMILL_SGLANG_API_KEY: "
            "set the server's key"
        )
    return f"error: server {server_name} requires an API key: set TOKENMILL_SGLANG_API_KEY"


class ServerProbe:
    """Probes one runtime's server on a thread of its own and applies what it sees to its
    window: drain, drained, the drain timeout, the API key state."""

    def __init__(
        self,
        rt: WorkerRuntime,
        *,
        on_change: Callable[[Health | None, Seen], None] = lambda before, seen: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rt = rt
        self.state: Health | None = None  # None until the first probe
        self._on_change = on_change
        self._clock = clock
        self._drain_started: float | None = None
        self._drain_timed_out = False
        self._client: SGLangClient | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def serving(self) -> bool:
        return self.state in (Health.HEALTHY, Health.DRAINING)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name=f"tm-probe-{self.rt.server_name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # a probe still out ends with its daemon thread

    def _loop(self) -> None:
        while not self._stop.wait(self.rt.settings.probe_interval_s):
            try:
                self.probe_once()
            except Exception:
                log.exception(
                    "probe of %s failed; trying again",
                    self.rt.server_name,
                    extra={"action": "probe_failed"},
                )
        if self._client is not None:
            self._client.close()

    def probe_once(self) -> Seen:
        """Probe once, apply the verdict to the window, record it; the verdict."""
        if self._client is None:
            self._client = self.rt.new_client()
        if self.rt.server_state.key_refused is not None:
            seen = self._auth_probe(self._client)
        else:
            seen = verdict(self._client.health("/health"), was_serving=self.serving)
            if seen.state is Health.HEALTHY and self.state is not Health.HEALTHY:
                seen = self._key_check(self._client, seen)
        self._apply(seen)
        before, self.state = self.state, seen.state
        self._record(seen)
        if before is not seen.state:
            self._on_change(before, seen)
        return seen

    def _auth_probe(self, client: SGLangClient) -> Seen:
        """While the server wants a key: /model_info alone (it wants the key, /health not)."""
        started = self._clock()
        try:
            client.model_info()
        except AuthRequired as exc:
            return Seen(Health.AUTH, False, self._clock() - started, str(exc))
        except GenerationError as exc:
            return Seen(Health.DOWN, False, self._clock() - started, str(exc))
        self.rt.server_state.key_accepted()
        return Seen(Health.HEALTHY, True, self._clock() - started, None)

    def _key_check(self, client: SGLangClient, seen: Seen) -> Seen:
        try:
            client.model_info()
        except AuthRequired as exc:
            self.rt.server_state.needs_key(str(exc))
            return Seen(Health.AUTH, False, seen.latency_s, str(exc))
        except GenerationError:
            pass  # not the key: the window's own requests will tell
        return seen

    def _apply(self, seen: Seen) -> None:
        server, window = self.rt.server_state, self.rt.window
        server.probed((seen.error or "no answer") if seen.state is Health.DOWN else None)
        if seen.state is Health.DRAINING:
            if server.draining is None:
                self._drain_started = self._clock()
                self._drain_timed_out = False
                window.drain(seen.error or "draining")
            elif (
                not self._drain_timed_out
                and self._drain_started is not None
                and self._clock() - self._drain_started > self.rt.settings.server_drain_timeout_s
            ):
                self._drain_timed_out = True
                window.abandon_inflight(
                    f"server drained for more than {self.rt.settings.server_drain_timeout_s:.0f}s"
                )
            return
        if server.draining is not None:
            server.drained()
            self._drain_started = None

    def _record(self, seen: Seen) -> None:
        """The last probe in the ledger (a registered server only); a state change goes on the
        timeline through the registry's one writer of state changes (app.ledger.registry
        change_state), which the watchdog and restarts share."""
        name = self.rt.server_name
        try:
            with self.rt.db.begin() as conn:
                registry.note_probe(
                    conn,
                    name,
                    state=seen.state.value,
                    ok=seen.ok,
                    latency_s=seen.latency_s,
                    error=seen.error,
                    by="worker",
                )
        except Exception as exc:
            log.warning(
                "could not record the probe of %s (%s)",
                name,
                exc,
                extra={"action": "probe_record_failed"},
            )

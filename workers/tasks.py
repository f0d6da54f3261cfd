"""Celery tasks, thin shells: decode ids, call the pipeline, report counts.

Task names are fixed strings (app.core.constants); queued messages refer to them. The watchdog and
reconcile run on the control queue, which is never paused.
"""

from __future__ import annotations

import logging
import sys
import threading
from functools import partial
from typing import Any

from celery.app import trace
from celery.signals import (
    beat_init,
    celeryd_init,
    setup_logging,
    worker_ready,
    worker_shutdown,
)
from celery.utils.nodenames import default_nodename

from app.celery_app import celery_app
from app.core import logs
from app.core.constants import (
    COMPACT_TASK,
    GENERATE_TASK,
    RECONCILE_TASK,
    WATCHDOG_TASK,
    WORK_QUEUE,
)
from app.core.locks import exclusive
from app.core.process_name import name_process
from app.core.settings import Settings, get_settings
from app.ledger import database, registry
from app.sglang.client import client_for
from workers.control import reconcile as reconcile_logic
from workers.control import server_removal
from workers.control.compaction import compact_due
from workers.control.health import Health
from workers.control.parity import ParityGate
from workers.control.pausing import CeleryControl, alive_workers
from workers.control.watchdog import run_watchdog
from workers.engine import prefetch, server_limits
from workers.engine.enforcer import PauseEnforcer
from workers.engine.generate import handle_message
from workers.engine.identity import (
    PING_TIMEOUT_S,
    IdentityRefused,
    WorkerIdentity,
    claim,
    port_open,
)
from workers.engine.probes import Seen, ServerProbe, auth_line
from workers.engine.runtime import WorkerRuntime
from workers.intake.publish import publish_by_priority

log = logging.getLogger(__name__)

_runtime: WorkerRuntime | None = None
_enforcer: PauseEnforcer | None = None
_probe: ServerProbe | None = None
_identity: WorkerIdentity | None = None
# this process registered its server (it was not in the registry): a start that never reached
# the server takes the registration back as it stops (workers/control/server_removal.py)
_registered_new = False
_runtime_lock = threading.Lock()


def requeue(ids: list[int], countdown_s: float) -> None:
    """Publish ids again, each with its run's priority (ids of any runs)."""
    if ids:
        settings = get_settings()
        publish_by_priority(
            database.get_engine(settings),
            ids,
            batch_size=settings.batch_size,
            countdown_s=countdown_s,
        )


def runtime() -> WorkerRuntime:
    """This process's runtime, created on first use (after the fork, never at import)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            settings = get_settings()
            _runtime = WorkerRuntime(
                settings,
                db=database.get_engine(settings),
                server_url=settings.sglang_url,
                server_name=identity(settings).server_name,
                on_released=requeue,
            )
            _runtime.start()
        return _runtime


def identity(settings: Settings) -> WorkerIdentity:
    """This worker's names: those checked at start, else the rule's (a worker started without
    the `celery worker` command, e.g. celery.contrib.testing, sends no celeryd_init)."""
    return _identity or WorkerIdentity.of(settings)


def _alive_workers(names: list[str]) -> set[str]:
    return alive_workers(names, timeout_s=PING_TIMEOUT_S)


def _configure_logging(loglevel: Any, logfile: str | None) -> None:
    """The CLI's one logging configuration, at the worker's --loglevel, to its --logfile if
    given, as TOKENMILL_LOG_FORMAT says."""
    log_format = get_settings().log_format
    if log_format == "json":
        logging.captureWarnings(True)  # a bare warning line would break a JSON-lines reader
    logs.apply(logs.log_config(loglevel or logging.WARNING, log_format, logfile))


@celeryd_init.connect
def _early_logging(options: dict[str, Any] | None = None, **_: Any) -> None:
    # the worker logs and warns (its identity, running as root) before its setup_logging
    _configure_logging((options or {}).get("loglevel"), (options or {}).get("logfile"))


@setup_logging.connect
def _setup_logging(loglevel: Any = None, logfile: str | None = None, **_: Any) -> None:
    # Celery leaves logging to the receiver of this signal
    _configure_logging(loglevel, logfile)


@beat_init.connect
def _name_beat(**_: Any) -> None:
    name_process("tokenmill-beat")


@celeryd_init.connect
def _claim_identity(sender: str | None = None, instance: Any = None, **_: Any) -> None:
    """Name this worker by the rule unless `-n` named it, and refuse it (exit 2, one line)
    when its names clash with running workers or its server has no URL the fleet reaches."""
    global _identity, _registered_new
    settings = get_settings()
    given = None if sender in (None, default_nodename(None)) else sender
    mine = WorkerIdentity.of(settings, given)
    name_process(f"tokenmill-worker {mine.server_name}")  # before its first connection
    if instance is not None and given is None:
        instance.hostname = mine.worker_name
        trace.setup_worker_optimizations(instance.app, mine.worker_name)  # tasks' hostname
    try:
        with database.get_engine(settings).connect() as conn:
            known = registry.find_server(conn, mine.server_name) is not None
        claim(settings, database.get_engine(settings), mine, _alive_workers)
        _registered_new = not known
    except IdentityRefused as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    except Exception as exc:  # the ledger is down: registered at worker_ready instead
        log.warning(
            "could not register server %s at start (%s)",
            mine.server_name,
            exc,
            extra={"action": "register_failed"},
        )
    _identity = mine


def _consumes(consumer: Any) -> bool | None:
    """Does this worker's consumer take from the work queue right now? (None: cannot tell)"""
    try:
        return WORK_QUEUE in {q.name for q in consumer.task_consumer.queues}
    except AttributeError:
        return None


def _probe_changed(rt: WorkerRuntime, seen: Seen) -> None:
    """What this worker's own probes of its server found (the watchdog records its own)."""
    if seen.state is Health.AUTH:
        log.error(
            auth_line(rt.server_name, rt.settings.sglang_api_key is not None),
            extra={"action": "auth_required"},
        )
    elif seen.state is Health.DRAINING:
        log.warning(
            "server %s drains: nothing new goes to it, %d requests in flight finish",
            rt.server_name,
            rt.window.stats.inflight,
            extra={"action": "draining"},
        )
    else:
        log.info(
            "server %s is %s (%s)",
            rt.server_name,
            seen.state.value,
            seen.error or "ok",
            extra={"action": "server_state"},
        )
    enforcer = _enforcer
    if enforcer is not None:  # the consumer follows at once, not at the next pause check
        enforcer.check()


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _enforcer, _probe
    rt = runtime()
    hostname = getattr(sender, "hostname", None)
    rt.register(hostname, node=identity(rt.settings).node)
    # its own probes of its server: a drain (SIGTERM) is seen within probe_interval_s
    _probe = ServerProbe(rt, on_change=lambda before, seen: _probe_changed(rt, seen))
    _probe.probe_once()
    _probe.start()
    if hostname:
        _enforcer = PauseEnforcer(
            rt, hostname, CeleryControl(), rt.settings.pause_check_s, partial(_consumes, sender)
        )
        _enforcer.check()  # a worker started during a pause never consumes
        _enforcer.start()
    _follow_window(rt, sender)
    with rt.db.connect() as conn:
        registered = registry.get_server(conn, rt.server_name).url
    log.info(
        "worker %s serves %s (%s%s), %d in flight",
        hostname,
        rt.server_name,
        rt.server_url,
        "" if registered == rt.server_url else f"; registered at {registered}",
        rt.window.config.inflight,
        extra={"action": "worker_started"},
    )
    _name_context(rt)
    if not port_open(rt.server_url):
        log.warning(
            "server %s: nothing answers at %s; this worker waits for it (a server still "
            "starting is fine; a wrong TOKENMILL_SGLANG_URL is not: stop this worker, and a "
            "registration it made goes with it)",
            rt.server_name,
            rt.server_url,
            extra={"action": "server_unanswered"},
        )


def _name_context(rt: WorkerRuntime) -> None:
    """The server's context length at start, and a difference with its model folder's."""
    with client_for(rt.server_url, rt.settings) as client:
        line = server_limits.context_line(rt.server_name, client)
    if line is not None:
        level = logging.INFO if line.endswith("(its --context-length)") else logging.WARNING
        log.log(level, "%s", line, extra={"action": "server_context"})


def _follow_window(rt: WorkerRuntime, consumer: Any) -> None:
    """The task messages this worker reserves follow its window (workers/engine/prefetch.py)."""
    pool = getattr(consumer, "pool", None)
    threads = int(getattr(pool, "num_processes", None) or rt.settings.worker_threads)
    multiplier = int(getattr(consumer, "prefetch_multiplier", 1) or 1)
    follower = prefetch.PrefetchFollower(
        lambda: getattr(consumer, "qos", None), celery_count=threads * multiplier
    )
    batch = rt.settings.batch_size
    rt.sizer.follow(lambda taken: follower.follow(prefetch.messages_for(taken, batch, threads)))


@worker_shutdown.connect
def _on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    global _runtime, _enforcer, _probe
    with _runtime_lock:
        rt, _runtime = _runtime, None
        enforcer, _enforcer = _enforcer, None
        probe, _probe = _probe, None
    if enforcer is not None:
        enforcer.stop()
    if probe is not None:
        probe.stop()
    if rt is not None:
        rt.stop()
        hostname = getattr(sender, "hostname", None)
        if hostname:
            rt.unregister(hostname)
    if _registered_new and _identity is not None:
        try:
            server_removal.drop_stray(database.get_engine(get_settings()), _identity.server_name)
        except Exception as exc:
            log.warning(
                "could not check the registration of %s (%s)",
                _identity.server_name,
                exc,
                extra={"action": "registration_check_failed"},
            )


@celery_app.task(name=GENERATE_TASK, acks_late=True, ignore_result=True)
def generate(item_ids: list[int]) -> dict[str, int | str]:
    """Claim these items and send them to this worker's SGLang server; the result (Flower
    shows it) says what was claimed and the window this worker keeps."""
    rt = runtime()
    result = handle_message(rt, item_ids, requeue=requeue)
    result["window"] = rt.sizer.describe()
    return result


@celery_app.task(name=RECONCILE_TASK, acks_late=True, ignore_result=True)
def reconcile(run: str | None = None) -> dict[str, int]:
    """Re-queue items whose lease expired, that were never published, or that the broker lost."""
    settings = get_settings()
    # a worker killed while holding the lock must not block reconcile for long; two rounds
    # overlapping is harmless (every step is idempotent)
    ttl_s = min(300.0, max(10.0, 2 * settings.reconcile_interval_s))
    with exclusive(settings, "reconcile", ttl_s=ttl_s) as held:
        if not held:
            return {"skipped": 1}
        report = reconcile_logic.reconcile(
            database.get_engine(settings), settings, run=run, publish=requeue
        )
    return report.to_json()


@celery_app.task(name=WATCHDOG_TASK, ignore_result=True)
def watchdog() -> dict[str, str]:
    """Probe every server once; pause the down, resume the healthy (one watchdog at a time)."""
    settings = get_settings()
    with exclusive(settings, "watchdog", ttl_s=settings.probe_timeout_s * 2 + 30) as held:
        if not held:
            log.info(
                "another watchdog round is still running; skipping this one",
                extra={"action": "watchdog_skipped"},
            )
            return {}
        return run_watchdog(
            database.get_engine(settings), settings, CeleryControl(), parity=ParityGate(settings)
        )


@celery_app.task(name=COMPACT_TASK, acks_late=True, ignore_result=True)
def compact() -> list[dict[str, object]]:
    """Move the token arrays of runs with enough finished items to shards in object storage
    (each run under its own lock, so two beats or workers never compact the same run)."""
    settings = get_settings()
    reports = compact_due(database.get_engine(settings), settings)
    return [r.to_json() for r in reports if r.compacted or r.orphans_removed]

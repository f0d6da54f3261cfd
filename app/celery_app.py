"""The Celery application `celery -A app worker` finds: configuration for at-least-once delivery.

Created without connecting; task modules are named by string so `app` never imports `workers`.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]
from pydantic import ValidationError

from app.core.broker_url import check_broker_url
from app.core.constants import (
    BROKER_PRIORITY_STEPS,
    COMPACT_TASK,
    CONTROL_QUEUE,
    GENERATE_TASK,
    PRIORITY_SEP,
    RECONCILE_TASK,
    WATCHDOG_TASK,
    WORK_QUEUE,
)
from app.core.errors import ConfigurationError
from app.core.settings import Settings, describe_invalid, get_settings


def celery_config(settings: Settings) -> dict[str, Any]:
    """Every Celery setting tokenmill depends on, with the reason beside the surprising ones."""
    broker_url = settings.resolved_broker_url()
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # beat's schedule file lives there
    transport_options: dict[str, Any] = {
        # a task running longer than this is delivered again: keep it above the longest wait
        "visibility_timeout": settings.visibility_timeout_s,
        "socket_timeout": 30,
        "socket_connect_timeout": 10,
        "health_check_interval": 25,
        "retry_on_timeout": True,
        # one list per step of a message's priority (kombu serves step 0 first): a run's
        # priority rides on its messages (workers/intake/publish.py); the steps are the
        # queue's keys, so a consumer's cancel and add cover them all
        "priority_steps": list(BROKER_PRIORITY_STEPS),
        "sep": PRIORITY_SEP,
    }
    if broker_url.startswith("filesystem://"):
        folder = settings.broker_folder()
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        transport_options = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            "store_processed": False,
            "control_folder": str(folder / "control"),
        }
    return {
        "broker_url": broker_url,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        # the default gives up after 100 retries (~45 minutes without Redis): never give up
        "broker_connection_max_retries": None,
        "broker_pool_limit": 16,
        "task_default_queue": WORK_QUEUE,
        "task_queues": (Queue(WORK_QUEUE), Queue(CONTROL_QUEUE)),  # type: ignore[no-untyped-call]
        "task_routes": {
            GENERATE_TASK: {"queue": WORK_QUEUE},
            RECONCILE_TASK: {"queue": CONTROL_QUEUE},
            WATCHDOG_TASK: {"queue": CONTROL_QUEUE},
            COMPACT_TASK: {"queue": CONTROL_QUEUE},
        },
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        "result_backend": None,
        # at-least-once: ack after the task body, and redeliver if the worker dies under it
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_publish_retry": True,
        "task_publish_retry_policy": {
            "max_retries": 20,
            "interval_start": 0.2,
            "interval_step": 0.5,
            "interval_max": 5.0,
        },
        "worker_pool": "threads",
        "worker_concurrency": settings.worker_threads,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        # beat (`celery -A app beat`, exactly one) drives the watchdog and reconcile; both run
        # on the control queue that every worker consumes and no pause ever touches
        "beat_schedule": {
            "tokenmill-watchdog": {
                "task": WATCHDOG_TASK,
                "schedule": settings.watchdog_interval_s,
                "options": {"queue": CONTROL_QUEUE, "expires": settings.watchdog_interval_s},
            },
            "tokenmill-reconcile": {
                "task": RECONCILE_TASK,
                "schedule": settings.reconcile_interval_s,
                "options": {"queue": CONTROL_QUEUE, "expires": settings.reconcile_interval_s},
            },
            # moves finished token arrays from the ledger to shards in object storage
            "tokenmill-compact": {
                "task": COMPACT_TASK,
                "schedule": settings.compact_interval_s,
                "options": {"queue": CONTROL_QUEUE, "expires": settings.compact_interval_s},
            },
        },
        "beat_schedule_filename": str(settings.data_dir / "celerybeat-schedule"),
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_celery(settings: Settings | None = None) -> Celery:
    if settings is None:
        try:
            settings = get_settings()
            check_broker_url(settings.resolved_broker_url())
        except ValidationError as exc:
            # `celery -A app worker` would print the traceback of loading this module
            raise SystemExit(f"error: {describe_invalid(exc)}") from None
        except ConfigurationError as exc:
            raise SystemExit(f"error: {exc}") from None
    celery = Celery("tokenmill", include=["workers.tasks"])
    celery.conf.update(celery_config(settings))
    return celery


celery_app = create_celery()

"""The Celery app. `celery -A workers.app worker -P threads` and `tandem worker` both run it.

Configuration is computed when Celery first needs it (from TANDEM_* variables, see
settings.py), not at import: importing this module touches neither Redis nor torch. Messages
are JSON only: a worker refuses a pickled message without running it.
"""

from __future__ import annotations

from celery import Celery, signals

from workers.settings import JobSettings

ROUTES = {"tandem.generate": {"queue": "llm"}, "tandem.detect": {"queue": "vision"}}
# kombu's waits between tries of a broker connection that cannot be made (seconds): the first,
# the step added after each try, the cap. Its defaults (2, 2, 30) made a worker that met a Redis
# restart as its consumer connected wait 2, 4, 6... s: up to the last wait after Redis was back,
# and that wait grows by 2 s with every try an outage lasts. Capped at 1 s, a worker is
# consuming within a second of Redis coming back (benchmarks/worker_start.py).
BROKER_RETRY = {"interval_start": 0.2, "interval_step": 0.2, "interval_max": 1.0}


def celery_config(settings: JobSettings, *, results: bool = True) -> dict:
    return {
        "broker_url": settings.redis_url,
        "result_backend": settings.redis_url if results else None,
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "task_routes": ROUTES,
        "task_default_queue": "llm",
        "result_expires": settings.job_ttl_s,
        # The job lease (host.py), not a redelivery timeout, brings back the work of a dead
        # worker, and the orphan sweep (store.orphans) a message lost on its way to one. So
        # Kombu's acknowledgement emulation is off: no unacked bookkeeping in Redis, one write
        # less per message on the path of every job, and no visibility timeout that would run
        # a long job a second time.
        "task_acks_late": False,
        "broker_transport_options": {"ack_emulation": False, "socket_connect_timeout": 2, **BROKER_RETRY},
        # Celery's consumer calls kombu's retry loop with kombu's defaults, which no transport
        # option reaches: this subclass passes BROKER_RETRY to it.
        "worker_consumer": "workers.tasks:Consumer",
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "result_backend_always_retry": True,
        "result_backend_max_retries": 60,
        "task_publish_retry": True,
        "task_publish_retry_policy": {
            "max_retries": 120,
            "interval_start": 0.05,
            "interval_step": 0.25,
            "interval_max": 1.0,
        },
        "worker_send_task_events": False,
        "broker_pool_limit": 16,
    }


def make_app(settings: JobSettings | None = None, *, results: bool = False) -> Celery:
    """A Celery app for clients and control commands. `results=False`: sending a task
    subscribes to no result."""
    app = Celery("tandem-client", set_as_current=False)
    app.conf.update(celery_config(settings or JobSettings.from_env(), results=results))
    return app


app = Celery("tandem", include=["workers.tasks"])
app.add_defaults(lambda: celery_config(JobSettings.from_env()))  # evaluated at configure time


@signals.worker_init.connect
def _on_worker_init(sender=None, **_) -> None:
    # Threads (or solo) pool: this process runs the tasks, so the Runtime loads here, before
    # the consumer takes any message. Prefork: each child loads its own after the fork.
    if getattr(sender, "app", None) is not app or "prefork" in str(getattr(sender, "pool_cls", "")).lower():
        return
    from workers import host
    from workers.settings import model_queue

    queues = consumed_queues(sender)
    started = host.start_host(app, queues, getattr(sender, "hostname", ""))
    if started.model_name is not None and (queues is None or "llm" in queues):
        # The consumer starts after this signal: it then takes the jobs that name this worker's
        # model too (a plain `celery -A workers.app worker -Q llm` as well as `tandem worker`).
        sender.app.amqp.queues.select_add(model_queue(started.model_name))


@signals.worker_process_init.connect
def _on_worker_process_init(**_) -> None:
    from workers import host

    host.start_host(app, None)


@signals.worker_shutdown.connect
def _on_worker_shutdown(sender=None, **_) -> None:
    from workers import host

    host.stop_host()


def consumed_queues(worker) -> list[str] | None:
    try:
        names = list(worker.app.amqp.queues.consume_from or {})
    except AttributeError:
        return None
    return names or None

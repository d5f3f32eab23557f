"""JobSettings: where the broker is and how jobs are leased, kept and streamed. Read from the
environment when a Celery app is configured or a JobClient is built, never at import.

    TANDEM_REDIS_URL               broker, result store and job records (redis://127.0.0.1:6379/0)
    TANDEM_JOB_TTL_S               how long finished jobs (record, result, stream) are kept (86400)
    TANDEM_LEASE_S                 a worker silent this long is dead; its jobs run again (10)
    TANDEM_HEARTBEAT_S             how often a worker renews its lease and sweeps for dead ones (2)
    TANDEM_STREAM_MAXLEN           events kept per job stream (4096; above max_model_len + a few)
    TANDEM_ALLOWED_ROOTS           os.pathsep-separated folders `tandem.detect` may read ("" = none)
    TANDEM_ALLOWED_URL_PREFIXES    comma-separated URL prefixes `tandem.detect` may fetch ("" = none)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
QUEUES = ("llm", "vision")  # tandem.generate goes to llm, tandem.detect to vision (app.ROUTES)
MODEL_QUEUE_PREFIX = "llm."


def model_queue(model_name: str) -> str:
    """The queue of one served model's jobs: every worker serving `model_name` consumes it (and
    the plain `llm` queue too, which any LLM worker runs on its model: the queue of a fleet that
    serves one model, and of callers that name none)."""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model must be a non-empty string, got {model_name!r}")
    return MODEL_QUEUE_PREFIX + model_name


def env_numbers(env: Mapping[str, str], *specs: tuple[str, str, Callable[[str], int | float]]) -> dict:
    """{name: conv(env[key])} for each (name, key, conv) whose variable is set and not empty. A
    value that does not read is a ValueError naming the variable; the range is the settings'
    own check, which names the field."""
    kw: dict = {}
    for name, key, conv in specs:
        if env.get(key):
            try:
                kw[name] = conv(env[key])
            except ValueError:
                raise ValueError(f"{key} must be a number, got {env[key]!r}") from None
    return kw


def _number(name: str, value: object, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
        raise ValueError(f"{name} must be a number >= {low}, got {value!r}")


@dataclass(slots=True)
class JobSettings:
    redis_url: str = DEFAULT_REDIS_URL
    job_ttl_s: int = 86400
    lease_s: float = 10.0
    heartbeat_s: float = 2.0
    stream_maxlen: int = 4096
    allowed_roots: tuple[str, ...] = ()
    allowed_url_prefixes: tuple[str, ...] = ()
    # How long a client or worker keeps retrying while Redis is unreachable (a restart).
    reconnect_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.redis_url, str) or not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if isinstance(self.job_ttl_s, bool) or not isinstance(self.job_ttl_s, int) or self.job_ttl_s < 1:
            raise ValueError(f"job_ttl_s must be an integer >= 1, got {self.job_ttl_s!r}")
        _number("lease_s", self.lease_s, 1.0)
        _number("heartbeat_s", self.heartbeat_s, 0.05)
        if self.heartbeat_s * 3 > self.lease_s:
            # Two missed beats must not cost a live worker its jobs.
            raise ValueError(f"heartbeat_s must be <= lease_s / 3 ({self.lease_s / 3:g}), got {self.heartbeat_s!r}")
        if isinstance(self.stream_maxlen, bool) or not isinstance(self.stream_maxlen, int) or self.stream_maxlen < 16:
            raise ValueError(f"stream_maxlen must be an integer >= 16, got {self.stream_maxlen!r}")
        _number("reconnect_s", self.reconnect_s, 0.0)
        self.allowed_roots = tuple(os.path.realpath(r) for r in self.allowed_roots if r)
        self.allowed_url_prefixes = tuple(p for p in self.allowed_url_prefixes if p)
        for p in self.allowed_url_prefixes:
            if not p.startswith(("http://", "https://")) or p.count("/") < 3:
                # A bare "https://" prefix would allow every host: demand scheme://host/.
                raise ValueError(f"allowed_url_prefixes must be http(s)://host/... prefixes, got {p!r}")

    @classmethod
    def from_env(cls, env: os._Environ | dict | None = None, **overrides) -> JobSettings:
        env = os.environ if env is None else env
        kw: dict = {}
        if env.get("TANDEM_REDIS_URL"):
            kw["redis_url"] = env["TANDEM_REDIS_URL"]
        kw |= env_numbers(
            env,
            ("job_ttl_s", "TANDEM_JOB_TTL_S", int),
            ("lease_s", "TANDEM_LEASE_S", float),
            ("heartbeat_s", "TANDEM_HEARTBEAT_S", float),
            ("stream_maxlen", "TANDEM_STREAM_MAXLEN", int),
        )
        if env.get("TANDEM_ALLOWED_ROOTS"):
            kw["allowed_roots"] = tuple(env["TANDEM_ALLOWED_ROOTS"].split(os.pathsep))
        if env.get("TANDEM_ALLOWED_URL_PREFIXES"):
            kw["allowed_url_prefixes"] = tuple(p.strip() for p in env["TANDEM_ALLOWED_URL_PREFIXES"].split(","))
        known = {f.name for f in fields(cls)}
        kw.update({k: v for k, v in overrides.items() if k in known and v is not None})
        return cls(**kw)

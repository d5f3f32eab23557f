"""Camera events pushed where people already look (issue 32 part 3): webhooks and MQTT, fed by
the camera service's publisher with each frame's line and zone events
(runtime/vision/analytics.py), off the detection path (workers/camera_push_sinks.py).

    tandem streams cams.streams --webhook https://hooks.example/tandem --mqtt 127.0.0.1:1883
    rtsp://10.0.0.7/live id=door tracker=bytetrack lines=door:0,0.6,1,0.6 webhook=line_cross=http://ha.local:8123/api/webhook/door

Webhooks: one URL gets every event type, as Roboflow's webhook sink and most receivers
(Home Assistant's webhook trigger, n8n, Node-RED) expect; `TYPE[,TYPE]=URL` limits a URL to
those types (line_cross, zone_enter, zone_exit), so each type may have its own. Service-wide
ones (--webhook, repeated) get every camera's events; a camera's own (`webhook=` in its
`.streams` line or its add command) get its events too. Each is an HTTP POST of one event:

    {"camera": "door", "type": "line_cross", "line": "door", "direction": "in", "track_id": 7,
     "cls": "person", "at": 1718000000.12, "point": [0.51, 0.6], "clip": "/clips/door-....mp4",
     "counts": {"lines": {"door": {"in": 3, "out": 1}}, "zones": {}}}

with X-Tandem-Event (the type), X-Tandem-Timestamp (Unix seconds) and, with a secret
(--webhook-secret or $TANDEM_WEBHOOK_SECRET), X-Tandem-Signature: sha256=HMAC-SHA256(secret,
"<timestamp>.<body>") in hex. A 2xx is delivered; no connection, a timeout, 408, 425, 429 or
5xx are tried again with backoff (workers/retry.py) for up to webhook_retry_s; other answers
and redirects are final (failed). The cooldown (webhook_cooldown_s, per camera, event type and
line or zone) keeps a busy door from ringing a phone for every person: events inside it are not
sent to webhooks (counted as "suppressed"); MQTT and the records still get every one.

URLs: a webhook from the operator (the flags, the `.streams` file) may be any host, private
ones included (Home Assistant is on the LAN); one a remote caller gives (HTTP or Redis control)
passes the URL guard (workers/urlguard.py): public hosts only unless --allow-private-urls or
TANDEM_ALLOWED_URL_NETWORKS allow more. Either is checked again at every delivery and dialled
at the checked address.

MQTT (--mqtt HOST[:PORT], paho-mqtt, QoS 1; $TANDEM_MQTT_USERNAME / $TANDEM_MQTT_PASSWORD):

    tandem/<camera>/events     each event, the webhook's body
    tandem/<camera>/counts     the camera's running counts, retained: on change, at most once
                               per counts_interval_s (the newest counts, never dropped)
    tandem/available           "online", or "offline" (the broker's last will)
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.camera_push_sinks import MqttSink, WebhookSink, public_url
from workers.urlguard import DETECT_SCHEMES, UrlPolicy, parse_url

EVENT_TYPES = ("line_cross", "zone_enter", "zone_exit")
MAX_WEBHOOKS = 8  # per camera, and service-wide
_TYPES_PREFIX = re.compile(r"([a-z_]+(?:,[a-z_]+)*)=(.+)", re.DOTALL)
_TOPIC_PREFIX = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


@dataclass(slots=True, frozen=True)
class Webhook:
    url: str
    events: frozenset[str] = frozenset()  # empty: every type

    def wants(self, event_type: str) -> bool:
        return not self.events or event_type in self.events

    def to_dict(self) -> dict:
        return {"url": public_url(self.url), "events": sorted(self.events)}


def parse_webhooks(value: object, option: str = "webhook") -> tuple[Webhook, ...]:
    """Webhooks from text `[TYPE[,TYPE...]=]URL`, an object {"url", "events"?: [TYPE, ...]}, a
    list of those, or Webhooks; ValueError naming `option`. The URL's text is checked here
    (http or https, a host, no user:password@); where it may reach is checked when a camera is
    added and at every delivery."""
    if value is None or value == ():
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(items) > MAX_WEBHOOKS:
        raise ValueError(f"{option}: at most {MAX_WEBHOOKS} webhooks, got {len(items)}")
    out = []
    for item in items:
        if isinstance(item, Webhook):
            out.append(item)
            continue
        if isinstance(item, str):
            m = _TYPES_PREFIX.fullmatch(item.strip())
            url, events = (m.group(2), m.group(1).split(",")) if m else (item.strip(), [])
        elif isinstance(item, dict) and set(item) <= {"url", "events"} and "url" in item:
            url, events = item["url"], item.get("events") or []
            if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
                raise ValueError(f"{option}: events must be a list of {', '.join(EVENT_TYPES)}, got {events!r}")
        else:
            message = f'{option}: a webhook is "[TYPE,...=]URL" or {{"url", "events"?}}, got {item!r}'
            raise ValueError(message)
        bad = sorted(set(events) - set(EVENT_TYPES))
        if bad:
            raise ValueError(f"{option}: event type {bad[0]!r} is none of {', '.join(EVENT_TYPES)}")
        try:
            parse_url(url, UrlPolicy(schemes=DETECT_SCHEMES, any_host=True))  # text only: no I/O
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
        out.append(Webhook(url.strip(), frozenset(events)))
    return tuple(out)


def parse_broker(text: object) -> tuple[str, int]:
    """(host, port) from HOST[:PORT] ([::1]:1883 for IPv6; port 1883 by default)."""
    message = f"mqtt must be HOST[:PORT] of an MQTT broker, e.g. 127.0.0.1:1883, got {text!r}"
    if not isinstance(text, str) or not text.strip() or "/" in text:
        raise ValueError(message)
    text = text.strip()
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d+))?|([^:\s\[\]]+)(?::(\d+))?", text)
    if m is None:
        raise ValueError(message)
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    port = int(port) if port else 1883
    if not 1 <= port <= 65535:
        raise ValueError(message)
    return host, port


@dataclass(slots=True)
class PushConfig:
    """Where camera events go, checked without I/O (names as the CLI flags: a bad one is a
    ValueError naming its field). `webhook`: the service-wide webhooks (the operator's: any
    host). `remote_policy`: the guard of the webhooks a remote caller gives (None: public
    http(s) hosts only). `clock`: what the cooldown measures with (monotonic seconds)."""

    webhook: tuple = ()
    webhook_secret: str | None = None
    webhook_cooldown_s: float = 0.0
    webhook_timeout_s: float = 5.0
    webhook_retry_s: float = 30.0  # how long one event is retried, from its first failure
    webhook_retry_first_s: float = 0.5  # the first wait, doubled after each try (to 8 s)
    push_queue: int = 256  # items each sink holds for a slow receiver; more drop the oldest
    mqtt: str | None = None  # HOST[:PORT]
    mqtt_topic_prefix: str = "tandem"
    mqtt_username: str | None = None
    mqtt_password: str | None = None
    mqtt_counts_interval_s: float = 1.0
    remote_policy: UrlPolicy | None = None
    operator_policy: UrlPolicy | None = None  # None: any http(s) host, private ones included
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.webhook = parse_webhooks(self.webhook)
        checks = (
            ("webhook_cooldown_s", 0.0, 86400.0, True),
            ("webhook_timeout_s", 0.0, 300.0, False),
            ("webhook_retry_s", 0.0, 86400.0, True),
            ("webhook_retry_first_s", 0.0, 60.0, False),
            ("mqtt_counts_interval_s", 0.0, 3600.0, True),
        )
        for name, low, high, closed in checks:
            v = getattr(self, name)
            number = not isinstance(v, bool) and isinstance(v, (int, float))
            if not number or not (low <= v <= high if closed else low < v <= high):
                raise ValueError(f"{name} must be a number in {'[' if closed else '('}{low:g}, {high:g}] s, got {v!r}")
            setattr(self, name, float(v))
        q = self.push_queue
        if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= 100_000:
            raise ValueError(f"push_queue must be an integer in [1, 100000] items per sink, got {q!r}")
        if self.webhook_secret is not None and not (isinstance(self.webhook_secret, str) and self.webhook_secret):
            raise ValueError("webhook_secret must be a non-empty string (unset: requests are not signed)")
        if self.mqtt is not None:
            parse_broker(self.mqtt)
        if not isinstance(self.mqtt_topic_prefix, str) or not _TOPIC_PREFIX.fullmatch(self.mqtt_topic_prefix):
            message = "mqtt_topic_prefix must be words of [A-Za-z0-9._-] joined by '/', e.g. tandem"
            raise ValueError(f"{message}, got {self.mqtt_topic_prefix!r}")


class Pusher:
    """The service's sinks (one WebhookSink per URL and guard, one MqttSink) and the cameras'
    parts. Nothing starts until a sink is first needed."""

    def __init__(self, config: PushConfig | None, instance: str) -> None:
        self.config = config = config or PushConfig()
        self.instance = instance
        self.operator_policy = config.operator_policy or UrlPolicy(
            schemes=DETECT_SCHEMES, any_host=True, allow_private=True
        )
        self.remote_policy = config.remote_policy or UrlPolicy(schemes=DETECT_SCHEMES, any_host=True)
        self._lock = threading.Lock()
        self._webhooks: dict[tuple[str, bool], WebhookSink] = {}
        self._users: dict[tuple[str, bool], int] = {}  # cameras' own webhooks: cameras using each sink
        self.mqtt: MqttSink | None = None
        if config.mqtt is not None:
            host, port = parse_broker(config.mqtt)
            self.mqtt = MqttSink(
                host,
                port,
                config.mqtt_topic_prefix,
                client_id=f"tandem-{instance}"[:64],
                username=config.mqtt_username,
                password=config.mqtt_password,
                max_queue=config.push_queue,
                counts_interval_s=config.mqtt_counts_interval_s,
            )

    def policy(self, remote: bool) -> UrlPolicy:
        return self.remote_policy if remote else self.operator_policy

    def camera(
        self, camera_id: str, webhooks: tuple[Webhook, ...] = (), *, remote: bool, cooldown_s: float | None = None
    ) -> CameraPush | None:
        """A camera's part (None: nowhere to push). `remote`: its webhooks came from a remote
        caller, so they go through remote_policy (already checked by the service's add())."""
        c = self.config
        hooks = [(w, self._sink(w.url, False)) for w in c.webhook]
        if not hooks and not webhooks and self.mqtt is None:
            return None
        own = list(dict.fromkeys((w.url, remote) for w in webhooks))
        with self._lock:
            for key in own:
                self._users[key] = self._users.get(key, 0) + 1
        hooks += [(w, self._sink(w.url, remote)) for w in webhooks]
        cooldown = c.webhook_cooldown_s if cooldown_s is None else cooldown_s
        return CameraPush(camera_id, hooks, self.mqtt, c.mqtt_topic_prefix, cooldown, c.clock, own)

    def release(self, push: CameraPush | None) -> None:
        """A camera is gone: the sinks of webhooks only it used end (what they still hold is
        counted dropped), so cameras added and removed with new URLs leave no threads behind."""
        if push is None:
            return
        ended = []
        with self._lock:
            for key in push.own:
                self._users[key] -= 1
                if self._users[key] == 0 and key not in {(w.url, False) for w in self.config.webhook}:
                    del self._users[key]
                    ended.append(self._webhooks.pop(key))
        for sink in ended:
            sink.close(0.0)

    def _sink(self, url: str, remote: bool) -> WebhookSink:
        c = self.config
        with self._lock:
            sink = self._webhooks.get((url, remote))
            if sink is None:
                sink = self._webhooks[(url, remote)] = WebhookSink(
                    url,
                    self.policy(remote),
                    secret=c.webhook_secret,
                    timeout_s=c.webhook_timeout_s,
                    retry_first_s=c.webhook_retry_first_s,
                    retry_budget_s=c.webhook_retry_s,
                    max_queue=c.push_queue,
                )
            return sink

    def sinks(self) -> list:
        with self._lock:
            return [*self._webhooks.values(), *([self.mqtt] if self.mqtt is not None else [])]

    def stats(self) -> list[dict]:
        """Per sink: {"sink" (its name), "sent", "failed", "dropped", "queued"} (MQTT: and
        "connected"), all cameras together: the service's payload "push"."""
        return [{"sink": s.name, **s.stats()} for s in self.sinks()]

    def close(self, timeout: float = 2.0) -> None:
        """Deliver what is queued, for at most `timeout` s in all; the rest is counted dropped."""
        deadline = time.monotonic() + timeout
        for sink in self.sinks():
            sink.close(max(0.05, deadline - time.monotonic()))


class CameraPush:
    """One camera's pushes: on_events() from the publisher thread, in frame order. Only queues
    (workers/camera_push_sinks.py): never waits on a receiver."""

    def __init__(
        self, camera_id: str, hooks: list, mqtt: MqttSink | None, prefix: str, cooldown_s: float, clock, own=()
    ):
        self.camera_id, self.hooks, self.mqtt, self.cooldown_s, self.clock = camera_id, hooks, mqtt, cooldown_s, clock
        self.own = tuple(own)  # (url, remote) of its own webhooks' sinks, for Pusher.release
        self.topic = f"{prefix}/{camera_id}/events"
        self._last_sent: dict[tuple, float] = {}  # (sink, type, line or zone) -> when last sent
        self.suppressed: dict[str, int] = {}  # sink name -> events the cooldown kept back
        self._counts: dict | None = None

    def on_events(self, events: list[dict], counts: dict | None) -> None:
        """A frame's events (their "clip" set already) and the camera's counts after them."""
        now = self.clock()
        for event in events:
            kind = event.get("type", "")
            message = {"camera": self.camera_id, **event, "counts": counts}
            body = json.dumps(message, separators=(",", ":")).encode()
            where = event.get("line", event.get("zone"))
            for hook, sink in self.hooks:
                if not hook.wants(kind):
                    continue
                key = (sink, kind, where)
                last = self._last_sent.get(key)
                if last is not None and now - last < self.cooldown_s:
                    self.suppressed[sink.name] = self.suppressed.get(sink.name, 0) + 1
                    continue
                self._last_sent[key] = now
                sink.put(self.camera_id, (kind, body))
            if self.mqtt is not None:
                self.mqtt.put(self.camera_id, (self.topic, body, False))
        if self.mqtt is not None and counts is not None and counts != self._counts:
            self._counts = counts
            self.mqtt.set_counts(self.camera_id, counts)

    def stats(self) -> dict:
        """The camera row's "push": {sink name: {"sent", "failed", "dropped", "suppressed"}}."""
        sinks = {s.name: s for _, s in self.hooks}
        if self.mqtt is not None:
            sinks[self.mqtt.name] = self.mqtt
        return {
            name: {**s.stats(self.camera_id), "suppressed": self.suppressed.get(name, 0)} for name, s in sinks.items()
        }

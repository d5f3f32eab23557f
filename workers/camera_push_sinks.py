"""Where camera events are pushed (workers/camera_push.py routes them): a webhook (an HTTP POST
through the URL guard, signed, retried with backoff) and an MQTT broker (paho-mqtt).

Each sink is a bounded queue drained by its own thread, so a dead or hanging receiver costs
its own thread's time and nothing else: put() never waits, and a full queue drops its oldest
item (counted per camera as "dropped"; the newest events are the ones a person still acts on).

    publisher ──put()──> Sink queue (max_queue items) ──its thread──> receiver
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import math
import ssl
import threading
import time
from collections import deque

from workers.retry import Backoff
from workers.urlguard import CheckedUrl, UrlPolicy, check_url, pinned_connection

log = logging.getLogger("tandem.cameras")

OUTCOMES = ("sent", "failed", "dropped")
MAX_ANSWER_BYTES = 64 << 10  # a webhook's answer is read (so the connection ends cleanly), then discarded
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})  # worth another try; other answers are final
SIGNATURE_HEADER, TIMESTAMP_HEADER = "X-Tandem-Signature", "X-Tandem-Timestamp"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """`sha256=<hex>`: HMAC-SHA256 with `secret` over "<timestamp>.<body>". The timestamp is
    signed with the body (Stripe's and Slack's way) so a receiver that refuses old timestamps
    cannot be fed a captured request again with a fresh one."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


class Retry(Exception):
    """A delivery that may succeed if tried again (no connection, a timeout, a 5xx or 429)."""


class Sink:
    """A bounded queue of (camera_id, item) and the thread that delivers them (deliver())."""

    def __init__(self, name: str, max_queue: int) -> None:
        self.name, self.max_queue = name, max_queue
        self._cond = threading.Condition()
        self._items: deque[tuple[str, object]] = deque()
        self._closing = False
        self._outcomes: dict[str, dict[str, int]] = {}  # camera -> outcome -> n, under _cond
        self._stop = threading.Event()  # close(): backoff waits end early
        self._thread = threading.Thread(target=self._run, name=f"tandem-push-{name}"[:60], daemon=True)
        self._thread.start()

    def put(self, camera_id: str, item: object) -> None:
        """Queue one item; never waits. A full queue drops its oldest item, counted."""
        with self._cond:
            if self._closing:
                self._count_locked(camera_id, "dropped")
                return
            if len(self._items) >= self.max_queue:
                old_camera, _ = self._items.popleft()
                self._count_locked(old_camera, "dropped")
            self._items.append((camera_id, item))
            self._cond.notify()

    def count(self, camera_id: str, outcome: str, n: int = 1) -> None:
        with self._cond:
            self._count_locked(camera_id, outcome, n)

    def _count_locked(self, camera_id: str, outcome: str, n: int = 1) -> None:
        per = self._outcomes.setdefault(camera_id, dict.fromkeys(OUTCOMES, 0))
        per[outcome] += n

    def stats(self, camera_id: str | None = None) -> dict:
        """{"sent", "failed", "dropped"} of one camera, or of all with "queued" (camera None)."""
        with self._cond:
            if camera_id is not None:
                return dict(self._outcomes.get(camera_id) or dict.fromkeys(OUTCOMES, 0))
            total = {o: sum(c[o] for c in self._outcomes.values()) for o in OUTCOMES}
            return {**total, "queued": len(self._items)}

    def close(self, timeout: float) -> None:
        """Deliver what is queued without retrying, for at most `timeout` s; the rest is dropped."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._stop.set()
        self._thread.join(timeout)
        with self._cond:  # left behind by a receiver that hangs: counted, not waited for
            while self._items:
                self._count_locked(self._items.popleft()[0], "dropped")

    def _due_locked(self, now: float, force: bool) -> tuple[list, float | None]:
        """Items that fall due by time rather than by put() (the MQTT counts), and how long
        until the next one does (None: none waits). `force`: all of them now (closing)."""
        return [], None

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    due, wait = self._due_locked(time.monotonic(), self._closing)
                    if self._items or due or self._closing:
                        break
                    self._cond.wait(wait)
                batch = due + ([self._items.popleft()] if self._items else [])
                if not batch:
                    return
            for camera_id, item in batch:
                try:
                    delivered = self.deliver(camera_id, item)
                    if delivered is not None:
                        self.count(camera_id, "sent" if delivered else "failed")
                except Exception:
                    log.exception("push %s: delivery failed", self.name)
                    self.count(camera_id, "failed")

    def deliver(self, camera_id: str, item: object) -> bool | None:
        """Whether the item reached the receiver (None: the sink counted it itself)."""
        raise NotImplementedError


class WebhookSink(Sink):
    """POSTs of JSON bodies to one URL, checked by `policy` (workers/urlguard.py) at every
    delivery and dialled at the checked address; signed when a secret is set. A delivery that
    fails with Retry is tried again after Backoff's waits, up to `retry_budget_s`."""

    def __init__(
        self,
        url: str,
        policy: UrlPolicy,
        *,
        secret: str | None,
        timeout_s: float,
        retry_first_s: float,
        retry_budget_s: float,
        max_queue: int,
        clock=time.time,
    ) -> None:
        self.url, self.policy, self.secret, self.timeout_s = url, policy, secret, timeout_s
        self.retry_first_s, self.retry_budget_s, self.clock = retry_first_s, retry_budget_s, clock
        self.retries = 0  # tries after a first one failed, all events together
        super().__init__(f"webhook {public_url(url)}", max_queue)

    def deliver(self, camera_id: str, item: object) -> bool:
        event_type, body = item
        backoff = Backoff(self.retry_first_s, budget_s=self.retry_budget_s, max_s=max(self.retry_first_s, 8.0))
        while True:
            try:
                self._post(event_type, body)
                return True
            except Retry as exc:
                delay = None if self._stop.is_set() else backoff.next_s()
                if delay is None:
                    log.warning("webhook %s: gave up on a %s event: %s", public_url(self.url), event_type, exc)
                    return False
                self.retries += 1
                if self._stop.wait(delay):
                    return False
            except ValueError as exc:  # the guard refused the URL, or the receiver's answer is final
                log.warning("webhook %s: %s", public_url(self.url), exc)
                return False

    def stats(self, camera_id: str | None = None) -> dict:
        out = super().stats(camera_id)
        return out if camera_id is not None else {**out, "retries": self.retries}

    def _post(self, event_type: str, body: bytes) -> None:
        try:
            checked = check_url(self.url, self.policy)  # again now: a name that moved is checked again
        except ValueError as exc:
            if "cannot resolve" in str(exc):  # DNS down for a moment: worth another try, unlike a refusal
                raise Retry(str(exc)) from None
            raise
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "tandem",
            "X-Tandem-Event": event_type,
            "Connection": "close",
        }
        timestamp = str(int(self.clock()))
        headers[TIMESTAMP_HEADER] = timestamp
        if self.secret:
            headers[SIGNATURE_HEADER] = signature(self.secret, timestamp, body)
        status, reason = _post(checked, body, headers, self.timeout_s, self.policy.ssl_context)
        if 200 <= status < 300:
            return
        if status in RETRY_STATUSES:
            raise Retry(f"the receiver answered {status} {reason}")
        raise ValueError(f"the receiver answered {status} {reason} (not retried; redirects are not followed)")


def _post(
    url: CheckedUrl, body: bytes, headers: dict, timeout_s: float, context: ssl.SSLContext | None
) -> tuple[int, str]:
    """One POST to the checked address (urlguard.pinned_connection: no second lookup, one
    deadline from dialling to the last byte, as urlguard.fetch has); (status, reason). Retry
    for what a later try may fix."""
    expired = threading.Event()
    try:
        with pinned_connection(url, time.monotonic() + timeout_s, context, expired) as conn:
            conn.request("POST", url.target, body=body, headers=headers)
            resp = conn.getresponse()
            resp.read(MAX_ANSWER_BYTES)
            if expired.is_set():
                raise TimeoutError
            return resp.status, resp.reason
    except TimeoutError:
        raise Retry(f"no answer within {timeout_s:g} s") from None
    except ssl.SSLError as exc:  # a certificate that does not match: no retry fixes it
        raise ValueError(f"TLS with {url.host!r} failed: {exc}") from None
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise Retry(f"no answer within {timeout_s:g} s") from None
        raise Retry(f"{type(exc).__name__}: {exc}") from None


def public_url(url: str) -> str:
    """scheme://host[:port]/path: what names a webhook in logs, rows and /metrics (its query
    may carry a token, its userinfo a password)."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(a malformed url)"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{port}{parts.path}"


class MqttSink(Sink):
    """Messages to an MQTT broker through paho-mqtt, QoS 1: paho keeps up to `max_queue`
    unacknowledged ones across a reconnect (more are dropped, counted); "sent" counts the
    broker's acknowledgements. `<prefix>/available` is "online" while connected and "offline"
    (the broker's last will) after, as Frigate's `frigate/available`."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        *,
        client_id: str,
        username: str | None = None,
        password: str | None = None,
        max_queue: int,
        counts_interval_s: float = 1.0,
        keepalive_s: int = 30,
    ) -> None:
        import paho.mqtt.client as mqtt

        self.host, self.port, self.prefix, self.counts_interval_s = host, port, prefix, counts_interval_s
        self.connected = False
        self._counts_due: dict[str, dict] = {}  # camera -> its newest counts not yet published
        self._counts_at: dict[str, float] = {}  # camera -> when its counts were last published
        self._pending: dict[int, str] = {}  # mid -> camera, awaiting the broker's PUBACK
        self._acked: set[int] = set()  # PUBACKs that beat publish()'s return to us
        self._lock = threading.Lock()
        self._acks = threading.Condition(self._lock)  # close() waits for the last PUBACKs
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        if username:
            client.username_pw_set(username, password)
        client.max_queued_messages_set(max_queue)
        client.reconnect_delay_set(1, 30)
        client.will_set(f"{prefix}/available", "offline", qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        self.client = client
        super().__init__(f"mqtt {host}:{port}", max_queue)
        client.connect_async(host, port, keepalive_s)  # a broker that is down now is retried by paho
        client.loop_start()

    def set_counts(self, camera_id: str, counts: dict) -> None:
        """A camera's running counts changed: published (retained) now, or, within
        counts_interval_s of its last, then with the newest counts; never dropped, only merged."""
        with self._cond:
            self._counts_due[camera_id] = counts
            self._cond.notify()

    def _due_locked(self, now: float, force: bool) -> tuple[list, float | None]:
        due, wait = [], None
        for camera_id, counts in list(self._counts_due.items()):
            left = self._counts_at.get(camera_id, -math.inf) + self.counts_interval_s - now
            if left <= 0 or force:
                del self._counts_due[camera_id]
                self._counts_at[camera_id] = now
                due.append((camera_id, (f"{self.prefix}/{camera_id}/counts", counts, True)))
            else:
                wait = left if wait is None else min(wait, left)
        return due, wait

    def deliver(self, camera_id: str, item: object) -> None:
        topic, payload, retain = item
        body = payload if isinstance(payload, (bytes, str)) else json.dumps(payload, separators=(",", ":"))
        info = self.client.publish(topic, body, qos=1, retain=retain)
        import paho.mqtt.client as mqtt

        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):  # NO_CONN: queued for the reconnect
            self.count(camera_id, "dropped" if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE else "failed")
            return None
        with self._lock:
            if info.mid in self._acked:
                self._acked.discard(info.mid)
                acked = True
            else:
                self._pending[info.mid] = camera_id
                acked = False
        if acked:
            self.count(camera_id, "sent")
        return None  # "sent" is counted when the broker acknowledges it

    def _on_publish(self, client, userdata, mid, reason_code=None, properties=None) -> None:
        with self._lock:
            camera_id = self._pending.pop(mid, None)
            if camera_id is None:
                self._acked.add(mid)
            self._acks.notify_all()
        if camera_id:  # "": this service's own availability message
            self.count(camera_id, "sent")

    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        if getattr(reason_code, "is_failure", False):
            log.warning("mqtt %s:%s refused the connection: %s", self.host, self.port, reason_code)
            return
        self.connected = True
        info = client.publish(f"{self.prefix}/available", "online", qos=1, retain=True)
        with self._lock:  # its PUBACK comes on this (the network) thread, after this returns
            self._pending[info.mid] = ""
        log.info("mqtt: connected to %s:%s", self.host, self.port)

    def _on_disconnect(self, client, userdata, flags, reason_code=None, properties=None) -> None:
        if self.connected:
            log.warning("mqtt: lost %s:%s (%s); paho reconnects", self.host, self.port, reason_code)
        self.connected = False

    def stats(self, camera_id: str | None = None) -> dict:
        out = super().stats(camera_id)
        return out if camera_id is not None else {**out, "connected": int(self.connected)}

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        super().close(timeout)
        with self._acks:  # what was published is counted when the broker acknowledges it
            if self.connected:
                self._acks.wait_for(lambda: not self._pending, max(0.0, deadline - time.monotonic()))
        self.connected = False  # a disconnect now is ours, not an outage to warn about
        try:
            self.client.publish(f"{self.prefix}/available", "offline", qos=1, retain=True)
            self.client.disconnect()
        finally:
            self.client.loop_stop()

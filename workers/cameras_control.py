"""The camera service's control (workers/cameras.py composes it): commands that add and remove
cameras, checked one way whether they come from the Redis control list (a thread here) or the
HTTP control (server/streams_app.py, through CameraService.apply).

    tandem:control:cameras:{instance}              list: JSON commands {"op": "add"|"remove", ...}
    tandem:control:cameras:{instance}:reply:{id}   list: the answer to the command with "id"
"""

from __future__ import annotations

import json
import logging
import threading

from workers.camera_checks import CAMERA_ID, OPTION_FIELDS, CameraError, check_camera_id, json_object

log = logging.getLogger("tandem.cameras")

# Not under tandem:cameras:, where a camera named "control" would collide with it.
CONTROL_KEY = "tandem:control:cameras:"
REPLY_TTL_S = 60


class Control:
    """Commands for `cameras` (a CameraService) pushed to its instance's list in `redis_client`
    (None: command() still answers, with no reply pushed)."""

    def __init__(self, cameras, redis_client, instance: str) -> None:
        self.cameras, self.redis, self.instance = cameras, redis_client, instance
        self._stop = threading.Event()

    def stop(self) -> None:
        """run() ends within its BLPOP timeout."""
        self._stop.set()

    def run(self) -> None:
        """The control thread: take commands off the list until stop()."""
        from redis.exceptions import RedisError

        key = CONTROL_KEY + self.instance
        while not self._stop.is_set():
            try:
                item = self.redis.blpop([key], timeout=0.25)  # short: close() waits for it
            except RedisError as exc:
                log.warning("control list %s: %s; retrying", key, exc)
                self._stop.wait(1.0)
                continue
            if item is not None:
                self.command(item[1])

    def command(self, raw: str | bytes) -> dict:
        """Run one control command, JSON {"op": "add", "camera", "url", options?} or {"op":
        "remove", "camera"}, with an optional "id" ([A-Za-z0-9._-]{1,64}) under which the answer
        {"ok", "camera" row | "error", "field"} is pushed for the sender (kept REPLY_TTL_S)."""
        reply_id = None
        try:
            cmd = json_object(raw, "command", "a command must be a JSON object")
            if "id" in cmd:
                if not isinstance(cmd["id"], str) or not CAMERA_ID.fullmatch(cmd["id"]):
                    raise CameraError("id", f"id must be 1-64 characters of [A-Za-z0-9._-], got {cmd['id']!r}")
                reply_id = cmd["id"]
            answer = {"ok": True, "camera": apply(self.cameras, {k: v for k, v in cmd.items() if k != "id"})}
        except CameraError as exc:
            answer = {"ok": False, "error": str(exc), "field": exc.field}
            log.warning("control command refused: %s", exc)
        except RuntimeError as exc:  # closed
            answer = {"ok": False, "error": str(exc), "field": None}
        if reply_id is not None and self.redis is not None:
            from redis.exceptions import RedisError

            reply_key = f"{CONTROL_KEY}{self.instance}:reply:{reply_id}"
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(reply_key, json.dumps(answer))
            pipe.expire(reply_key, REPLY_TTL_S)
            try:
                pipe.execute()
            except RedisError as exc:
                log.warning("could not answer command %s: %s", reply_id, exc)
        return answer


def apply(cameras, cmd: dict) -> dict:
    """{"op": "add", "camera", "url", and optionally OPTION_FIELDS (see CameraService.add)} or
    {"op": "remove", "camera"}, applied to `cameras` (a CameraService): the camera's row. Shared
    by the Redis and HTTP control; remote urls must be stream URLs."""
    op = cmd.get("op")
    allowed = {"add": {"op", "camera", "url", *OPTION_FIELDS}, "remove": {"op", "camera"}}.get(op)
    if allowed is None:
        raise CameraError("op", f"op must be 'add' or 'remove', got {op!r}")
    unknown = sorted(set(cmd) - allowed)
    if unknown:
        names = ", ".join(map(repr, unknown))
        message = f"unknown field(s) {names} for op {op!r}; allowed: {', '.join(sorted(allowed))}"
        raise CameraError(unknown[0], message)
    for name in sorted(allowed - set(OPTION_FIELDS)):
        if name not in cmd:
            raise CameraError(name, f"{name} is required for op {op!r}")
    if op == "add":
        options = {k: cmd[k] for k in OPTION_FIELDS[1:] if k in cmd}
        return cameras.add(cmd["camera"], cmd["url"], cmd.get("max_fps"), **options)
    return cameras.remove(check_camera_id(cmd["camera"]))

"""What a camera command may hold, checked before the camera service acts on it: ids, rates,
per-camera options and stream URLs, each refusal a CameraError naming its field. Shared by
CameraService (workers/cameras.py), its HTTP control (server/streams_app.py) and the `.streams`
file (streams_file.py), so the three take the same names with the same rules. Also the
service's own settings (CameraServiceConfig), checked as they are given."""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, replace

from sources.base import is_stream_url
from sources.stream_reader import Dialled, StreamConfig
from workers.camera_clips import ClipConfig
from workers.camera_push import PushConfig, parse_webhooks
from workers.urlguard import CAMERA_SCHEMES, UrlPolicy, check_url

CAMERA_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
INSTANCE = re.compile(r"[A-Za-z0-9._:@-]{1,200}")
MAX_URL = 2048
POLICIES = ("freshest", "every_frame")
MAX_CLIP_PRE_S, MAX_CLIP_POST_S = 60.0, 300.0
_SWITCH = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}


class CameraError(ValueError):
    """Bad input for a camera; `field` names the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class CameraNotFound(CameraError):
    pass


class CameraConflict(CameraError):
    """The id is taken, or the service has all the cameras it may have."""


def json_object(raw: str | bytes, field: str, message: str) -> dict:
    """`raw` parsed as a JSON object, else CameraError(field, message)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CameraError(field, message) from None
    if not isinstance(obj, dict):
        raise CameraError(field, message)
    return obj


def check_camera_id(camera_id: object) -> str:
    if not isinstance(camera_id, str) or not CAMERA_ID.fullmatch(camera_id):
        raise CameraError("camera", f"camera must be 1-64 characters of [A-Za-z0-9._-], got {camera_id!r}")
    return camera_id


def check_instance(instance: object, name: str = "instance") -> str:
    if not isinstance(instance, str) or not INSTANCE.fullmatch(instance):
        raise ValueError(f"{name} must be 1-200 characters of [A-Za-z0-9._:@-], got {instance!r}")
    return instance


def check_max_fps(max_fps: object, name: str = "max_fps") -> float | None:
    if max_fps is None:
        return None
    if isinstance(max_fps, bool) or not isinstance(max_fps, (int, float)) or not 0 < max_fps <= 1000:
        message = f"{name} must be a number in (0, 1000] frames per second (unset: no cap), got {max_fps!r}"
        raise CameraError(name, message)
    return float(max_fps)


def is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


@dataclass(slots=True, frozen=True)
class CameraOptions:
    """A camera's options, the same names over add(), HTTP, the Redis control list and the
    `.streams` file; check() raises CameraError naming the field."""

    policy: str = "freshest"
    queue: int = 30  # every_frame: the FIFO's bound (freshest keeps one frame)
    max_staleness_ms: float | None = None  # None: frames are never too old
    motion_threshold: float | None = None  # None: no motion gate
    tracker: str | None = None  # None, "bytetrack" or "botsort"
    lines: tuple = ()  # LineSpecs (runtime/vision/analytics.py); check() parses text or lists
    zones: tuple = ()  # ZoneSpecs, likewise
    # Event clips (workers/camera_clips.py): None: on where the service has a clips dir and the
    # camera has lines or zones; "off"/False keeps this camera out; "on"/True insists.
    clips: bool | str | None = None
    clip_pre_s: float = 5.0  # seconds before the event (Frigate's pre_capture)
    clip_post_s: float = 5.0  # seconds after the last event of the clip (post_capture)
    # This camera's own webhooks (workers/camera_push.py: text "[TYPE,...=]URL", objects or a
    # list), besides the service's; webhook_cooldown_s None: the service's cooldown.
    webhook: tuple = ()
    webhook_cooldown_s: float | None = None

    def check(self) -> CameraOptions:
        if self.policy not in POLICIES:
            raise CameraError("policy", f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        q = self.queue
        if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= 1000:
            raise CameraError("queue", f"queue must be an integer in [1, 1000] frames (every_frame's FIFO), got {q!r}")
        age = self.max_staleness_ms
        if age is not None and (not is_number(age) or not 0 < age <= 3_600_000):
            message = f"max_staleness_ms must be a number in (0, 3600000] ms (unset: no limit), got {age!r}"
            raise CameraError("max_staleness_ms", message)
        if self.motion_threshold is not None:
            from runtime.vision.motion import check_threshold

            try:
                check_threshold(self.motion_threshold)
            except ValueError as exc:
                raise CameraError("motion_threshold", str(exc)) from None
        if self.tracker is not None:
            try:
                from runtime.vision.tracking import TRACKERS
            except ImportError as exc:  # Ultralytics' trackers need its extras (lap)
                raise CameraError("tracker", f"tracker {self.tracker!r} is not available here: {exc}") from None
            if self.tracker not in TRACKERS:
                message = f"tracker must be one of {', '.join(TRACKERS)} (unset: none), got {self.tracker!r}"
                raise CameraError("tracker", message)
        return self._check_clips()._check_analytics()._check_push()

    def _check_push(self) -> CameraOptions:
        try:
            hooks = parse_webhooks(() if self.webhook is None else self.webhook)
        except ValueError as exc:
            raise CameraError("webhook", str(exc)) from None
        if hooks and not (self.lines or self.zones):
            raise CameraError("webhook", "webhooks carry line and zone events: add lines= or zones=")
        cool = self.webhook_cooldown_s
        if cool is not None and (not is_number(cool) or not 0 <= cool <= 86400):
            message = f"webhook_cooldown_s must be a number in [0, 86400] s (unset: the service's), got {cool!r}"
            raise CameraError("webhook_cooldown_s", message)
        return replace(self, webhook=hooks, webhook_cooldown_s=None if cool is None else float(cool))

    def _check_clips(self) -> CameraOptions:
        clips = self.clips
        if isinstance(clips, str):
            clips = _SWITCH.get(clips.strip().lower(), clips)
        if clips is not None and not isinstance(clips, bool):
            raise CameraError("clips", f"clips must be on or off (unset: on with --clips-dir), got {self.clips!r}")
        for name, most in (("clip_pre_s", MAX_CLIP_PRE_S), ("clip_post_s", MAX_CLIP_POST_S)):
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value <= most:
                raise CameraError(name, f"{name} must be a number in [0, {most:g}] seconds, got {value!r}")
        return replace(self, clips=clips, clip_pre_s=float(self.clip_pre_s), clip_post_s=float(self.clip_post_s))

    def _check_analytics(self) -> CameraOptions:
        """lines= and zones= parsed (text, a list of objects, or specs already), each needing the
        camera's tracker: a crossing is a track's, not a box's."""
        from runtime.vision.analytics import parse_lines, parse_zones

        parsed = {}
        for name, parse in (("lines", parse_lines), ("zones", parse_zones)):
            value = getattr(self, name)
            try:
                parsed[name] = parse(() if value is None else value)
            except ValueError as exc:
                raise CameraError(name, str(exc)) from None
            if parsed[name] and self.tracker is None:
                message = f"{name} need tracking on the camera: add tracker=bytetrack (or botsort)"
                raise CameraError(name, message)
        return replace(self, **parsed)


OPTION_FIELDS = (
    "max_fps",
    "policy",
    "queue",
    "max_staleness_ms",
    "motion_threshold",
    "tracker",
    "lines",
    "zones",
    "clips",
    "clip_pre_s",
    "clip_post_s",
    "webhook",
    "webhook_cooldown_s",
)


@dataclass(slots=True)
class CameraServiceConfig:
    """A camera service's settings (workers/cameras.py), checked when built, without I/O: a bad
    one is a ValueError naming its field and the range it may take.

    `maxlen`: records kept per camera stream in Redis (approximate trimming). `max_fps`: the
    default rate cap of a camera (None: as fast as the detector takes them). `instance`: this
    service's name in Redis and /metrics (None: host and pid). `stream_config` None: the
    defaults, with the Runtime's max_image_pixels (VisionConfig), so a camera whose frames are
    over it goes down naming the limit before a frame is decoded. `max_in_flight`: frames of
    one camera in the Runtime at once; newer frames replace older ones in the reader's slot
    meanwhile, so a slow detector drops frames instead of queueing them. `publish_interval_s`:
    how often the service's /metrics payload goes to Redis. `control`: answer commands pushed to
    the Redis control list. `url_policy` (or `allowed_url_prefixes`, not both): the guard of
    remotely added cameras (workers/urlguard.py; default: any public host). `batch_timeout_ms`:
    how long the muxer holds a group for the live cameras still to come (None: derived from
    their rates, see workers/cameras_mux.py; 0: no holding). `clips`: where event clips go and
    their bounds (workers/camera_clips.py; None: no clips). `push`: the webhooks and MQTT broker
    line and zone events go to (workers/camera_push.py; None: only cameras' own webhooks)."""

    maxlen: int = 1000
    max_fps: float | None = None
    instance: str | None = None
    stream_config: StreamConfig | None = None
    max_in_flight: int = 2
    max_cameras: int = 64
    publish_interval_s: float = 2.0
    control: bool = True
    allowed_url_prefixes: tuple[str, ...] = ()
    url_policy: UrlPolicy | None = None
    batch_timeout_ms: float | None = None
    clips: ClipConfig | None = None
    push: PushConfig | None = None

    def __post_init__(self) -> None:
        for name in ("maxlen", "max_in_flight", "max_cameras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_fps = check_max_fps(self.max_fps)
        timeout = self.batch_timeout_ms
        if timeout is not None and (not is_number(timeout) or not 0 <= timeout <= 1000):
            message = (
                f"batch_timeout_ms must be a number in [0, 1000] ms (unset: derived from the rates), got {timeout!r}"
            )
            raise ValueError(message)
        interval = self.publish_interval_s
        if not is_number(interval) or not interval > 0:
            raise ValueError(f"publish_interval_s must be a number > 0, got {interval!r}")
        self.publish_interval_s = float(interval)
        if self.instance is not None:
            check_instance(self.instance)
        if self.url_policy is not None and any(self.allowed_url_prefixes):
            raise ValueError("allowed_url_prefixes: give them in url_policy (camera_policy(prefixes)), not both")

    @property
    def batch_timeout_s(self) -> float | None:
        return None if self.batch_timeout_ms is None else self.batch_timeout_ms / 1000.0


def check_stream_url(url: object) -> str:
    """A network stream URL, the only kind a remote caller may add: a local path or a webcam
    index would let anyone who reaches the control endpoint open files on this host."""
    kinds = "rtsp://, rtsps://, rtmp://, http(s)://, tcp:// or udp://"
    if not isinstance(url, str) or not url.strip():
        raise CameraError("url", f"url must be a stream URL ({kinds}), got {url!r}")
    url = url.strip()
    if len(url) > MAX_URL or any(c.isspace() or ord(c) < 32 for c in url):
        raise CameraError("url", f"url must be at most {MAX_URL} characters without spaces or control characters")
    if not is_stream_url(url):
        raise CameraError(
            "url",
            f"url must be a stream URL ({kinds}); local files and webcams only come from the .streams file, "
            f"got {redact(url)!r}",
        )
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise CameraError("url", f"url is malformed ({exc}): {redact(url)!r}") from None
    if not parts.hostname:
        raise CameraError("url", f"url has no host: {redact(url)!r}")
    return url


def camera_policy(prefixes: tuple[str, ...] = (), env=None, **overrides) -> UrlPolicy:
    """The URL guard for cameras a remote caller adds: the stream schemes, any host unless
    `prefixes`, user:password@ allowed (RTSP cameras take credentials only there), and
    TANDEM_ALLOW_PRIVATE_URLS / TANDEM_ALLOWED_URL_NETWORKS from `env` (None: none read; the
    CLI passes os.environ). Cameras on a LAN need one of those: private addresses are refused."""
    prefixes = tuple(p.strip() for p in prefixes if p and p.strip())
    kw = {"schemes": CAMERA_SCHEMES, "prefixes": prefixes, "any_host": not prefixes, "allow_userinfo": True}
    if env is None:
        return UrlPolicy(**{**kw, **overrides})
    return UrlPolicy.from_env(env, **kw, **overrides)


def dial_camera(policy: UrlPolicy, url: str) -> Dialled:
    """What a camera's reader connects to, checked again at every (re)connect, so a name that
    moves to a refused address is refused then (and the camera shows down, naming why).

    FFmpeg opens the URL with the checked IP in place of the name, so it does not resolve the
    name again. What stays outside the guard: the RTSP server's own redirects, which FFmpeg
    follows; rtsps:// then has no SNI (FFmpeg does not verify certificates by default anyway)."""
    checked = check_url(url, policy)
    return Dialled(checked.url, checked.pinned(), checked.addresses[0])


def redact(text: str | None) -> str | None:
    """`text` with the password of any URL in it masked (rtsp://user:***@host/...)."""
    return None if text is None else re.sub(r"(://[^/\s:@]*):[^/\s@]*@", r"\1:***@", text)

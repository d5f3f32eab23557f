"""Lines and zones over one camera's tracks: line crossings with their direction, zone entries,
exits, occupancy and time in zone (dwell), fed one frame at a time with the tracker's output
(runtime/vision/tracking.py). Pure geometry and per-track state: no torch, no I/O.

    analytics = CameraAnalytics(parse_lines("door:0,0.6,1,0.6"), parse_zones("bay:0.1,0.1,0.4,0.1,0.4,0.5,0.1,0.5:car"))
    events = analytics.update(boxes_xyxy, class_names, track_ids, t=captured_at, size=(width, height))
    analytics.counts  # {"lines": {"door": {"in": 3, "out": 1}}, "zones": {"bay": {"occupancy": 1, ...}}}

Coordinates are fractions of the image (0,0 top left, 1,1 bottom right), as Frigate's zones and
DeepStream's nvdsanalytics take them after scaling, so a camera's resolution may change. Each
box is reduced to one reference point, its bottom centre (where an object stands on the ground;
Ultralytics' and DeepStream's counters use it too).

Direction: a line runs from its first point to its second. Walking it so on the image seen as
a map, "in" is the side on your right hand: for `0,0.6,1,0.6` (left to right) moving down
across it is in; for `0.5,0,0.5,1` (top to bottom) moving left is in. Swap the points to flip.

Hysteresis, so that a track jittering on a line or a zone's edge is counted once: a band of
`margin` (a fraction of the image, default 0.02) either side of a line or an edge decides
nothing. A track's side of a line changes only once it is more than `margin` beyond it, and only
then is the crossing counted; to cross back it must leave the band on the first side again. A
track stopped on the line stays on the side it came from. Zones likewise: a track enters once
it is inside by more than `margin` and leaves once it is outside by more than `margin`.

A track not seen for `lost_s` seconds is forgotten; if it was in a zone, that is its exit (the
event says "lost": true, its dwell ends when it was last seen). Track ids None (a box no
confirmed track took) are skipped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
DEFAULT_MARGIN = 0.02
DEFAULT_LOST_S = 1.0  # about ByteTrack's lost-track buffer (30 frames at 30 fps)
MAX_SHAPES = 32  # lines (or zones) per camera: each costs a test per box per frame
MAX_POINTS = 64  # a zone's corners


@dataclass(slots=True, frozen=True)
class LineSpec:
    name: str
    a: tuple[float, float]
    b: tuple[float, float]
    classes: frozenset[str] = frozenset()  # empty: every class
    margin: float = DEFAULT_MARGIN

    def to_dict(self) -> dict:
        return {"name": self.name, "points": [list(self.a), list(self.b)], "classes": sorted(self.classes)}


@dataclass(slots=True, frozen=True)
class ZoneSpec:
    name: str
    points: tuple[tuple[float, float], ...]
    classes: frozenset[str] = frozenset()
    margin: float = DEFAULT_MARGIN

    def to_dict(self) -> dict:
        return {"name": self.name, "points": [list(p) for p in self.points], "classes": sorted(self.classes)}


# ---- parsing: the `.streams` text, a JSON file's lists, or an HTTP body's ------------------


def parse_lines(value: object) -> tuple[LineSpec, ...]:
    """`lines=` as text (`NAME:X1,Y1,X2,Y2[:CLASS,...][;NAME:...]`) or a list of {"name",
    "points": [[x, y], [x, y]], "classes"?, "margin"?}; ValueError naming the option."""
    return _parse(value, "lines", _line)


def parse_zones(value: object) -> tuple[ZoneSpec, ...]:
    """`zones=` as text (`NAME:X1,Y1,X2,Y2,X3,Y3[,...][:CLASS,...][;NAME:...]`) or a list of
    {"name", "points": [[x, y], ...] (3 or more), "classes"?, "margin"?}; ValueError naming it."""
    return _parse(value, "zones", _zone)


def read_analytics_file(path: str) -> dict[str, tuple]:
    """A JSON file {"lines": [...], "zones": [...]} (the list forms of parse_lines and
    parse_zones): {"lines": specs, "zones": specs}; ValueError naming `analytics` and the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"analytics: cannot read {path}: {exc}") from None
    if not isinstance(obj, dict) or set(obj) - {"lines", "zones"}:
        raise ValueError(f'analytics: {path} must hold a JSON object {{"lines": [...], "zones": [...]}}')
    return {"lines": parse_lines(obj.get("lines", [])), "zones": parse_zones(obj.get("zones", []))}


def _parse(value: object, option: str, one) -> tuple:
    if isinstance(value, str):
        items = [_text_item(option, part) for part in value.split(";") if part.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"{option} must be text NAME:X,Y,... or a list of objects, got {type(value).__name__}")
    if len(items) > MAX_SHAPES:
        raise ValueError(f"{option}: at most {MAX_SHAPES} per camera, got {len(items)}")
    out = []
    for item in items:
        if isinstance(item, (LineSpec, ZoneSpec)):
            out.append(item)
            continue
        if not isinstance(item, dict) or set(item) - {"name", "points", "classes", "margin"}:
            raise ValueError(f'{option}: each must be {{"name", "points", "classes"?, "margin"?}}, got {item!r}')
        name = item.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{option}: a name must be 1-64 characters of [A-Za-z0-9._-], got {name!r}")
        out.append(one(option, name, _points(option, name, item.get("points")), _classes(option, name, item), item))
    names = [s.name for s in out]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{option}: {name} is given twice")
    return tuple(out)


def _text_item(option: str, text: str) -> dict:
    parts = text.strip().split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"{option}: {text.strip()!r} must be NAME:X1,Y1,X2,Y2,...[:CLASS,...]")
    try:
        flat = [float(v) for v in parts[1].split(",")]
    except ValueError:
        raise ValueError(f"{option}: {parts[0]}: the coordinates must be numbers, got {parts[1]!r}") from None
    if len(flat) % 2:
        raise ValueError(f"{option}: {parts[0]}: the coordinates must be x,y pairs, got {len(flat)} numbers")
    item = {"name": parts[0], "points": [flat[i : i + 2] for i in range(0, len(flat), 2)]}
    if len(parts) == 3:
        item["classes"] = [c for c in parts[2].split(",") if c]
    return item


def _points(option: str, name: str, points: object) -> tuple[tuple[float, float], ...]:
    ok = isinstance(points, (list, tuple)) and 0 < len(points) <= MAX_POINTS
    ok = ok and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in points)
    ok = ok and all(_is_number(v) and math.isfinite(v) and 0.0 <= v <= 1.0 for p in points for v in p)
    if not ok:
        message = (
            f"{option}: {name}: points must be up to {MAX_POINTS} [x, y] pairs, each in [0, 1] (fractions of the image)"
        )
        raise ValueError(message)
    return tuple((float(x), float(y)) for x, y in points)


def _classes(option: str, name: str, item: dict) -> frozenset[str]:
    classes = item.get("classes", [])
    if not isinstance(classes, (list, tuple)) or not all(isinstance(c, str) and c for c in classes):
        raise ValueError(f"{option}: {name}: classes must be a list of class names, got {classes!r}")
    return frozenset(classes)


def _margin(option: str, name: str, item: dict) -> float:
    margin = item.get("margin", DEFAULT_MARGIN)
    if not _is_number(margin) or not 0.0 <= margin <= 0.25:
        raise ValueError(f"{option}: {name}: margin must be a number in [0, 0.25] (a fraction of the image)")
    return float(margin)


def _line(option: str, name: str, points, classes, item: dict) -> LineSpec:
    if len(points) != 2:
        raise ValueError(f"{option}: {name}: a line is two points x1,y1,x2,y2, got {len(points)} points")
    if points[0] == points[1]:
        raise ValueError(f"{option}: {name}: a line's two points must differ")
    return LineSpec(name, points[0], points[1], classes, _margin(option, name, item))


def _zone(option: str, name: str, points, classes, item: dict) -> ZoneSpec:
    if len(points) < 3 or abs(_area(points)) < 1e-6:
        raise ValueError(f"{option}: {name}: a zone is a polygon of 3 or more points with an area")
    return ZoneSpec(name, points, classes, _margin(option, name, item))


def _is_number(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


# ---- geometry ------------------------------------------------------------------------------


def _area(points) -> float:
    return 0.5 * sum(x1 * y2 - x2 * y1 for (x1, y1), (x2, y2) in zip(points, points[1:] + points[:1]))


def side_of(line: LineSpec, p: tuple[float, float]) -> float:
    """Signed distance of `p` from the line (fractions of the image): > 0 on the "in" side."""
    return _side(_line_terms(line), p)


def _line_terms(line: LineSpec) -> tuple[float, ...]:
    """What side_of needs of a line, computed once per line rather than per box."""
    (ax, ay), (bx, by) = line.a, line.b
    return ax, ay, bx - ax, by - ay, math.hypot(bx - ax, by - ay)


def _side(terms: tuple[float, ...], p: tuple[float, float]) -> float:
    ax, ay, dx, dy, length = terms
    return (dx * (p[1] - ay) - dy * (p[0] - ax)) / length


def _along(line: LineSpec, p: tuple[float, float]) -> float:
    """Where `p` projects onto the segment: 0 at its first point, 1 at its second."""
    (ax, ay), (bx, by) = line.a, line.b
    dx, dy = bx - ax, by - ay
    return ((p[0] - ax) * dx + (p[1] - ay) * dy) / (dx * dx + dy * dy)


def _edges(points) -> list[tuple[float, ...]]:
    """What inside and edge_distance need of each edge, computed once per zone rather than per box."""
    out = []
    for (x1, y1), (x2, y2) in zip(points, points[1:] + points[:1]):
        dx, dy = x2 - x1, y2 - y1
        out.append((x1, y1, x2, y2, dx, dy, dx * dx + dy * dy or 1.0))
    return out


def inside(points, p: tuple[float, float]) -> bool:
    """Even-odd ray casting."""
    return _inside(_edges(points), p)


def _inside(edges: list[tuple[float, ...]], p: tuple[float, float]) -> bool:
    x, y = p
    hit = False
    for x1, y1, x2, y2, _, _, _ in edges:
        if (y1 > y) != (y2 > y) and x < x1 + (y - y1) * (x2 - x1) / (y2 - y1):
            hit = not hit
    return hit


def edge_distance(points, p: tuple[float, float]) -> float:
    return _edge_distance(_edges(points), p)


def _edge_distance(edges: list[tuple[float, ...]], p: tuple[float, float]) -> float:
    best = math.inf
    for x1, y1, _, _, dx, dy, length2 in edges:
        u = max(0.0, min(1.0, ((p[0] - x1) * dx + (p[1] - y1) * dy) / length2))
        best = min(best, math.hypot(p[0] - x1 - u * dx, p[1] - y1 - u * dy))
    return best


# ---- per-track state ---------------------------------------------------------------------------


class _Line:
    def __init__(self, spec: LineSpec) -> None:
        self.spec = spec
        self.sides: dict[int, tuple[int, tuple[float, float], float]] = {}  # track -> (side, point, distance)
        self.counts = {"in": 0, "out": 0}
        self._terms = _line_terms(spec)

    def update(self, track_id: int, cls: str, p: tuple[float, float], t: float) -> dict | None:
        spec = self.spec
        if spec.classes and cls not in spec.classes:
            return None
        s = _side(self._terms, p)  # side_of(spec, p)
        if abs(s) <= spec.margin:
            return None  # in the band: no decision either way (the hysteresis)
        side = 1 if s > 0 else -1
        old = self.sides.get(track_id)
        self.sides[track_id] = (side, p, s)
        if old is None or old[0] == side:
            return None
        # Where the path from the last decided point crossed the line: past the segment's ends
        # the track went round the line, not through it.
        _, p0, s0 = old
        k = s0 / (s0 - s)
        crossing = (p0[0] + k * (p[0] - p0[0]), p0[1] + k * (p[1] - p0[1]))
        if not 0.0 <= _along(spec, crossing) <= 1.0:
            return None
        direction = "in" if side > 0 else "out"
        self.counts[direction] += 1
        return {"type": "line_cross", "line": spec.name, "direction": direction, "track_id": track_id, "cls": cls}


class _Zone:
    def __init__(self, spec: ZoneSpec) -> None:
        self.spec = spec
        self.entered: dict[int, float] = {}  # track -> when it entered
        self.entries = self.exits = 0
        self._edges = _edges(spec.points)

    def update(self, track_id: int, cls: str, p: tuple[float, float], t: float) -> dict | None:
        spec = self.spec
        if spec.classes and cls not in spec.classes:
            return None
        if _edge_distance(self._edges, p) <= spec.margin:
            return None  # in the band along the edge: no decision
        now_inside = _inside(self._edges, p)
        if now_inside and track_id not in self.entered:
            self.entered[track_id] = t
            self.entries += 1
            return {"type": "zone_enter", "zone": spec.name, "track_id": track_id, "cls": cls}
        if not now_inside and track_id in self.entered:
            return self.leave(track_id, cls, t, lost=False)
        return None

    def leave(self, track_id: int, cls: str, t: float, lost: bool) -> dict | None:
        entered = self.entered.pop(track_id, None)
        if entered is None:
            return None
        self.exits += 1
        event = {"type": "zone_exit", "zone": self.spec.name, "track_id": track_id, "cls": cls}
        return {**event, "dwell_s": round(t - entered, 3), "lost": lost}


class CameraAnalytics:
    """One camera's lines and zones; update() once per published frame, in frame order (the
    camera service's publisher thread). `counts` is replaced whole after each update, so
    another thread reads it without a lock."""

    def __init__(
        self, lines: Sequence[LineSpec] = (), zones: Sequence[ZoneSpec] = (), lost_s: float = DEFAULT_LOST_S
    ) -> None:
        self.lines = [_Line(s) for s in lines]
        self.zones = [_Zone(s) for s in zones]
        self._shapes = (*self.lines, *self.zones)
        self.lost_s = lost_s
        self._seen: dict[int, tuple[float, str]] = {}  # track -> (last seen, class)
        self.counts = self._counts()

    def update(
        self,
        boxes: Sequence[Sequence[float]],
        classes: Sequence[str],
        track_ids: Sequence[int | None],
        t: float,
        size: tuple[int, int],
    ) -> list[dict]:
        """This frame's events, each with "at" = `t` (the frame's time, seconds) and the
        reference point. `boxes`: xyxy pixels; `size`: the image's (width, height)."""
        width, height = size
        events = []
        here = set()
        if hasattr(boxes, "tolist"):  # an array: its rows as Python floats at once (the same values)
            boxes = boxes.tolist()
        for box, cls, track_id in zip(boxes, classes, track_ids, strict=True):
            if track_id is None or track_id in here:
                continue
            here.add(track_id)
            x1, _, x2, y2 = (float(v) for v in box)
            p = ((x1 + x2) / 2 / width, y2 / height)  # bottom centre
            self._seen[track_id] = (t, cls)
            for shape in self._shapes:
                event = shape.update(track_id, cls, p, t)
                if event is not None:
                    events.append({**event, "at": round(t, 6), "point": [round(p[0], 4), round(p[1], 4)]})
        for track_id, (last, cls) in list(self._seen.items()):
            if track_id in here or t - last <= self.lost_s:
                continue
            del self._seen[track_id]
            for line in self.lines:
                line.sides.pop(track_id, None)
            for zone in self.zones:
                event = zone.leave(track_id, cls, last, lost=True)
                if event is not None:
                    events.append({**event, "at": round(last, 6)})
        if events:  # counts change only with an event
            self.counts = self._counts()
        return events

    def _counts(self) -> dict:
        return {
            "lines": {ln.spec.name: dict(ln.counts) for ln in self.lines},
            "zones": {
                z.spec.name: {"occupancy": len(z.entered), "entries": z.entries, "exits": z.exits} for z in self.zones
            },
        }

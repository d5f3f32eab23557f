"""The tenants file, read by `tandem serve --tenants` and `tandem worker --tenants`:

    [tenants.alice]
    keys = ["sk-alice-1", "sk-alice-2"]   # the Bearer keys that are alice (at least one)
    weight = 2                            # twice the share of a weight-1 tenant under --policy fair
    requests_per_minute = 600             # each limit optional: absent, no limit
    tokens_per_minute = 200000            # prompt + max_tokens, reconciled with what ran
    max_concurrent = 16                   # requests in flight at once
    max_queued = 64                       # requests in flight whose first token has not come

Each reader takes its part of one file: the server its keys and limits (server/tenants.py,
server/admission.py), the engine, embedded or a worker's, the weights (schedulers/fair.py). Both
read the same file, so that the names the server puts on jobs are the names the workers weigh.
Here, on the workers' floor, so that a worker reads it without importing the server; no TOML
beyond tomllib, no torch.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass

from workers.jobspec import DEFAULT_TENANT, TENANT_NAME

LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "max_queued")
FIELDS = ("keys", "weight", *LIMITS)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    keys: tuple[str, ...] = ()
    weight: float = 1.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None

    def __post_init__(self) -> None:
        where = f"tenant {self.name!r}"
        if not isinstance(self.name, str) or not TENANT_NAME.fullmatch(self.name):
            raise ValueError(f"tenant name must be 1-64 characters of [A-Za-z0-9._:@-], got {self.name!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w > 0 and math.isfinite(w)):
            raise ValueError(f"{where}: weight must be a finite number > 0, got {w!r}")
        for name in LIMITS:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{where}: {name} must be an integer >= 1 (absent: no limit), got {v!r}")
        for k in self.keys:
            if not isinstance(k, str) or not k.strip() or k != k.strip() or "," in k:
                raise ValueError(f"{where}: keys must be non-empty strings without commas or edge spaces")


def parse_tenants(data: object, source: str = "tenants file") -> list[Tenant]:
    """The tenants of a parsed tenants file ({"tenants": {name: {field: value}}}); ValueError
    naming the file, the tenant and the field."""
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
        extra = sorted(set(data) - {"tenants"}) if isinstance(data, dict) else []
        why = f"unknown top-level key(s) {extra}" if extra else "no [tenants.NAME] table"
        raise ValueError(f"{source}: {why}; it holds [tenants.NAME] tables only")
    if not data["tenants"]:
        raise ValueError(f"{source}: [tenants] names no tenant")
    tenants, owner = [], {}
    for name, body in data["tenants"].items():
        if name == DEFAULT_TENANT:
            raise ValueError(f"{source}: tenant {name!r}: the name is reserved for traffic without an API key")
        if not isinstance(body, dict):
            raise ValueError(f"{source}: tenant {name!r} must be a table of {list(FIELDS)}, got {body!r}")
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise ValueError(f"{source}: tenant {name!r}: unknown field {unknown[0]!r}; allowed: {list(FIELDS)}")
        keys = body.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"{source}: tenant {name!r}: keys must be a non-empty list of strings, got {keys!r}")
        for k in keys:
            if k in owner:
                raise ValueError(f"{source}: tenant {name!r}: a key of keys is tenant {owner[k]!r}'s already")
            owner[k] = name
        try:
            tenants.append(Tenant(name, tuple(keys), **{f: body[f] for f in FIELDS[1:] if f in body}))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    return tenants


def load_tenants(path: str) -> list[Tenant]:
    """The tenants of the TOML file at `path`; ValueError naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--tenants {path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--tenants {path}: not valid TOML: {exc}") from None
    return parse_tenants(data, f"--tenants {path}")


def tenant_weights(tenants: list[Tenant] | tuple[Tenant, ...]) -> dict[str, float]:
    """tenant -> weight, for the engine's scheduler (EngineConfig.tenant_weights). Weight 1 is
    left out: it is what the scheduler gives a tenant it has no weight for."""
    return {t.name: float(t.weight) for t in tenants if t.weight != 1}


def check_weights_policy(path: str, weights: dict[str, float], policy: str | None) -> None:
    """A weight is read by the fair scheduler only: under another policy it would be accepted
    and ignored, so it is an error naming the file, the tenant and --policy."""
    if weights and policy != "fair":
        raise ValueError(
            f"--tenants {path}: tenant {sorted(weights)[0]!r} has a weight, which only --policy fair uses "
            f"(got --policy {policy or 'fcfs'})"
        )

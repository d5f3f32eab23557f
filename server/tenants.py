"""Tenants of `tandem serve`: who a request belongs to, by its API key, and each tenant's weight
(the fair scheduler's share, schedulers/fair.py) and limits (server/admission.py).

A tenants file (`tandem serve --tenants tenants.toml`):

    [tenants.alice]
    keys = ["sk-alice-1", "sk-alice-2"]   # the Bearer keys that are alice (at least one)
    weight = 2                            # twice the share of a weight-1 tenant under --policy fair
    requests_per_minute = 600             # each limit optional: absent, no limit
    tokens_per_minute = 200000            # prompt + max_tokens, reconciled with what ran
    max_concurrent = 16                   # requests in flight at once
    max_queued = 64                       # requests in flight whose first token has not come

Without a file, each key of `--api-key K1,K2` is a tenant of its own, of weight 1 and no
limits, named `key-` and the first 8 hex digits of the key's SHA-256 (a name for /metrics that
does not show the key); a key of `--api-key` that the file names too is that tenant's. Without
any key, every request is the one tenant DEFAULT_TENANT. The name is the scheduler's tenant,
the job's `tenant` field and the /metrics label. No FastAPI, no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import tomllib
from dataclasses import dataclass, field

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


def key_tenant_name(key: str) -> str:
    """The name of a tenant that is one bare --api-key key: stable, and not the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


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


@dataclass(slots=True)
class TenantTable:
    """Tenants by API key. `tenant_of(presented)` compares the presented key with every key in
    constant time (hmac.compare_digest, no early exit), as the key check always did."""

    tenants: tuple[Tenant, ...] = ()
    by_name: dict[str, Tenant] = field(default_factory=dict)
    _keys: tuple[tuple[bytes, Tenant], ...] = ()

    @classmethod
    def build(cls, tenants: list[Tenant] | tuple[Tenant, ...] = (), api_keys: tuple[str, ...] = ()) -> TenantTable:
        """The file's tenants, and each key of `api_keys` (--api-key) not in the file as a
        tenant of its own. No key at all: the one anonymous tenant."""
        named = {k for t in tenants for k in t.keys}
        all_tenants = list(tenants) + [Tenant(key_tenant_name(k), (k,)) for k in api_keys if k not in named]
        if not any(t.keys for t in all_tenants):
            all_tenants = [Tenant(DEFAULT_TENANT)]
        by_name: dict[str, Tenant] = {}
        for t in all_tenants:
            if t.name in by_name:
                raise ValueError(f"tenant {t.name!r} is named twice")
            by_name[t.name] = t
        keys = tuple((k.encode(), t) for t in all_tenants for k in t.keys)
        return cls(tuple(all_tenants), by_name, keys)

    @property
    def keyed(self) -> bool:
        """Do requests need a key? (False: every request is DEFAULT_TENANT.)"""
        return bool(self._keys)

    def tenant_of(self, presented: str) -> Tenant | None:
        """The tenant whose key was presented, or None (a wrong key). Every key is compared, so
        the timing says neither which key nor how much of a guess was right."""
        given, found = presented.encode(), None
        for key, tenant in self._keys:
            if hmac.compare_digest(given, key) and found is None:
                found = tenant
        return found

    def weights(self) -> dict[str, float]:
        """tenant -> weight, for the engine's scheduler (EngineConfig.tenant_weights)."""
        return {t.name: float(t.weight) for t in self.tenants if t.weight != 1}

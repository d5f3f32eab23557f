"""Tenants of `tandem serve`: who a request belongs to, by its API key, and each tenant's weight
(the fair scheduler's share, schedulers/fair.py) and limits (server/admission.py).

A tenants file (`tandem serve --tenants tenants.toml`; its format and parser: workers/tenants_file.py,
which `tandem worker --tenants` reads too, for the weights, when the workers run the engines).

Without a file, each key of `--api-key K1,K2` is a tenant of its own, of weight 1 and no
limits, named `key-` and the first 8 hex digits of the key's SHA-256 (a name for /metrics that
does not show the key); a key of `--api-key` that the file names too is that tenant's. Without
any key, every request is the one tenant DEFAULT_TENANT. The name is the scheduler's tenant,
the job's `tenant` field and the /metrics label. No FastAPI, no torch.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

# The file itself is parsed on the workers' floor (workers/tenants_file.py), so that `tandem
# worker --tenants` reads the same file without importing the server; its names stay here too.
from workers.jobspec import DEFAULT_TENANT
from workers.tenants_file import FIELDS, LIMITS, Tenant, load_tenants, parse_tenants, tenant_weights

__all__ = [
    "DEFAULT_TENANT",
    "FIELDS",
    "LIMITS",
    "Tenant",
    "TenantTable",
    "key_tenant_name",
    "load_tenants",
    "parse_tenants",
]


def key_tenant_name(key: str) -> str:
    """The name of a tenant that is one bare --api-key key: stable, and not the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


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
        return tenant_weights(self.tenants)

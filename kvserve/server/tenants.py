"""Who is asking: API keys → tenants, and what a tenant's identity changes.

A tenant is the owner of sessions and of its prefix-cache entries. The engine knows neither:
the server namespaces every session id it hands the engine (``tenant \\x1f id``) and lists only
the caller's, and it folds the tenant into the prefix-cache salt, so

  * a tenant sees, continues and deletes only its own sessions; another tenant's id is a 404
    with the same body as an id nobody uses;
  * one tenant's ``cached_tokens`` never reveals another's prompts (unless the operator shares
    the prefix cache across tenants on purpose).

Keys come from ``--api-key`` (repeatable, each its own tenant), ``--api-keys-file`` (``KEY
TENANT`` per line, ``#`` comments) and ``KVSERVE_API_KEY``; a flag is visible in ``ps``, the file
and the variable are not. No key: one tenant, ``default``, and ``/v1/*`` is open.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from pathlib import Path

from starlette.requests import Request

from kvserve.server.config import DEFAULT_TENANT
from kvserve.server.errors import APIError

SEP = "\x1f"  # never in a session id (letters, digits, ._:@-) nor in a tenant name


def tenant_for_flag_key(key: str, index: int) -> str:
    """Each ``--api-key`` is its own tenant; the name is derived from the key, never the key."""
    return f"key{index}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def read_keys_file(path: str | Path) -> dict[str, str]:
    """``KEY TENANT`` per line; blank lines and ``#`` comments skipped. Raises ValueError."""
    keys: dict[str, str] = {}
    for n, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected 'KEY TENANT', got {len(parts)} fields")
        key, tenant = parts
        if key in keys and keys[key] != tenant:
            raise ValueError(f"{path}:{n}: a key is listed twice with different tenants")
        keys[key] = tenant
    return keys


def collect_keys(flag_keys: Iterable[str], keys_file: str | None, env_key: str | None) -> dict[str, str]:
    """Every accepted key → tenant, from the three sources. ``KVSERVE_API_KEY`` is tenant ``default``."""
    keys: dict[str, str] = {}
    for i, key in enumerate((k for k in flag_keys if k), start=1):
        keys[key] = tenant_for_flag_key(key, i)
    if keys_file:
        keys.update(read_keys_file(keys_file))
    if env_key:
        keys.setdefault(env_key, DEFAULT_TENANT)
    return keys


def tenant_of(request: Request, keys: dict[str, str]) -> str:
    """The caller's tenant from ``Authorization: Bearer KEY`` (401 if a key is needed and wrong)."""
    if not keys:
        return DEFAULT_TENANT
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    if not given:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    found = None
    for key, tenant in keys.items():  # compare against every key: no timing hint of which matched
        if secrets.compare_digest(given.encode(), key.encode()):
            found = tenant
    if found is None:
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")
    return found


def engine_session_id(tenant: str, session_id: str) -> str:
    return f"{tenant}{SEP}{session_id}"


def own_session_id(tenant: str, engine_id: str) -> str | None:
    """The client's id of an engine session if ``tenant`` owns it, else None."""
    prefix = tenant + SEP
    return engine_id[len(prefix):] if engine_id.startswith(prefix) else None


def prefix_cache_salt(tenant: str, cache_salt: str | None, share_across_tenants: bool) -> str | None:
    """The engine's salt: the tenant (unless shared) and the client's ``cache_salt``. ``""`` is a
    salt (distinct from none), so every given salt is encoded as a non-empty string."""
    parts = [] if share_across_tenants else [f"tenant{SEP}{tenant}"]
    if cache_salt is not None:
        parts.append(f"salt{SEP}{cache_salt}")
    return SEP.join(parts) if parts else None

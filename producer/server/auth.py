"""API keys and projects of `cbq serve`. Owns the key table and who a request acts for (`Principal`).

`CBQ_API_KEYS` is a comma-separated list of `key`, `key:project` or `key:*`:
- `key:project`: the key acts for `project`; keys that name the same project share its files and batches.
- `key` alone: the key is a project of its own (named `key-` + a hash of the key, so no key is ever stored).
- `key:*`: an admin key, which sees every project's files and batches (and those made before projects existed).
As OpenAI's projects do, a key sees only its project's files and batches: another project's ids answer 404.
Without any keys there is no authentication (the CLI then binds loopback only) and every caller is an admin of
the project `default`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

ADMIN_PROJECT = "*"
NO_AUTH_PROJECT = "default"
PROJECT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # a project name becomes part of a Redis key
SCOPE_KEY = "cbq.principal"  # where the middleware leaves the Principal in the ASGI scope


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: the project its files and batches belong to, and whether it sees every project."""

    project: str
    is_admin: bool = False

    def can_see(self, owner: str | None) -> bool:
        return self.is_admin or owner == self.project

    @property
    def listing_project(self) -> str | None:
        """The project whose listing this caller reads; None: every project's."""
        return None if self.is_admin else self.project


NO_AUTH = Principal(NO_AUTH_PROJECT, is_admin=True)


def parse_api_keys(spec: str) -> dict[str, Principal]:
    """The key table of a `CBQ_API_KEYS` value. Raises ValueError naming the bad entry."""
    table: dict[str, Principal] = {}
    for position, entry in enumerate(spec.split(","), start=1):
        entry = entry.strip()
        if not entry:
            continue
        key, sep, project = entry.rpartition(":") if ":" in entry else (entry, "", "")
        key, project = key.strip(), project.strip()
        if not key:
            raise ValueError(f"entry {position} of the API keys has no key before ':'")
        if sep and project != ADMIN_PROJECT and not PROJECT_RE.match(project):
            raise ValueError(
                f"entry {position} of the API keys: project {project!r} must be 1-64 letters, digits, '_', '.', '-'"
            )
        if project == ADMIN_PROJECT:
            principal = Principal(ADMIN_PROJECT, is_admin=True)
        elif project:
            principal = Principal(project)
        else:
            principal = Principal(f"key-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
        if table.get(key, principal) != principal:
            raise ValueError(f"entry {position} of the API keys gives a key a second project")
        table[key] = principal
    return table


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every /v1/ path: a missing or wrong key gets OpenAI's 401; a good one puts
    its Principal in the scope. With an empty table every request acts as `NO_AUTH`."""

    def __init__(self, app, keys: dict[str, Principal], unauthorized):
        self.app = app
        self._keys = [(key.encode(), principal) for key, principal in keys.items()]
        self._unauthorized = unauthorized  # the ASGI response sent for a missing or wrong key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            principal = self._principal(scope) if self._keys else NO_AUTH
            if principal is None and scope["path"].startswith("/v1/"):
                await self._unauthorized(scope, receive, send)
                return
            scope[SCOPE_KEY] = principal
        await self.app(scope, receive, send)

    def _principal(self, scope) -> Principal | None:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        # compare_digest against every key: the time taken says nothing about which key came close.
        matches = [principal for key, principal in self._keys if hmac.compare_digest(token, key)]
        return matches[0] if matches else None


def principal_of(scope) -> Principal:
    principal = scope.get(SCOPE_KEY)
    assert isinstance(principal, Principal), "ApiKeyMiddleware runs before every route"
    return principal

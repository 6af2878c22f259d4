"""Console sign-in sessions: an API key, posted once, becomes a random session id held in an
HttpOnly cookie, so the key never lives in the browser (not in storage, the page or a URL).

Only the key's sha256 is kept, next to the tenant it named; every use of a session checks that
hash against the tenants config in force now, so a key removed by a SIGHUP reload loses its
sessions at their next request (and a tenant's operator flag follows the file). Sessions expire
and are bounded in number: past the bound the least recently used one is dropped."""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from lorafleet.server.errors import Unauthorized
from lorafleet.server.state.keys import Tenant, hash_key
from lorafleet.server.state.tenants import TenantsConfig

COOKIE = "lorafleet_console"
CSRF_HEADER = "x-csrf-token"


@dataclass
class ConsoleSession:
    id: str
    csrf: str  # sent back in CSRF_HEADER on every state-changing request
    tenant_id: str
    key_hash: bytes
    expires_at: float
    streams: int = 0  # open SSE connections (sse.py bounds them)


class ConsoleSessions:
    def __init__(
        self,
        config: Callable[[], TenantsConfig],
        *,
        ttl_s: float = 8 * 3600.0,
        max_sessions: int = 1024,
        per_tenant: int = 64,
        clock: Callable[[], float] = time.time,
    ):
        if ttl_s <= 0 or max_sessions < 1 or per_tenant < 1:
            raise ValueError(
                "console sessions need ttl_s > 0, max_sessions >= 1 and per_tenant >= 1, got "
                f"{ttl_s!r}, {max_sessions!r}, {per_tenant!r}"
            )
        self._config = config
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        # a tenant past it loses its own least recently used session: one key signing in over
        # and over must not push every other tenant's sessions out of `max_sessions`
        self.per_tenant = per_tenant
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()

    def sign_in(self, key: str) -> tuple[ConsoleSession, Tenant]:
        """Unauthorized for an unknown key (the message never repeats the key)."""
        tenant = self._config().keys.authenticate(key)
        now = self._clock()
        session = ConsoleSession(
            id=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            tenant_id=tenant.id,
            key_hash=hash_key(key),
            expires_at=now + self.ttl_s,
        )
        with self._lock:
            self._drop_expired(now)
            mine = [s.id for s in self._sessions.values() if s.tenant_id == tenant.id]
            for sid in mine[: len(mine) - self.per_tenant + 1]:  # oldest first
                del self._sessions[sid]
            while len(self._sessions) >= self.max_sessions:
                self._sessions.popitem(last=False)
            self._sessions[session.id] = session
        return session, tenant

    def get(self, session_id: str | None) -> tuple[ConsoleSession, Tenant]:
        """The live session and its tenant as the current tenants config has it; Unauthorized
        when there is none, it expired, or its key is no longer in the config."""
        if not session_id:
            raise Unauthorized(
                "not signed in to the console: POST your API key to /console/api/session"
            )
        now = self._clock()
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and session.expires_at <= now:
                del self._sessions[session_id]
                session = None
            if session is not None:
                self._sessions.move_to_end(session_id)
        if session is None:
            raise Unauthorized("console session unknown or expired: sign in again")
        tenant = self._current(session)
        if tenant is None:
            self.sign_out(session_id)
            raise Unauthorized("the key this console session signed in with is no longer valid")
        return session, tenant

    def _current(self, session: ConsoleSession) -> Tenant | None:
        spec = self._config().spec(session.tenant_id)
        if spec is None:
            return None
        if not any(hmac.compare_digest(h, session.key_hash) for h in spec.key_hashes):
            return None
        return Tenant(id=spec.id, operator=spec.operator)

    def sign_out(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def alive(self, session_id: str) -> bool:
        """Whether an SSE stream may go on: the session exists, is not expired and its key is
        still valid."""
        try:
            self.get(session_id)
        except Unauthorized:
            return False
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _drop_expired(self, now: float) -> None:
        for sid in [s.id for s in self._sessions.values() if s.expires_at <= now]:
            del self._sessions[sid]

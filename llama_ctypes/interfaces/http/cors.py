"""Which browser origins may call the server: llama-server's ``--cors-origins``."""

from __future__ import annotations

import re

#: Origins ``localhost`` lets in: this machine, any port.
_LOCALHOST = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$")


class CorsPolicy:
    """Which browser origins may call the server (llama-server's ``--cors-origins``).

    ``"*"`` (the default, as llama-server): any origin is reflected, with credentials. ``"localhost"``:
    pages served from this machine only. Otherwise a comma-separated list of exact origins (which
    may include ``localhost``). An origin not let in gets no CORS headers, so the browser refuses the
    response to its page; the request itself is answered as any other.
    """

    def __init__(self, spec: str = "*"):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts:
            raise ValueError(f"cors origins {spec!r}: expected '*', 'localhost' or a list of origins")
        self.any = "*" in parts
        self.localhost = "localhost" in parts
        self.exact = frozenset(p.rstrip("/") for p in parts if p not in ("*", "localhost"))

    def allows(self, origin: str) -> bool:
        return self.any or self.names(origin)

    def names(self, origin: str) -> bool:
        """Whether the origin is named (or ``localhost`` is and it is one), ``*`` aside."""
        return origin in self.exact or (self.localhost and bool(_LOCALHOST.match(origin)))

    def headers(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        if origin is None or not self.allows(origin):
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-allow-credentials", b"true"), (b"vary", b"Origin")]

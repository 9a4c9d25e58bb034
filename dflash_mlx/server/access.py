"""Who may drive the server from a browser: the ``Host`` and ``Origin`` checks that keep web
pages (cross-site requests, DNS rebinding) from using a local model, the JSON content type
POST routes require, and the CORS answers for the origins ``--allow-origin`` names.

A browser always sends ``Host``, and ``Origin`` on a cross-site POST; agents, SDKs and curl
send no ``Origin``, so they are unaffected. No MLX."""

from __future__ import annotations

import ipaddress

from .schema import APIError

LOCAL_NAMES = {"localhost"}
JSON = "application/json"
# what a preflight may ask for: the SDKs' headers (OpenAI's, Anthropic's, the key)
ALLOWED_METHODS = "GET, POST, OPTIONS"
MAX_AGE = "600"  # seconds a browser may cache a preflight's answer


def _loopback(name: str) -> bool:
    """Whether a host name or address is this machine's loopback."""
    name = name.lower().rstrip(".")
    if name in LOCAL_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name of a ``Host`` header or an origin's authority, without its port
    ('[::1]:8080' -> '::1', 'Example.COM:80' -> 'example.com')."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Access:
    """The rules for one server.

    Args:
        host: the ``--host`` it was started with. port: the port it listens on.
        allow_origins: origins (normalized by ``settings.ServerConfig.validate``; "*": any)
            whose pages may call it.
    """

    def __init__(self, host: str, port: int, allow_origins: tuple[str, ...] = ()):
        self.port, self.allowed = port, set(allow_origins)
        self.names = {host_name(host)} if host else set()
        # bound beyond loopback (the LAN, 0.0.0.0): clients name it as they reach it
        self.any_host = bool(host) and not _loopback(host_name(host))

    def own(self, origin: str) -> bool:
        """Whether ``origin`` is this server's own (a page it would serve itself)."""
        scheme, _, authority = origin.partition("://")
        name = host_name(authority)
        rest = authority.rsplit("]", 1)[1] if authority.startswith("[") else authority
        port = rest.rsplit(":", 1)[1] if rest.count(":") == 1 else "80"
        local = _loopback(name) or (name in self.names and not self.any_host)
        return scheme == "http" and local and port.isdigit() and int(port) == self.port

    def allows(self, origin: str | None) -> bool:
        """Whether a request carrying ``origin`` (None: no ``Origin`` header) may be served."""
        if origin is None:
            return True
        origin = origin.strip().lower()
        return "*" in self.allowed or origin in self.allowed or self.own(origin)

    def cors(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for an allowed foreign page, or None."""
        if origin is None or not self.allowed:
            return None
        origin = origin.strip()
        low = origin.lower()
        return origin if ("*" in self.allowed or low in self.allowed) else None

    def check(self, headers) -> None:
        """Refuse a request whose ``Host`` or ``Origin`` is not allowed.

        Args:
            headers: the request's headers.

        Raises:
            APIError: 403 naming the header, the value and the fix.
        """
        host = headers.get("Host")
        if host is not None and not self.any_host:
            name = host_name(host)
            if not (_loopback(name) or name in self.names):
                raise APIError(
                    403,
                    f"Host {host!r} is not this server's name (a web page rebinding its DNS?); "
                    f"call it as http://127.0.0.1:{self.port} or http://localhost:{self.port}, or bind "
                    "another address with --host",
                    code="forbidden_host",
                )
        origin = headers.get("Origin")
        if not self.allows(origin):
            raise APIError(
                403,
                f"requests from web pages of origin {origin!r} are refused (a page the user "
                "opens must not drive the local model); restart the server with "
                f"--allow-origin {origin} to let that page use it",
                code="forbidden_origin",
            )


def check_json(content_type: str | None) -> None:
    """Refuse a POST body not sent as JSON: a web page can POST 'text/plain' across sites
    without asking first, never 'application/json'.

    Raises:
        APIError: 415 naming the content type and the fix.
    """
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != JSON:
        got = repr(content_type) if content_type else "none"
        raise APIError(
            415,
            f"POST bodies must be JSON sent with 'Content-Type: application/json' (got {got}); "
            "add that header (curl: -H 'Content-Type: application/json')",
            code="unsupported_media_type",
        )

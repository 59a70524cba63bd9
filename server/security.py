"""Who is calling: TLS / mutual TLS credentials, bearer tokens, identities.

Modes (docs/security.md):
- insecure: no TLS, no tokens. Every caller is the identity "anonymous". Meant
  for loopback and tests; the server warns loudly when bound beyond loopback.
- tokens (`--token-file`): a caller sends `authorization: Bearer TOKEN`; the
  file maps each token to an identity and, optionally, the operator role.
- TLS (`--tls-cert`, `--tls-key`); mutual TLS with `--tls-client-ca`: a client
  certificate is required and its subject (first DNS/URI SAN, else CN) is the
  identity. Certificates and the token file are re-read when they change.

An identity listed in `--operators` (or marked `operator` in the token file)
may act on every engine; each such act is logged.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvplan.server.config import Settings

log = logging.getLogger("kvplan.server.security")

TOKEN_RECHECK_S = 1.0  # how often the token file's mtime is looked at


@dataclass(frozen=True)
class Identity:
    name: str
    operator: bool = False
    method: str = "insecure"  # "insecure", "token", "certificate"


ANONYMOUS = Identity("anonymous")


class Unauthenticated(Exception):
    """The call carries no credentials, or ones this server does not accept."""


def _file_stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


def parse_token_file(text: str, operators: frozenset[str]) -> dict[bytes, Identity]:
    """`TOKEN IDENTITY [operator]` per line; `#` starts a comment. Keyed by the
    token's SHA-256, so tokens are compared as digests."""
    table: dict[bytes, Identity] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "operator"):
            raise ValueError(f"token file line {number}: expected 'TOKEN IDENTITY [operator]'")
        token, name = parts[0], parts[1]
        if len(token) < 16:
            raise ValueError(f"token file line {number}: a token needs at least 16 characters")
        table[hashlib.sha256(token.encode()).digest()] = Identity(
            name, operator=len(parts) == 3 or name in operators, method="token"
        )
    return table


def warn_if_readable_by_others(path: str, what: str) -> None:
    """A secret that other local users can read is no secret."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & 0o077:
        log.warning(
            "secret file is readable by other users; chmod 600 it",
            extra={"path": path, "what": what, "mode": oct(mode & 0o777)},
        )


class TokenTable:
    """The token file, re-read when it changes (a bad edit keeps the last good table)."""

    def __init__(self, path: str, operators: frozenset[str]) -> None:
        self._path = path
        self._operators = operators
        self._lock = threading.Lock()
        self._stamp = _file_stamp(path)
        self._table = parse_token_file(Path(path).read_text(), operators)
        self._checked = time.monotonic()

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < TOKEN_RECHECK_S:
            return
        with self._lock:
            self._checked = now
            try:
                stamp = _file_stamp(self._path)
                if stamp == self._stamp:
                    return
                self._table = parse_token_file(Path(self._path).read_text(), self._operators)
                self._stamp = stamp
                log.info(
                    "token file reloaded", extra={"path": self._path, "tokens": len(self._table)}
                )
            except (OSError, ValueError) as error:
                log.error(
                    "token file not reloaded; the previous tokens stay in force",
                    extra={"path": self._path, "error": str(error)},
                )

    def identify(self, token: str) -> Identity | None:
        self._maybe_reload()
        # Looked up by the token's SHA-256: timing tells at most about the digest.
        return self._table.get(hashlib.sha256(token.encode()).digest())


class CertificateFiles:
    """The server's key pair and client CA, re-read by gRPC's certificate
    fetcher at a handshake after any of the files changed."""

    def __init__(self, cert: str, key: str, client_ca: str) -> None:
        self._paths = [path for path in (cert, key, client_ca) if path]
        self._cert, self._key, self._client_ca = cert, key, client_ca
        self._lock = threading.Lock()
        self._stamps = self._read_stamps()
        self.initial = self._configuration()

    def _read_stamps(self) -> list[tuple[int, int]]:
        return [_file_stamp(path) for path in self._paths]

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        key = Path(self._key).read_bytes()
        chain = Path(self._cert).read_bytes()
        client_ca = Path(self._client_ca).read_bytes() if self._client_ca else None
        return grpc.ssl_server_certificate_configuration([(key, chain)], client_ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC calls this before a handshake: a new configuration, or None (keep)."""
        with self._lock:
            try:
                stamps = self._read_stamps()
                if stamps == self._stamps:
                    return None
                configuration = self._configuration()
                self._stamps = stamps
            except OSError as error:
                log.error("TLS files not reloaded", extra={"error": str(error)})
                return None
        log.info("TLS certificates reloaded", extra={"files": ",".join(self._paths)})
        return configuration

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=bool(self._client_ca)
        )


def _peer_certificate_name(context: grpc.aio.ServicerContext) -> str | None:
    """The certificate's first DNS or URI subject alternative name, else its common
    name. gRPC lists every SAN (email and IP too) in one property, in the
    certificate's order, and the DNS and URI ones again on their own: an email SAN
    must not become an identity (it could spell an operator's name)."""
    auth = context.auth_context()
    named = {bytes(value) for key in ("peer_dns", "peer_uri") for value in auth.get(key, ())}
    for value in auth.get("x509_subject_alternative_name", ()):
        if bytes(value) in named:
            return bytes(value).decode(errors="replace")
    common_names = auth.get("x509_common_name")
    if common_names:
        return bytes(common_names[0]).decode(errors="replace")
    return None


class Authenticator:
    """Turns a call's credentials into an Identity."""

    def __init__(self, settings: Settings) -> None:
        self.operators = frozenset(
            name.strip() for name in settings.operators.split(",") if name.strip()
        )
        self.tokens = (
            TokenTable(settings.token_file, self.operators) if settings.token_file else None
        )
        self.certificates = (
            CertificateFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
            if settings.tls_cert
            else None
        )
        self.mutual_tls = bool(settings.tls_client_ca)
        if settings.token_file:
            warn_if_readable_by_others(settings.token_file, "token file")
        if settings.tls_key:
            warn_if_readable_by_others(settings.tls_key, "TLS private key")

    @property
    def insecure(self) -> bool:
        return self.tokens is None and not self.mutual_tls

    @property
    def mode(self) -> str:
        parts = []
        if self.certificates is not None:
            parts.append("mtls" if self.mutual_tls else "tls")
        if self.tokens is not None:
            parts.append("tokens")
        return "+".join(parts) or "insecure"

    def identify(self, context: grpc.aio.ServicerContext) -> Identity:
        if self.tokens is not None:
            for key, value in context.invocation_metadata() or ():
                if key == "authorization" and isinstance(value, str):
                    scheme, _, token = value.partition(" ")
                    if scheme.lower() != "bearer" or not token.strip():
                        raise Unauthenticated("the authorization header must be 'Bearer TOKEN'")
                    identity = self.tokens.identify(token.strip())
                    if identity is None:
                        raise Unauthenticated("the bearer token is not known to this server")
                    return identity
        if self.mutual_tls:
            name = _peer_certificate_name(context)
            if name:
                return Identity(name, operator=name in self.operators, method="certificate")
        if self.insecure:
            return ANONYMOUS
        raise Unauthenticated(
            "no credentials: send 'authorization: Bearer TOKEN'"
            + (" or present a client certificate" if self.mutual_tls else "")
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_host(settings: Settings) -> str:
    """The address to bind: "auto" is every interface only when callers must
    present credentials (tokens or client certificates), else loopback. TLS alone
    encrypts but authenticates nobody: any client could still release any lease."""
    if settings.host != "auto":
        return settings.host
    secured = bool(settings.token_file or settings.tls_client_ca)
    return "0.0.0.0" if secured else "127.0.0.1"


def warn_if_exposed(host: str, authenticator: Authenticator, tls: bool) -> None:
    """Say loudly at start when the server is reachable beyond loopback without
    authentication, or sends tokens in clear."""
    if is_loopback(host):
        return
    if authenticator.insecure:
        log.warning(
            "INSECURE: serving beyond loopback with no authentication; any client on the "
            "network may plan, renew or release any engine's leases. Set --token-file or "
            "--tls-cert/--tls-key/--tls-client-ca (docs/security.md)",
            extra={"host": host, "security": "insecure"},
        )
    elif not tls:
        log.warning(
            "INSECURE: bearer tokens travel in clear text beyond loopback; set "
            "--tls-cert/--tls-key (docs/security.md)",
            extra={"host": host, "security": authenticator.mode},
        )

"""How a client proves who it is: TLS, a client certificate, a bearer token.

    security = ChannelSecurity.from_env()          # KVPLAN_TLS_CA, KVPLAN_TOKEN, ...
    with PlannerClient("planner:50051", security=security) as planner: ...

Defaults: no TLS and no token (a server in insecure mode, e.g. on loopback).
Environment (all optional):
- KVPLAN_TLS: "1" for TLS with the system's roots (implied by the next three)
- KVPLAN_TLS_CA: PEM file of the CA that signed the server's certificate
- KVPLAN_CLIENT_CERT, KVPLAN_CLIENT_KEY: PEM files of the client certificate
  and key (mutual TLS)
- KVPLAN_TLS_SERVER_NAME: the name to check the server's certificate against,
  when it differs from the target's host
- KVPLAN_TOKEN: a bearer token; KVPLAN_CLIENT_TOKEN_FILE: a file holding one
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class ChannelSecurity:
    tls: bool = False
    root_certificates: bytes | None = None  # PEM; None: the system's roots
    private_key: bytes | None = None  # PEM; with certificate_chain: mutual TLS
    certificate_chain: bytes | None = None
    token: str | None = None  # sent as "authorization: Bearer TOKEN" on every call
    server_name: str | None = None  # overrides the name checked in the server's certificate

    def __post_init__(self) -> None:
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("a client certificate needs both private_key and certificate_chain")
        if self.token is not None and (not self.token.strip() or "\n" in self.token):
            raise ValueError("a bearer token is one non-empty line")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChannelSecurity:
        env = os.environ if environ is None else environ

        def read(name: str) -> bytes | None:
            path = env.get(name, "")
            try:
                return Path(path).read_bytes() if path else None
            except OSError as error:  # say which variable named the file
                raise OSError(f"{name}={path}: {error.strerror or error}") from None

        root = read("KVPLAN_TLS_CA")
        key = read("KVPLAN_CLIENT_KEY")
        chain = read("KVPLAN_CLIENT_CERT")
        token = env.get("KVPLAN_TOKEN", "") or None
        if token is None:
            token = (read("KVPLAN_CLIENT_TOKEN_FILE") or b"").decode().strip() or None
        tls = env.get("KVPLAN_TLS", "").lower() in ("1", "true", "yes", "on") or bool(
            root or key or chain
        )
        return cls(
            tls=tls,
            root_certificates=root,
            private_key=key,
            certificate_chain=chain,
            token=token,
            server_name=env.get("KVPLAN_TLS_SERVER_NAME", "") or None,
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials, or None for a plaintext channel."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            self.root_certificates, self.private_key, self.certificate_chain
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.tls and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def resolve_security(
    security: ChannelSecurity | None,
    tls: bool,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
) -> ChannelSecurity:
    """The constructors' older keyword arguments (tls=..., root_certificates=...)
    as a ChannelSecurity; `security` wins when given."""
    if security is not None:
        return security
    return ChannelSecurity(
        tls=tls,
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )

"""Where a client connects: kvplan's default port for a target given without one.

gRPC sends a target without a port (`planner`) to port 443, the HTTPS port, where no
kvplan server listens unless one was put there on purpose; `kvplan serve` listens on
50051. So a host without a port means that port, for every kvplan client (the library,
the CLI, the vLLM plugin's KVPLAN_ADDR). A gRPC URI with a scheme (`dns:///h:p`,
`unix:/path`, `ipv4:…`) is passed on as written, except that `dns:` gets the port too.
"""

from __future__ import annotations

DEFAULT_PORT = 50051

# Schemes whose addresses carry no port, or several: taken as written.
_AS_WRITTEN = ("unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:", "xds:", "google-c2p:")


def with_default_port(target: str) -> str:
    """`target` with kvplan's default port when it names a host without one."""
    target = target.strip()
    if target.startswith(_AS_WRITTEN):
        return target
    if target.startswith("dns:"):
        authority, _, endpoint = target.rpartition("/")
        return f"{authority}/{with_default_port(endpoint)}" if authority else target
    if target.startswith("["):  # [IPv6]:port or [IPv6]
        return target if "]:" in target else f"{target}:{DEFAULT_PORT}"
    if target.count(":") > 1:  # a bare IPv6 literal: it has no port
        return f"[{target}]:{DEFAULT_PORT}"
    host, colon, port = target.partition(":")
    if not colon:
        return f"{host}:{DEFAULT_PORT}"
    if not port:
        raise ValueError(
            f"target {target!r}: empty port (give HOST:PORT, or HOST for {DEFAULT_PORT})"
        )
    return target

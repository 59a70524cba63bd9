"""Server settings: flags, then KVPLAN_* environment variables, then defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Settings:
    # Loopback unless told otherwise. "auto" (the container image): all interfaces when
    # TLS or a token file is configured, else loopback (server/security.py).
    host: str = "127.0.0.1"
    port: int = 50051  # gRPC
    metrics_port: int = 9464  # Prometheus /metrics; 0 disables, -1 picks a free port
    metrics_host: str = ""  # "": the gRPC bind address
    # A plaintext port serving only grpc.health.v1 (0: none): kubelet's built-in gRPC
    # probe speaks no TLS, so it cannot check a TLS port.
    health_port: int = 0
    log_format: str = "text"  # "text" or "json"
    log_level: str = "INFO"
    probe: str = "auto"  # auto (NVML where a driver is, else static), nvml, torch, static
    devices: str = ""  # static inventory: "8xH100-80GB" or a YAML/JSON file
    store: str = ""  # "" (SQLite in state_dir), sqlite:///PATH, redis://HOST:PORT/DB, memory
    state_dir: str = "kvplan-state"
    lease_ttl_s: float = 60.0  # a lease not renewed for this long expires
    max_commit_fraction: float = 1.0  # leases on a device sum to at most total x this
    max_message_bytes: int = 64 * 1024 * 1024
    max_layers_per_worker: int = 8192
    max_workers_per_engine: int = 1024
    max_pending_rendezvous: int = 4096  # engines waiting for ranks
    # One identity's engines among them (with authentication): a quarter, so that
    # one tenant cannot block the others' rank-mode planning.
    max_pending_rendezvous_per_identity: int = 1024
    rendezvous_ttl_s: float = 600.0  # a rendezvous or finished engine is forgotten after this
    plan_cache_size: int = 4096  # plans kept for GetPlan and cache hits
    plan_cache_bytes: int = 32 * 1024 * 1024  # and at most this many serialized bytes
    model_cache_size: int = 256  # model plans (grouping) kept for other engines of a model
    model_cache_bytes: int = 32 * 1024 * 1024  # and at most this many bytes (estimated)
    store_plan_bytes: int = 64 * 1024 * 1024  # serialized plans kept in the store
    grace_s: float = 10.0  # shutdown grace for in-flight calls
    offload_layers: int = 2048  # plan in a worker thread above this many layers
    claim_timeout_s: float = 10.0  # a rendezvous claimed by a vanished server is re-claimed
    # Identity (docs/security.md). No TLS and no token file: insecure mode.
    tls_cert: str = ""  # PEM certificate chain of the server; with tls_key: TLS
    tls_key: str = ""  # PEM private key
    tls_client_ca: str = ""  # PEM CA bundle: clients must present a certificate it signed
    token_file: str = ""  # bearer tokens: one "TOKEN IDENTITY [operator]" per line
    operators: str = ""  # comma-separated identities with the operator role
    ownership_ttl_s: float = 86400.0  # an engine's owner is forgotten this long after its last use
    # Bounds on what one caller can make the server hold.
    max_engine_id_chars: int = 256
    max_layer_name_chars: int = 1024
    max_identifier_chars: int = 256  # engine_version, target_model_type, device uuid / name
    max_pending_rendezvous_bytes: int = 256 * 1024 * 1024  # 2x waiting ranks' wire size
    max_pending_rendezvous_bytes_per_identity: int = 64 * 1024 * 1024  # one identity's of those
    rendezvous_result_bytes: int = 64 * 1024 * 1024  # finished rank-mode results kept in the store
    max_leases_per_identity: int = 4096
    # Fleet measurements (docs/capacity.md): configurations kept, engines kept per one.
    max_measured_configs: int = 1024
    max_measurements_per_config: int = 16
    # Live ownership records (engine ids) one identity holds: ~110 bytes each in
    # SQLite, so 65,536 is ~7 MB per identity, while a real tenant plans far
    # fewer engines per --ownership-ttl-s (a day); matches the servicer's owner cache.
    max_engines_per_identity: int = 65536
    metrics_engine_labels: bool = False  # per-engine metric series (engine_id label)
    health_interval_s: float = 2.0  # how often health checks that the store answers
    redis_allow_no_persistence: bool = False  # accept a Redis that loses data on restart


_HELP = {
    "host": "address to bind (auto: all interfaces when TLS or tokens are set, else loopback)",
    "port": "gRPC port",
    "metrics_port": "Prometheus metrics port (0: off, -1: a free port)",
    "metrics_host": "address of the metrics endpoint (empty: the gRPC address)",
    "health_port": "plaintext port serving only grpc.health.v1, for kubelet's gRPC probe "
    "(0: none; -1: a free port)",
    "log_format": "text or json",
    "log_level": "DEBUG, INFO, WARNING, ...",
    "probe": "device probe: auto, nvml, torch or static",
    "devices": "static device inventory, e.g. 8xH100-80GB, or a YAML/JSON file",
    "store": "state store: empty (SQLite in --state-dir), sqlite:///PATH, redis://..., memory",
    "state_dir": "directory of the embedded SQLite store",
    "lease_ttl_s": "seconds a lease lives without a heartbeat",
    "max_commit_fraction": "leases on a device sum to at most its total times this",
    "max_message_bytes": "largest request/response",
    "max_layers_per_worker": "limit on layers one worker may send",
    "max_workers_per_engine": "limit on workers of one engine",
    "max_pending_rendezvous": "limit on engines waiting for their ranks",
    "max_measured_configs": "engine configurations whose start-up measurements are kept",
    "max_measurements_per_config": "engines' measurements kept per configuration (newest)",
    "max_pending_rendezvous_per_identity": "limit on one identity's engines waiting for their "
    "ranks (with authentication)",
    "rendezvous_ttl_s": "seconds an unfinished rendezvous or a finished engine is kept",
    "plan_cache_size": "plans kept in memory",
    "plan_cache_bytes": "bytes of serialized plans kept in memory",
    "model_cache_size": "model plans (grouping, projections) kept for other engines of a model",
    "model_cache_bytes": "bytes the kept model plans may hold (an over-estimate counts)",
    "store_plan_bytes": "bytes of serialized plans kept in the store (also bounds its size)",
    "grace_s": "seconds in-flight calls get on shutdown",
    "offload_layers": "plan off the event loop above this many layers",
    "claim_timeout_s": "seconds before another server may plan a claimed rendezvous",
    "tls_cert": "PEM certificate chain of the server (TLS; reloaded when the file changes)",
    "tls_key": "PEM private key of the server",
    "tls_client_ca": "PEM CA bundle; set: clients must present a certificate (mutual TLS)",
    "token_file": "bearer tokens, one 'TOKEN IDENTITY [operator]' per line (reloaded on change)",
    "operators": "comma-separated identities that may act on every engine",
    "ownership_ttl_s": "seconds an engine's owner is kept after its last plan or renewal",
    "max_engine_id_chars": "longest engine_id",
    "max_layer_name_chars": "longest layer name",
    "max_identifier_chars": "longest options.engine_version, spec_decode.target_model_type, "
    "device.uuid or device.name",
    "max_pending_rendezvous_bytes": "bytes that ranks waiting in rendezvous hold in this "
    "process, each counted as twice its request's wire size (its spec kept as bytes, and "
    "gRPC's copy of the received call)",
    "max_pending_rendezvous_bytes_per_identity": "the same bytes, of one identity's waiting "
    "ranks (this process, with authentication)",
    "rendezvous_result_bytes": "bytes of finished rank-mode results kept for late or retrying "
    "ranks (the oldest are forgotten first)",
    "max_leases_per_identity": "live leases one identity may hold",
    "max_engines_per_identity": "engines one identity may own at once (live ownership records)",
    "metrics_engine_labels": "per-engine metric series (engine_id label); off by default",
    "health_interval_s": "seconds between store checks behind the health status",
    "redis_allow_no_persistence": "accept a Redis without AOF (RDB-only or none)",
}


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_settings(argv: Sequence[str], environ: dict[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="kvplan serve", description="Run the kvplan service.")
    defaults = Settings()
    for field in fields(Settings):
        default = getattr(defaults, field.name)
        env_value = env.get(f"KVPLAN_{field.name.upper()}")
        kind: Callable[[str], object] = _flag if isinstance(default, bool) else type(default)
        value = kind(env_value) if env_value is not None else default
        # A switch may stand alone (--metrics-engine-labels) or take a value.
        switch: dict[str, object] = {"nargs": "?", "const": True} if kind is _flag else {}
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=kind,
            default=value,
            help=f"{_HELP[field.name]} (env KVPLAN_{field.name.upper()}, default {default!r})",
            **switch,  # type: ignore[arg-type]
        )
    namespace = parser.parse_args(list(argv))
    settings = Settings(**vars(namespace))
    if settings.log_format not in ("text", "json"):
        parser.error("--log-format must be text or json")
    if settings.probe not in ("auto", "nvml", "torch", "static"):
        parser.error("--probe must be auto, nvml, torch or static")
    if not 0.0 < settings.max_commit_fraction <= 1.0:
        parser.error("--max-commit-fraction must be in (0, 1]")
    if settings.lease_ttl_s <= 0:
        parser.error("--lease-ttl-s must be positive")
    # Ownership is refreshed by each renewal: shorter than a lease, it would lapse
    # under a live engine and leave its leases to whoever asks next.
    if settings.ownership_ttl_s < settings.lease_ttl_s:
        parser.error(
            f"--ownership-ttl-s ({settings.ownership_ttl_s:g}) must be at least "
            f"--lease-ttl-s ({settings.lease_ttl_s:g})"
        )
    if bool(settings.tls_cert) != bool(settings.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if settings.tls_client_ca and not settings.tls_cert:
        parser.error("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    for name in ("model_cache_size", "model_cache_bytes"):
        if getattr(settings, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative (0: keep none)")
    for name in (
        "max_engine_id_chars",
        "max_layer_name_chars",
        "max_identifier_chars",
        "max_pending_rendezvous_bytes",
        "rendezvous_result_bytes",
        "max_pending_rendezvous_per_identity",
        "max_pending_rendezvous_bytes_per_identity",
        "max_engines_per_identity",
        "max_measured_configs",
        "max_measurements_per_config",
    ):
        if getattr(settings, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return settings

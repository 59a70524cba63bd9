"""Server settings: flags, then KVPLAN_* environment variables, then defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Settings:
    host: str = "0.0.0.0"
    port: int = 50051  # gRPC
    metrics_port: int = 9464  # Prometheus /metrics; 0 disables, -1 picks a free port
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
    rendezvous_ttl_s: float = 600.0  # a rendezvous or finished engine is forgotten after this
    plan_cache_size: int = 4096  # plans kept for GetPlan and cache hits
    plan_cache_bytes: int = 32 * 1024 * 1024  # and at most this many serialized bytes
    store_plan_bytes: int = 64 * 1024 * 1024  # serialized plans kept in the store
    grace_s: float = 10.0  # shutdown grace for in-flight calls
    offload_layers: int = 2048  # plan in a worker thread above this many layers
    claim_timeout_s: float = 10.0  # a rendezvous claimed by a vanished server is re-claimed


_HELP = {
    "host": "address to bind",
    "port": "gRPC port",
    "metrics_port": "Prometheus metrics port (0: off)",
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
    "rendezvous_ttl_s": "seconds an unfinished rendezvous or a finished engine is kept",
    "plan_cache_size": "plans kept in memory",
    "plan_cache_bytes": "bytes of serialized plans kept in memory",
    "store_plan_bytes": "bytes of serialized plans kept in the store (also bounds its size)",
    "grace_s": "seconds in-flight calls get on shutdown",
    "offload_layers": "plan off the event loop above this many layers",
    "claim_timeout_s": "seconds before another server may plan a claimed rendezvous",
}


def parse_settings(argv: Sequence[str], environ: dict[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="kvplan serve", description="Run the kvplan service.")
    defaults = Settings()
    for field in fields(Settings):
        default = getattr(defaults, field.name)
        env_value = env.get(f"KVPLAN_{field.name.upper()}")
        kind = type(default)
        value = kind(env_value) if env_value is not None else default
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=kind,
            default=value,
            help=f"{_HELP[field.name]} (env KVPLAN_{field.name.upper()}, default {default!r})",
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
    return settings

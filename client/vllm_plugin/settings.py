"""The plugin's settings: every KVPLAN_* variable it reads, in one object.

vLLM warns about (or rejects) unknown VLLM_* variables, so the plugin's own
settings use KVPLAN_* names. They are read when an engine starts planning its KV
cache, so one process may start engines with different settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kvplan.client.planner import PlannerClient
from kvplan.client.security import ChannelSecurity


class Mode(StrEnum):
    OBSERVE = "observe"  # vLLM plans; kvplan's answer is compared and logged
    DRAFT_FLAGS = "draft-flags"  # as observe; kvplan's draft flags replace vLLM's missing ones
    LEASE = "lease"  # as observe; each worker's KV memory is capped by a kvplan lease


class Unavailable(StrEnum):
    """Lease mode when kvplan cannot be reached or fails: the operator's choice."""

    REFUSE = "refuse"  # stop the engine's start (default)
    SERVE = "serve"  # start on vLLM's own measurement, unleased


class Rules(StrEnum):
    """Which rule set observe mode compares vLLM against."""

    ENGINE = "engine"  # the running release's (agreement is the expected answer)
    KVPLAN = "kvplan"  # kvplan's own (shows what kvplan's draft rules would change)


class SettingsError(ValueError):
    pass


DEFAULT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Settings:
    addr: str  # host:port of the kvplan service; empty = the plugin is inert
    mode: Mode = Mode.OBSERVE
    timeout_s: float = DEFAULT_TIMEOUT_S  # deadline of each call while the engine starts
    on_unavailable: Unavailable = Unavailable.REFUSE
    rules: Rules = Rules.ENGINE
    engine_id: str = ""  # lease mode; empty = generated per engine start
    # draft-flags and lease modes: a configuration the fleet measured before gets
    # kv_cache_memory_bytes, so vLLM skips its memory profiling (docs/vllm.md).
    reuse_measurements: bool = False
    # TLS, client certificate and bearer token, from the client's own KVPLAN_TLS_CA /
    # KVPLAN_CLIENT_CERT / KVPLAN_CLIENT_KEY / KVPLAN_TOKEN (docs/security.md).
    security: ChannelSecurity = field(default_factory=ChannelSecurity)

    @property
    def enabled(self) -> bool:
        return bool(self.addr)

    @property
    def retry_budget_s(self) -> float:
        """The most the waits between retries may add to one call: a quarter of
        KVPLAN_TIMEOUT_S, so a dead server costs an engine start at most that (0.3 s
        at the default 2 s: two retries) and the last try keeps most of the deadline."""
        return self.timeout_s / 4

    def planner_client(self) -> PlannerClient:
        """The client of one engine start (and its lease heartbeats)."""
        return PlannerClient(
            self.addr,
            timeout_s=self.timeout_s,
            security=self.security,
            retry_budget_s=self.retry_budget_s,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        addr = env.get("KVPLAN_ADDR", "").strip()
        try:
            mode = Mode(env.get("KVPLAN_MODE", Mode.OBSERVE.value).strip().lower())
        except ValueError:
            raise SettingsError(
                f"KVPLAN_MODE={env['KVPLAN_MODE']!r}: expected one of "
                + ", ".join(m.value for m in Mode)
            ) from None
        try:
            on_unavailable = Unavailable(
                env.get("KVPLAN_ON_UNAVAILABLE", Unavailable.REFUSE.value).strip().lower()
            )
        except ValueError:
            raise SettingsError(
                f"KVPLAN_ON_UNAVAILABLE={env['KVPLAN_ON_UNAVAILABLE']!r}: expected refuse or serve"
            ) from None
        try:
            rules = Rules(env.get("KVPLAN_RULES", Rules.ENGINE.value).strip().lower())
        except ValueError:
            raise SettingsError(
                f"KVPLAN_RULES={env['KVPLAN_RULES']!r}: expected engine or kvplan"
            ) from None
        reuse = _flag(env, "KVPLAN_REUSE_MEASUREMENTS")
        if reuse and mode is Mode.OBSERVE:
            raise SettingsError(
                "KVPLAN_REUSE_MEASUREMENTS=1 changes the KV cache size, which observe mode "
                "never does: set KVPLAN_MODE=draft-flags or lease with it"
            )
        raw_timeout = env.get("KVPLAN_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
        try:
            timeout_s = float(raw_timeout)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise SettingsError(f"KVPLAN_TIMEOUT_S={raw_timeout!r}: expected seconds > 0")
        try:
            security = ChannelSecurity.from_env(env)
        except (OSError, ValueError) as error:
            raise SettingsError(f"kvplan TLS/token settings: {error}") from None
        return cls(
            addr=addr,
            mode=mode,
            timeout_s=timeout_s,
            on_unavailable=on_unavailable,
            rules=rules,
            engine_id=env.get("KVPLAN_ENGINE_ID", "").strip(),
            security=security,
            reuse_measurements=reuse,
        )


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise SettingsError(f"{name}={env[name]!r}: expected 1 or 0 (true/false, yes/no, on/off)")


__all__ = ["Mode", "Rules", "Settings", "SettingsError", "Unavailable"]

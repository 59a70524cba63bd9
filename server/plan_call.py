"""What one PlanKVCache call has learned, handed from step to step of
`PlannerServicer._serve_plan` (server/servicer.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplan.convert.keys import PlanKeys
from kvplan.convert.wire import WorkerBytes
from kvplan.core.ledger import DeviceAccount, DeviceState
from kvplan.server.store.base import LedgerView
from kvplan.v1 import plan_pb2


@dataclass
class PlanCall:
    """What one plan call has learned so far, handed from step to step.

    `in_thread`: the engine is over --offload-layers, so its heavy steps run in a
    worker thread (`PlannerServicer._run`); decided once per call (summing the
    layers of 8 workers x 65 layers costs 3.9 µs). `encoded`: its workers'
    `encode_workers`, serialized once for the keys and the conversion alike (set by
    the request step). `digest`: SHA-256 of the request's wire bytes (see
    PlanCache.keys). `keys`: its plan keys, once known. `merged`: a rendezvous'
    merged engine, whose ranks were checked and authorized each on arrival; it
    does not come in again as these bytes, so its keys are not remembered.
    `publish`: a new plan becomes the engine's plan and is persisted at once
    (otherwise the lease step does that once its leases are granted).
    """

    request: plan_pb2.PlanRequest
    in_thread: bool
    encoded: Sequence[WorkerBytes] = ()
    digest: bytes | None = None
    keys: PlanKeys | None = None
    merged: bool = False
    publish: bool = True

    def let_go_of_request(self) -> None:
        """A rank waiting for its engine's others keeps its bytes only, not its
        parsed request (rendezvous.RankSpec): nothing of this call holds it on."""
        self.request = plan_pb2.PlanRequest()
        self.encoded = ()


@dataclass
class Leasing:
    """A call whose workers name devices, after the devices step: `call` plans the
    request with the devices' numbers (keys known; published once granted), for
    `holder`'s quota, against the ledger as read at `now` (`view`)."""

    call: PlanCall
    named: list[int]  # indexes of the workers that name a device
    devices: dict[str, DeviceState]
    accounts: dict[str, DeviceAccount]
    view: LedgerView
    now: float
    holder: str

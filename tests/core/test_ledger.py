"""The ledger arithmetic and the budget modes' footprints (what a lease reserves)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.core.ledger import (
    MAX_LISTED_HOLDERS,
    NOTHING,
    DeviceAccount,
    DeviceState,
    GrantRefused,
    Lease,
    LeaseRequest,
    Totals,
    account,
    changes,
    check_grant,
    counted,
    excluding,
    holdings,
    identity_changes,
    tally,
)
from kvplan.core.memory import BudgetMode
from kvplan.core.planner import WorkerPlan, plan_engine
from kvplan.core.request import DeviceInfo, MemoryRequest, NonKVMemory
from tests.core.builders import GIB, engine, full

TOTAL = 80 * GIB
DEVICE = DeviceState("GPU-a", total_bytes=TOTAL, free_bytes=TOTAL, commit_limit_bytes=TOTAL)
NOW = 1_000.0


def lease(
    engine_id: str, nbytes: int, allocated: int = 0, *, rank: int = 0, expires: float = NOW + 60
) -> Lease:
    return Lease(engine_id, rank, "GPU-a", nbytes, allocated, granted_at=NOW, expires_at=expires)


def recount(
    device: DeviceState, leases: list[Lease], now: float, exclude_engine: str | None = None
) -> DeviceAccount:
    """The account from the leases themselves: the figure a store's totals give."""
    live = [item for item in leases if item.live(now) and item.engine_id != exclude_engine]
    return account(device, tally(live).get(device.uuid, NOTHING))


def check(
    engine_id: str,
    requests: list[LeaseRequest],
    devices: dict[str, DeviceState],
    leases: list[Lease],
    now: float,
) -> dict[str, DeviceAccount]:
    """`check_grant` on the other engines' live leases, naming holders as a store does."""
    others = tally(item for item in leases if item.live(now) and item.engine_id != engine_id)
    try:
        return check_grant(engine_id, requests, devices, others)
    except GrantRefused as refused:
        named = holdings(refused.device_uuid, leases, now, exclude_engine=engine_id)
        raise refused.held_by(named) from None


def test_account_counts_live_leases_of_others_only() -> None:
    leases = [
        lease("a", 30 * GIB, allocated=10 * GIB),
        lease("b", 20 * GIB, allocated=20 * GIB),
        lease("dead", 25 * GIB, expires=NOW),  # expired exactly now: counts for nothing
    ]
    device = replace(DEVICE, free_bytes=TOTAL - 30 * GIB)  # a and b hold 30 GiB
    view = recount(device, leases, NOW)
    assert (view.committed_bytes, view.outstanding_bytes, view.live_leases) == (
        50 * GIB,
        20 * GIB,
        2,
    )
    # min(80 - 50, 50 - 20) = 30 GiB
    assert view.available_to_grant_bytes == 30 * GIB
    mine_excluded = recount(device, leases, NOW, exclude_engine="a")
    assert mine_excluded.committed_bytes == 20 * GIB


def test_two_engines_at_045_fit_a_third_is_refused_with_numbers() -> None:
    share = int(0.45 * TOTAL)
    leases = [lease("a", share), lease("b", share)]
    check("a", [LeaseRequest(0, "GPU-a", share)], {"GPU-a": DEVICE}, leases[1:], NOW)
    with pytest.raises(GrantRefused) as refused:
        check("c", [LeaseRequest(0, "GPU-a", share)], {"GPU-a": DEVICE}, leases, NOW)
    assert refused.value.grant_reason == "commit_limit"
    assert refused.value.details["committed_bytes"] == 2 * share
    assert refused.value.details["requested_bytes"] == share
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert "72.00 GiB" in refused.value.message  # 2 x 36 GiB already leased


def test_a_refusal_lists_the_other_engines_holdings_ids_withheld_unless_named() -> None:
    share = int(0.45 * TOTAL)
    leases = [
        lease("a", share // 2, rank=0),
        lease("a", share // 2, rank=1),
        lease("b", share - GIB),
        lease("c", share, rank=2),  # c asks again: its own leases are not "others'"
        lease("gone", share, expires=NOW),  # expired: holds nothing
        Lease("x", 0, "GPU-other", share, 0, granted_at=NOW, expires_at=NOW + 60),
    ]
    with pytest.raises(GrantRefused) as refused:
        check("c", [LeaseRequest(0, "GPU-a", share)], {"GPU-a": DEVICE}, leases, NOW)
    error = refused.value
    # By default (what a store raises) no engine id appears: only the amounts.
    assert [(h.engine_id, h.ranks, h.bytes) for h in error.holdings] == [
        ("a", (0, 1), share),  # two ranks summed, largest holder first
        ("b", (0,), share - GIB),
    ]
    assert "'a'" not in error.message and "'b'" not in error.message
    assert (
        "Held by: another identity's engine (ranks 0, 1) 36.00 GiB, "
        "another identity's engine (rank 0) 35.00 GiB. Lower gpu_memory_utilization"
    ) in error.message, error.message
    assert error.details["holdings"] == f"|0 1|{share};|0|{share - GIB}"
    # Named for a caller that may see engine a only (its owner).
    mine = error.naming(lambda engine_id: engine_id == "a")
    assert "engine 'a' (ranks 0, 1) 36.00 GiB, another identity's engine (rank 0)" in mine.message
    assert "'b'" not in mine.message
    assert mine.details["holdings"] == f"a|0 1|{share};|0|{share - GIB}"
    assert mine.details["committed_bytes"] == error.details["committed_bytes"]
    assert (mine.grant_reason, mine.code) == ("commit_limit", "RESOURCE_EXHAUSTED")
    everyone = error.naming(lambda engine_id: True)
    assert "engine 'a' (ranks 0, 1) 36.00 GiB, engine 'b' (rank 0) 35.00 GiB" in everyone.message


def test_a_refusal_lists_a_bounded_number_of_holders() -> None:
    leases = [lease(f"e{i:02d}", GIB) for i in range(MAX_LISTED_HOLDERS + 5)]
    with pytest.raises(GrantRefused) as refused:
        check("z", [LeaseRequest(0, "GPU-a", 70 * GIB)], {"GPU-a": DEVICE}, leases, NOW)
    named = refused.value.naming(lambda engine_id: True)
    assert named.message.count("engine 'e") == MAX_LISTED_HOLDERS
    assert "5 more engine(s) 5.00 GiB" in named.message
    entries = str(named.details["holdings"]).split(";")
    assert len(entries) == MAX_LISTED_HOLDERS + 1 and entries[-1] == f"+5||{5 * GIB}"


def test_a_refusal_on_free_memory_lists_the_holdings_too() -> None:
    leases = [lease("a", 40 * GIB, allocated=0)]
    loose = replace(DEVICE, commit_limit_bytes=2 * TOTAL)
    with pytest.raises(GrantRefused) as refused:
        check("b", [LeaseRequest(0, "GPU-a", 41 * GIB)], {"GPU-a": loose}, leases, NOW)
    assert refused.value.grant_reason == "free_memory"
    assert "Held by: another identity's engine (rank 0) 40.00 GiB." in refused.value.message


def test_memory_used_without_a_lease_is_not_granted_again() -> None:
    # Another process (no lease) holds 50 GiB: only 30 GiB are free.
    device = replace(DEVICE, free_bytes=30 * GIB)
    check("a", [LeaseRequest(0, "GPU-a", 30 * GIB)], {"GPU-a": device}, [], NOW)
    with pytest.raises(GrantRefused) as refused:
        check("a", [LeaseRequest(0, "GPU-a", 31 * GIB)], {"GPU-a": device}, [], NOW)
    assert refused.value.grant_reason == "free_memory"


def test_promised_not_allocated_memory_is_not_granted_twice() -> None:
    # Engine a was promised 40 GiB and has allocated nothing yet: free still shows it.
    leases = [lease("a", 40 * GIB, allocated=0)]
    with pytest.raises(GrantRefused) as refused:
        check("b", [LeaseRequest(0, "GPU-a", 41 * GIB)], {"GPU-a": DEVICE}, leases, NOW)
    assert refused.value.grant_reason == "commit_limit"
    # With a generous policy the physical bound still holds.
    loose = replace(DEVICE, commit_limit_bytes=2 * TOTAL)
    with pytest.raises(GrantRefused) as refused:
        check("b", [LeaseRequest(0, "GPU-a", 41 * GIB)], {"GPU-a": loose}, leases, NOW)
    assert refused.value.grant_reason == "free_memory"


def test_bytes_already_in_use_by_the_worker_are_not_taken_from_free_twice() -> None:
    device = replace(DEVICE, free_bytes=TOTAL - 20 * GIB)  # the worker loaded 20 GiB of weights
    request = LeaseRequest(0, "GPU-a", 72 * GIB, in_use_bytes=20 * GIB)
    check("a", [request], {"GPU-a": device}, [], NOW)
    with pytest.raises(GrantRefused):
        check("a", [replace(request, in_use_bytes=0)], {"GPU-a": device}, [], NOW)


def test_several_ranks_on_one_device_are_summed() -> None:
    requests = [LeaseRequest(rank, "GPU-a", 30 * GIB) for rank in range(3)]
    with pytest.raises(GrantRefused) as refused:
        check("a", requests, {"GPU-a": DEVICE}, [], NOW)
    assert refused.value.details["ranks"] == "0, 1, 2"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcd"),
            st.integers(0, TOTAL),
            st.integers(0, TOTAL),
            st.floats(0, 120),
        ),
        max_size=12,
    ),
    st.integers(0, TOTAL),
)
def test_granted_sets_never_exceed_either_bound(
    steps: list[tuple[str, int, int, float]], foreign_used: int
) -> None:
    """Replaying grants in order, every accepted state keeps committed <= limit and
    outstanding <= free; the available figure is exactly what the next grant may take."""
    device = DeviceState("GPU-a", TOTAL, TOTAL - foreign_used, int(TOTAL * 0.9))
    leases: list[Lease] = []
    for engine_id, nbytes, in_use, age in steps:
        now = NOW + age
        live = [item for item in leases if item.live(now)]
        view = recount(device, live, now, exclude_engine=engine_id)
        request = LeaseRequest(0, "GPU-a", nbytes, min(in_use, nbytes))
        try:
            check(engine_id, [request], {"GPU-a": device}, live, now)
        except GrantRefused:
            assert nbytes - min(in_use, nbytes) > view.available_to_grant_bytes or (
                nbytes > device.commit_limit_bytes - view.committed_bytes
            )
            continue
        leases = [item for item in live if item.engine_id != engine_id]
        leases.append(Lease(engine_id, 0, "GPU-a", nbytes, request.in_use_bytes, now, now + 60))
        after = recount(device, leases, now)
        assert after.committed_bytes <= device.commit_limit_bytes
        assert after.outstanding_bytes <= device.free_bytes


# --- totals kept by changes equal a recount -------------------------------------------

DEVICES = ("GPU-a", "GPU-b")
IDENTITIES = ("", "alice", "bob")

ledger_steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("grant"),
            st.sampled_from("abcd"),
            st.sampled_from(IDENTITIES),
            st.lists(
                st.tuples(st.integers(0, 2), st.sampled_from(DEVICES), st.integers(0, 50)),
                max_size=3,
            ),
            st.floats(1, 60),
        ),
        st.tuples(st.just("renew"), st.sampled_from("abcd"), st.integers(0, 50), st.floats(1, 60)),
        st.tuples(
            st.just("release"), st.sampled_from("abcd"), st.one_of(st.none(), st.integers(0, 2))
        ),
        st.tuples(st.just("advance"), st.floats(0, 40)),
        st.tuples(st.just("sweep")),
    ),
    max_size=30,
)


class KeptTotals:
    """A store's bookkeeping reduced to its arithmetic: leases, the totals changed
    only through `changes` / `identity_changes`, expiry through a moving mark."""

    def __init__(self) -> None:
        self.leases: dict[tuple[str, int], Lease] = {}
        self.devices: dict[str, Totals] = {}
        self.identities: dict[str, int] = {}
        self.expired_through = float("-inf")

    def count(self, removed: list[Lease], added: list[Lease]) -> None:
        gone = [item for item in removed if counted(item, self.expired_through)]
        new = [item for item in added if counted(item, self.expired_through)]
        for uuid, change in changes(gone, new).items():
            self.devices[uuid] = self.devices.get(uuid, NOTHING) + change
        for identity, step in identity_changes(gone, new).items():
            self.identities[identity] = self.identities.get(identity, 0) + step

    def expire_due(self, now: float) -> None:
        due = [
            item for item in self.leases.values() if self.expired_through < item.expires_at <= now
        ]
        self.count(removed=due, added=[])
        self.expired_through = max(self.expired_through, now)


@settings(max_examples=300, deadline=None)
@given(ledger_steps)
def test_totals_kept_by_changes_equal_a_recount_after_any_sequence(
    steps: list[tuple[object, ...]],
) -> None:
    kept = KeptTotals()
    now = NOW
    for step in steps:
        match step:
            case ("grant", str(engine_id), str(identity), list(asked), float(ttl)):
                kept.expire_due(now)
                own = [item for key, item in kept.leases.items() if key[0] == engine_id]
                for item in own:
                    del kept.leases[(engine_id, item.rank)]
                new = {
                    rank: Lease(engine_id, rank, uuid, gib * GIB, 0, now, now + ttl, identity)
                    for rank, uuid, gib in asked
                }
                kept.leases.update({(engine_id, rank): item for rank, item in new.items()})
                kept.count(removed=own, added=list(new.values()))
            case ("renew", str(engine_id), int(allocated_gib), float(ttl)):
                mine = [
                    item
                    for key, item in kept.leases.items()
                    if key[0] == engine_id and item.live(now)
                ]
                renewed = [
                    replace(item, expires_at=now + ttl, allocated_bytes=allocated_gib * GIB)
                    for item in mine
                ]
                kept.leases.update({(engine_id, item.rank): item for item in renewed})
                kept.count(removed=mine, added=renewed)
            case ("release", str(engine_id), rank):
                gone = [
                    item
                    for key, item in kept.leases.items()
                    if key[0] == engine_id and rank in (None, key[1])
                ]
                for item in gone:
                    del kept.leases[(engine_id, item.rank)]
                kept.count(removed=gone, added=[])
            case ("advance", float(seconds)):
                now += seconds
            case ("sweep",):
                kept.expire_due(now)
                for key in [key for key, item in kept.leases.items() if not item.live(now)]:
                    del kept.leases[key]
        # Whatever happened, after expiring what is due the totals are the recount of
        # the live leases, per device and per identity.
        kept.expire_due(now)
        live = [item for item in kept.leases.values() if item.live(now)]
        expected = tally(live)
        assert {u: t for u, t in kept.devices.items() if t != NOTHING} == expected
        held = {i: n for i, n in kept.identities.items() if n}
        assert held == {
            i: sum(item.identity == i for item in live) for i in {item.identity for item in live}
        }
        # Leaving one engine out is the recount without it.
        for engine_id in "abcd":
            mine = [item for item in live if item.engine_id == engine_id]
            without = {u: t for u, t in excluding(kept.devices, mine).items() if t != NOTHING}
            assert without == tally(item for item in live if item.engine_id != engine_id)


# --- footprints: what each budget mode asks the ledger for ----------------------


def _plan_one(
    memory: MemoryRequest, device: DeviceInfo, blocks_override: int | None = None
) -> WorkerPlan:
    request = engine(
        [(f"l{i}", full()) for i in range(4)],
        GIB,
        max_model_len=4096,
        num_gpu_blocks_override=blocks_override,
    )
    worker = replace(request.workers[0], memory=memory, device=device)
    return plan_engine(replace(request, workers=(worker,))).workers[0]


NON_KV = NonKVMemory(weights_bytes=16 * GIB, activation_peak_bytes=2 * GIB)


def test_utilization_footprint_is_the_requested_share() -> None:
    worker = _plan_one(
        MemoryRequest(gpu_memory_utilization=0.45, non_kv=NON_KV),
        DeviceInfo(uuid="GPU-a", total_memory_bytes=TOTAL),
    )
    requested = -(-TOTAL * 45 // 100)
    assert worker.budget.mode is BudgetMode.UTILIZATION
    assert worker.budget.requested_bytes == requested
    assert worker.budget.available_bytes == requested - 18 * GIB
    assert worker.footprint_bytes == requested


def test_explicit_footprint_adds_non_kv() -> None:
    worker = _plan_one(
        MemoryRequest(kv_cache_memory_bytes=10 * GIB, non_kv=NON_KV), DeviceInfo(uuid="GPU-a")
    )
    assert worker.footprint_bytes == 28 * GIB


def test_free_fraction_applies_to_free_memory_and_keeps_in_use() -> None:
    worker = _plan_one(
        MemoryRequest(free_memory_fraction=0.9, non_kv=NON_KV, device_bytes_in_use=18 * GIB),
        DeviceInfo(uuid="GPU-a", total_memory_bytes=TOTAL, free_memory_bytes=60 * GIB),
    )
    assert worker.budget.mode is BudgetMode.FREE_FRACTION
    assert worker.budget.available_bytes == int(60 * GIB * 0.9)
    assert worker.budget.free_bytes == 60 * GIB
    assert worker.footprint_bytes == 18 * GIB + int(60 * GIB * 0.9)


def test_blocks_override_footprint_is_what_it_allocates() -> None:
    worker = _plan_one(
        MemoryRequest(kv_cache_memory_bytes=10 * GIB, non_kv=NON_KV),
        DeviceInfo(uuid="GPU-a"),
        blocks_override=1000,
    )
    assert worker.budget.mode is BudgetMode.BLOCKS_OVERRIDE
    assert worker.footprint_bytes == 18 * GIB + 1000 * worker.bytes_per_block

"""Trust scenario of issue 35, attack 2: one tenant's pins used as a weapon against another
tenant's place in the CPU tier.

A real ``kvstore serve`` with auth on, tenants A and B (and an admin tenant, for store-wide Stats),
in the attack's shape: a 16 MiB CPU tier of 256 KiB slots in tenant segments of the daemon's
choice (``cpu_bytes`` / 64: a slot each here). Tenant A stores 64 blocks of 2 KiB (a slot each:
the whole tier) and pins as much as it can through the client's Pin RPC (what ``kvstore pin``
sends, ``admin_cli.prefix_call``): all of them in one request, then one block per request (where
a segment holds several slots, a block of every segment first, so its pins spread over as many
segments as they can). Then tenant B puts its 32 hot blocks and reads them.

Counted per pin limit (the default, a quarter of ``cpu_bytes``, and one as large as the CPU tier,
the attack's 16 MiB, where the cap on all tenants' pins together stops A): what A's pins are
charged (the Pin answer's bytes, in slots and segments, against the limit) beside the bytes of
the blocks they name (2 KiB each), A's pin requests accepted and refused and the field each
refusal names, B's blocks in the CPU tier after B read them (a lookup without a lease), B's reads
exact, the promotions and promotion failures while B worked (admin Stats), and A's pinned blocks
still in the CPU tier.
"""

from __future__ import annotations

import os

from kvstore import Namespace
from kvstore.errors import KVStoreError
from kvstore.ops import admin_cli
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.units import parse_size

from .common import KiB, hashes, is_exact, layout, payload

BLOCK = 2 * KiB
B_BLOCKS = 32


def _counters(ops) -> dict:
    c = ops.stats()["counters"]
    return {k: c.get(k, 0) for k in ("promotions", "promotion_failures", "pins_refused_limit")}


def _case(workdir: str, cpu_bytes: str, a_blocks: int, pin_limit: str | None) -> dict:
    env = {"KVSTORE_ADMIN_TENANTS": '["ops"]'}
    if pin_limit:
        env["KVSTORE_MAX_PINNED_BYTES_PER_TENANT"] = pin_limit
    os.makedirs(workdir, exist_ok=True)
    d = start_local_daemon(workdir, "--token", "a-token=a", "--token", "b-token=b", "--token", "ops-token=ops",
                           "--shm-dir", workdir, cpu_bytes=cpu_bytes, nvme_bytes="64MiB", env=env)
    try:
        with d.client(token="a-token") as a, d.client(token="b-token") as b, \
                d.client(token="ops-token", transport="grpc") as ops:
            cpu = ops.stats()["tiers"]["cpu"]
            slot, segment = cpu["slot_bytes"], cpu["segment_bytes"]
            ns_a = a.register_namespace(Namespace(layout(BLOCK, "reliability/pins-a")))
            mine = hashes(a_blocks, seed=1)
            a.put(ns_a, mine, [payload(h, BLOCK) for h in mine])
            refusals: dict[str, int] = {}
            messages: dict[str, str] = {}

            def pin(chosen: list[bytes]) -> dict | None:
                try:
                    return admin_cli.prefix_call(a, "Pin", ns_a, chosen)
                except KVStoreError as e:
                    field = f"{type(e).__name__} naming {getattr(e, 'field', None)}"
                    refusals[field] = refusals.get(field, 0) + 1
                    messages.setdefault(field, str(e))
                    return None

            whole = pin(mine)
            per_segment = segment // slot
            spread = [mine[i] for k in range(per_segment) for i in range(k, a_blocks, per_segment)]
            accepted, charged = [], 0
            for h in spread:
                done = pin([h])
                if done is not None:
                    accepted.append(h)
                    charged = done["bytes"]
            [row_a] = admin_cli.list_namespaces(a)
            before = _counters(ops)
            ns_b = b.register_namespace(Namespace(layout(BLOCK, "reliability/pins-b")))
            hot = hashes(B_BLOCKS, seed=2)
            b_stored = b.put(ns_b, hot, [payload(h, BLOCK) for h in hot]).count("stored")
            got = b.get(ns_b, hot)
            b_exact = sum(is_exact(h, g, BLOCK) for h, g in zip(hot, got))
            b_tiers = b.lookup(ns_b, hot, lease=False).tiers
            after = _counters(ops)
            a_in_cpu = sum(a.lookup(ns_a, [h], lease=False).tiers == ["cpu"] for h in accepted)
            limit = parse_size(pin_limit) if pin_limit else parse_size(cpu_bytes) // 4
            return {
                "cpu_bytes": parse_size(cpu_bytes), "slot_bytes": slot, "segment_bytes": segment,
                "pin_limit_bytes": limit, "pin_limit_set": pin_limit is not None,
                "all_tenants_pin_cap_bytes": parse_size(cpu_bytes) // 2,
                "a_blocks": a_blocks, "block_bytes": BLOCK,
                "a_whole_pin": "refused" if whole is None else f"accepted ({whole['blocks']} blocks)",
                "a_pin_requests": 1 + len(spread), "a_pins_accepted": len(accepted),
                "a_pins_refused": sum(refusals.values()), "a_refused_by": refusals, "a_refusal_messages": messages,
                "a_pinned_blocks": row_a["pinned_blocks"], "a_named_bytes": row_a["pinned_blocks"] * BLOCK,
                "a_charged_bytes": charged, "a_charged_slots": charged // slot, "a_charged_segments": charged // segment,
                "a_pinned_in_cpu": a_in_cpu,
                "b_blocks": B_BLOCKS, "b_stored": b_stored, "b_exact": b_exact, "b_transport": b.active_transport,
                "b_in_cpu_after_read": b_tiers.count("cpu"), "b_tiers": sorted(set(b_tiers)),
                "promotions_during_b": after["promotions"] - before["promotions"],
                "promotion_failures_during_b": after["promotion_failures"] - before["promotion_failures"],
                "pins_refused_counter": after["pins_refused_limit"],
            }
    finally:
        d.stop()


def pin_starvation(workdir: str, cpu_bytes: str = "16MiB", a_blocks: int = 64) -> dict:
    """``a_blocks``: how many 2 KiB blocks A stores and tries to pin (64 fill a 16 MiB tier's slots)."""
    cases = {"default limit": _case(os.path.join(workdir, "default"), cpu_bytes, a_blocks, None),
             "limit = the CPU tier": _case(os.path.join(workdir, "whole"), cpu_bytes, a_blocks, cpu_bytes)}
    return {"cases": cases, "load_avg": round(os.getloadavg()[0], 1), "ok": all(
        c["a_charged_bytes"] <= min(c["pin_limit_bytes"], c["all_tenants_pin_cap_bytes"]) and c["a_pins_refused"] > 0
        and c["b_in_cpu_after_read"] == c["b_blocks"] and c["b_exact"] == c["b_blocks"]
        and c["promotion_failures_during_b"] == 0 for c in cases.values())}

"""Tenants on one daemon: no reading, probing, deleting or planting across tenants, quotas that
hold under concurrent writers, unguessable lease ids, sha256 block keys, TLS with a test CA."""

from __future__ import annotations

import reliability_runner as R


def test_tenancy(tmp_path):
    r = R.run("tenancy", str(tmp_path))
    iso = r["isolation"]
    assert iso["namespace_ids_differ"] and iso["leaked"] == [], iso
    assert set(iso["refused"].values()) <= {"UnknownNamespace", "NOT_FOUND"}, iso   # as if it did not exist
    assert len(iso["refused"]) == 7
    assert iso["victim_blocks_exact"] == iso["victim_blocks"], iso           # the plant attempt changed nothing
    assert iso["bob_sees_tenant"] == "bob"
    assert "bad_tokens_accepted" not in r, r.get("bad_tokens_accepted")
    q = r["quota"]
    assert q["held"] and q["refusals"].get("QuotaExceeded", 0) > 0, q
    assert q["acknowledged_served_exact"] == q["acknowledged"], q            # what was acknowledged is intact
    assert r["lease_hijack"] == {"guesses": 202, "hijacked": 0, "victim_completed": 2, "victim_exact": 2}
    assert r["sha256_keys"] == {"hash_bytes": 32, "lookup_hits": 4, "exact": 4}
    tls = r["tls"]
    if "skipped" not in tls:
        assert tls["with_ca_exact"] == 2, tls
        assert tls["no_ca"] == tls["plaintext"] == tls["wrong_ca"] == "DaemonUnavailable", tls
    assert r["daemon_log_errors"] == 0

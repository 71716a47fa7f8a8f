"""The human summary of reliability.json: one section per scenario, the counts that matter."""

from __future__ import annotations

from .load import LOAD_OPS


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render_markdown(report: dict) -> str:
    """The human summary of reliability.json: one section per scenario, the counts that matter."""
    sc = report["scenarios"]
    m = report["machine"]
    out = ["# kvstore reliability suite", "",
           f"Machine: {m['cpus']} CPUs, {m['ram_gib']} GiB RAM, Python {m['python']}, kernel {m['kernel']}, "
           f"grpcio {m['grpcio']}; run {m['date_utc']} UTC. Regenerate: `python benchmarks/reliability.py all` "
           "(one scenario: `python benchmarks/reliability.py crash`). Raw numbers: reliability.json.", "",
           "Every payload is derived from its block hash, so every byte served is checked. "
           "**Lost** = an acknowledged-persisted block missing after a restart; **wrong** = any served byte "
           "that is not the block's. Both must be 0.", ""]
    summary = []
    if "crash" in sc:
        r = sc["crash"]
        summary.append(_row("kill -9 loop", f"{r['kills']} kills", r["lost"], r["wrong_bytes_served"] + r["wrong_after_restart"],
                            f"DaemonUnavailable x{r['client_errors_by_type'].get('DaemonUnavailable', 0)} while down"))
    if "disk" in sc:
        runs = [g for g in sc["disk"].values() if isinstance(g, dict) and "skipped" not in g]
        summary.append(_row("disk faults", f"{len(runs)} fault scenarios", sum(g.get("lost", 0) for g in runs),
                            sum(g.get("wrong", 0) for g in runs), "puts acknowledged `stored` instead of `persisted`; counted misses"))
    if "fuzz" in sc:
        r = sc["fuzz"]
        summary.append(_row("hostile input", f"{r['requests']} requests", 0, 0,
                            f"{r['undefined_answers']} undefined statuses; no leaks"))
    if "load" in sc:
        r = sc["load"]["concurrent"]
        summary.append(_row("load", f"{r['clients']} clients x {r['seconds']} s", 0, r["wrong_bytes"], f"{r['error_count']} errors"))
    if "deps" in sc:
        per = sc["deps"]["daemon_killed_mid_request"]["per_transport"]
        n = sum(len(v) for v in per.values())
        hung = sum(g["hung"] for v in per.values() for g in v)
        wrong = sum(g["wrong"] + g["wrong_after_restart"] for v in per.values() for g in v)
        summary.append(_row("daemon killed mid-request", f"{n} clients", 0, wrong, f"{hung} hung; all raised DaemonUnavailable"))
    if "churn" in sc and "churn" in sc["churn"]:
        c, i = sc["churn"]["churn"], sc["churn"]["idle"]
        summary.append(_row("client churn + idle callers", f"{c.get('cycles')} clients; {i['idle_connections']} idle "
                            f"+ {i['idle_unary_calls']}+{i['stalled_put_streams']} stalled calls", 0,
                            c.get("wrong_bytes", 0) + i["wrong_bytes"],
                            f"health p99 {i['health_latency'].get('p99_ms')} ms, 1 MiB get p99 "
                            f"{i['get_1mib_latency'].get('p99_ms')} ms"))
    if summary:
        out += [_row("scenario", "runs", "lost", "wrong bytes", "what users saw"), _row(*["---"] * 5), *summary, ""]
    if "crash" in sc:
        r = sc["crash"]
        out += ["## Crash test (kill -9 loop)", "",
                _row("kills", "restarts", "puts", "persisted acks", "gets", "blocks served", "deletes",
                     "lost", "wrong (live)", "wrong (after restart)", "resurrected deletes", "daemon log errors"),
                _row(*["---"] * 12),
                _row(r["kills"], r["restarts"], r["puts"], r["persisted_acks"], r["gets"], r["blocks_served"],
                     r["deletes"], r["lost"], r["wrong_bytes_served"], r["wrong_after_restart"],
                     r["resurrected_after_delete"], r["daemon_log_errors"]), "",
                f"Traffic: {r['config']['workers']} clients ({', '.join(r['config']['transports'])}) on a pool of "
                f"{r['config']['pool_blocks']} blocks of {r['config']['block_bytes'] // 1024} KiB, CPU tier of "
                f"{r['config']['cpu_blocks']} blocks (constant demotion), {r['write_back_cycles']} of the runs in "
                f"write-back mode. Blocks checked after restarts: {r['blocks_checked']} "
                f"({r['blocks_served_after_restart']} present). Errors clients saw: "
                f"{r['client_errors_by_type'] or 'none'}. Persisted blocks a *live* get reported as a miss: "
                f"{r['persisted_missed_live']} (by transport: {r.get('persisted_missed_live_by_transport') or 'none'}).", ""]
    if "disk" in sc:
        r = sc["disk"]
        out += ["## Disk faults", "", _row("fault", "what users saw", "lost", "wrong", "counters / notes"), _row(*["---"] * 5)]
        f = r.get("disk_full", {})
        if "skipped" in f:
            out.append(_row("disk full (8 MiB tmpfs)", "skipped: " + f["skipped"], "", "", ""))
        elif f:
            out.append(_row("disk full (8 MiB tmpfs)",
                            f"{f['acknowledged_persisted']} puts `persisted`, then {f['acknowledged_stored_only']} `stored` "
                            f"(not persisted); newest {f['recent_blocks_served_from_cpu']}/8 served from CPU; after "
                            f"freeing space: `{f['put_after_freeing']}`", f["lost"], f["wrong"],
                            f"write_through_failures={f['write_through_failures']}, healthy={f['healthy']}"))
        for case, g in r.get("unwritable_at_start", {}).items():
            out.append(_row(f"unwritable dir at start ({case})", g.get("message", g.get("skipped", "")), "", "", ""))
        g = r.get("corrupt_files", {})
        if g:
            out.append(_row("blocks torn / bit-flipped (payload, header) / zeroed / swapped / header-erased in the slab files under a running daemon",
                            f"{g['damaged']} damaged blocks -> misses ({g['damaged_served']} served); "
                            f"{g['intact_missing']} intact blocks missing; stored again: {g['served_again_exact']}/6 exact",
                            0, g["wrong"], f"corrupt_dropped={g['corrupt_dropped_counter']}, "
                            f"kvstore_corrupt_blocks_dropped={g['corrupt_metric']:g}"))
        g = r.get("pinned_arena", {})
        if g:
            out.append(_row("every CPU slot pinned (lookup leases), blocks on NVMe requested",
                            "; ".join(f"{t}: {v['served_exact']}/{v['nvme_blocks_asked']} served" for t, v in g.items()),
                            0, 0, "streamed around the arena instead of a false miss"))
        for key, label in (("dir_deleted", "NVMe directory deleted while running"),
                           ("read_only_remount", "NVMe filesystem remounted read-only while running")):
            g = r.get(key, {})
            if "skipped" in g:
                out.append(_row(label, "skipped: " + g["skipped"], "", "", ""))
            elif g:
                out.append(_row(label, f"puts `{'/'.join(sorted(set(g['puts_after_fault'])))}`; new blocks served "
                                f"{g['new_blocks_served']}/8; CPU-resident blocks served {g['cpu_blocks_still_served']}/"
                                f"{g['cpu_blocks_before_fault']}; after recovery: {g['puts_after_recovery']}; "
                                f"SIGTERM exit {g['sigterm_exit_code']}", "n/a (medium gone)", g["wrong"],
                                f"write_through_failures={g['write_through_failures']}, corrupt_dropped={g['corrupt_dropped']}"))
        out.append("")
    if "memory" in sc:
        out += ["## Memory pressure", "", _row("configuration", "outcome", "exit code", "seconds"), _row(*["---"] * 4)]
        for case, g in sc["memory"].items():
            if isinstance(g, dict) and "refused" in g:
                out.append(_row(case, g.get("message", ""), g.get("exit_code"), g.get("seconds")))
            elif isinstance(g, dict) and "skipped" in g:
                out.append(_row(case, "skipped: " + g["skipped"], "", ""))
        if "load" in sc and sc["load"].get("rss"):
            rr = sc["load"]["rss"]
            out += ["", f"Daemon RSS under the load test (anonymous memory, i.e. excluding the shared arena): start "
                        f"{rr['rss_anon_start_mib']} MiB, peak {rr['rss_anon_peak_mib']} MiB, end {rr['rss_anon_end_mib']} MiB "
                        f"(growth over the second half: {rr['rss_anon_second_half_growth_mib']} MiB); total RSS at the end "
                        f"{rr['rss_total_end_mib']} MiB."]
        out.append("")
    if "fuzz" in sc:
        r = sc["fuzz"]
        codes: dict[str, int] = {}
        for per in r["outcomes"].values():
            for k, v in per.items():
                codes[k] = codes.get(k, 0) + v
        out += ["## Hostile input", "",
                f"Fuzz: {r['requests']} randomized requests over every RPC through the raw stubs (structured "
                "nasty values, huge batch counts, namespace/layout confusion, plus serialized messages truncated, "
                f"bit-flipped or replaced by garbage, and one oversized message). Answers: {codes}. "
                f"Undefined answers: **{r['undefined_answers']}**; daemon alive: {r['daemon_alive']}; "
                f"leaks after lease expiry: {r['leaks']}; unrelated stored blocks still exact: "
                f"{r['stored_blocks_still_exact']}/8; daemon log errors: {r['daemon_log_errors']}. (INTERNAL appears only "
                "as gRPC's own answer to bytes that are not a protobuf message.)", ""]
    if "slowloris" in sc:
        r = sc["slowloris"]
        out += [f"Slowloris: {r['stallers']} (more stalled streams than the daemon's 16 worker threads). A normal "
                f"client was answered in {r['normal_client_answer_s']} s (exact: {r['normal_client_exact']}/2); "
                f"stalled streams cancelled: {r['stalled_streams_cancelled']}; leases expired: {r['leases_expired']}; "
                f"after expiry: {r['leaks_after_expiry']}; CPU blocks {r['cpu_blocks_before']} -> {r['cpu_blocks_after']}.", ""]
    if "http_slowloris" in sc and "held" in sc["http_slowloris"]:
        r = sc["http_slowloris"]
        out += ["## Slow HTTP clients (metrics and /v1/route port)", "",
                f"A separate process held {r['slow_clients']} connections to the HTTP port, each sending one header "
                f"byte a second for {r['held_s']} s, while this process timed `GET /metrics` and `POST /v1/route` "
                f"back to back; the same probes with nobody else connected, first, in the same run (load average "
                f"{r['load_avg']:.1f}).", "",
                _row("", "metrics p50 / p99 / max (ms)", "route p50 / p99 / max (ms)", "statuses"), _row(*["---"] * 4)]
        for phase in ("quiet", "held"):
            scrape, route = r[phase]["metrics"], r[phase]["route"]
            out.append(_row(phase, f"{scrape['p50_ms']} / {scrape['p99_ms']} / {scrape['max_ms']}",
                            f"{route['p50_ms']} / {route['p99_ms']} / {route['max_ms']}",
                            f"{scrape['statuses']} / {route['statuses']}"))
        out += ["", f"Slow connections let go by the whole-request deadline (10 s) or pushed out: "
                f"{r['slow_connections_let_go']}; still open at the end: {r['slow_connections_still_open']}. "
                f"Passed (p99 < 100 ms, every answer 200, none held): {r['ok']}.", ""]
    if "revocation" in sc and "per_transport" in sc["revocation"]:
        r = sc["revocation"]
        out += ["## A reload that removes a token", "",
                "Per transport: tenant A's client works, A's token is removed (config file + SIGHUP), then A's client "
                "calls again; A's old tickets from a Handshake before the reload are tried on every socket.", "",
                _row("transport", "reload applied (s)", "calls until refused", "refused with", "get / put / lookup / exists after",
                     "old tickets", "other tenant served"), _row(*["---"] * 7)]
        for t, p in r["per_transport"].items():
            out.append(_row(t, p["reload_applied_s"], p["calls_until_refused"], p["refused_with"],
                            " / ".join(p["get_put_lookup_exists_after"]),
                            ", ".join(f"{k}: {v}" for k, v in p["old_tickets"].items()), p["other_tenant_served"]))
        out += ["", f"Passed: {r['ok']}.", ""]
    if "peer_replay" in sc and "modes" in sc["peer_replay"]:
        r = sc["peer_replay"]
        out += ["## A departed fleet node's signed entry written back", "",
                f"{r['rounds']} rounds per row. Node d1 (auth on; the peer token is tenant t's token) stores 4 blocks and "
                "publishes them; the attacker saves d1's signed entry and checksums, d1 stops cleanly, a gRPC server "
                "of the attacker's takes d1's port and serves d1's own bytes, and the saved values are written back "
                "to Redis within their signed expiry (with d1's tombstone left, or deleted too). A victim daemon "
                "then misses on those blocks. Every call the thief got is replayed byte for byte to an honest "
                "daemon. Then the honest node stores the blocks and the victim fetches them.", "",
                _row("tombstone", "calls the thief got", "with the peer token or fleet secret",
                     "blocks kept from the thief", "replays refused by an honest daemon",
                     "blocks then fetched from the honest node", "victim counters"), _row(*["---"] * 7)]
        for mode, g in r["modes"].items():
            out.append(_row(mode.split()[1], g["thief_calls"], g["secrets_seen"],
                            f"{g['blocks_kept_from_thief']} of {g['blocks_asked']}",
                            f"{g['replays_refused']} of {g['proofs_replayed']}",
                            f"{g['honest_blocks_fetched']} of {g['blocks_asked']}",
                            ", ".join(f"{k} {v}" for k, v in g["victim_counters"].items())))
        out += ["", f"Passed: {r['ok']}.", ""]
    if "pin_starvation" in sc and "cases" in sc["pin_starvation"]:
        r = sc["pin_starvation"]
        c0 = next(iter(r["cases"].values()))
        out += ["## One tenant's pins against another's CPU tier", "",
                f"Auth on, tenants A and B, a {c0['cpu_bytes'] >> 20} MiB CPU tier of {c0['slot_bytes'] >> 10} KiB "
                f"slots in {c0['segment_bytes'] >> 10} KiB tenant segments. A stores {c0['a_blocks']} blocks of "
                f"{c0['block_bytes'] >> 10} KiB (a slot each: the whole tier) and pins as much as it can through the "
                "Pin RPC (`kvstore pin`'s call): all of them in one request, then one block per request, one block of "
                "every segment first. Then B puts its "
                f"{c0['b_blocks']} hot blocks and reads them; a lookup without a lease then says which tier holds each. "
                "Charged = the Pin answer's bytes (what A's pins hold of the CPU tier); named = the bytes of the "
                f"blocks pinned. Load average {r.get('load_avg', '?')}.", "",
                _row("pin limit", "A's pin requests: accepted / refused (refused with)", "A's pins: blocks, named, charged",
                     "charged in slots / segments", "A's pinned blocks in CPU", "B stored / exact",
                     "B's blocks in CPU after its read", "promotions / failures during B's part"), _row(*["---"] * 8)]
        for name, g in r["cases"].items():
            out.append(_row(f"{name}: {g['pin_limit_bytes'] >> 20} MiB (all tenants: {g['all_tenants_pin_cap_bytes'] >> 20} MiB)",
                            f"{g['a_pins_accepted']} / {g['a_pins_refused']} of {g['a_pin_requests']} "
                            f"({', '.join(f'{k} x{v}' for k, v in g['a_refused_by'].items())}; the whole pin: {g['a_whole_pin']})",
                            f"{g['a_pinned_blocks']}, {g['a_named_bytes'] >> 10} KiB, {g['a_charged_bytes'] >> 20} MiB",
                            f"{g['a_charged_slots']} / {g['a_charged_segments']}",
                            f"{g['a_pinned_in_cpu']} of {g['a_pinned_blocks']}",
                            f"{g['b_stored']} / {g['b_exact']}", f"{g['b_in_cpu_after_read']} of {g['b_blocks']}",
                            f"{g['promotions_during_b']} / {g['promotion_failures_during_b']}"))
        out += ["", "Refusals, first of each kind:", ""]
        for name, g in r["cases"].items():
            for kind, message in g["a_refusal_messages"].items():
                out.append(f"- {name}, {kind}: `{message}`")
        out += ["", f"Passed (A charged within its limit and the all-tenants cap, refused beyond it; B's blocks all "
                f"in the CPU tier and exact, no promotion failure): {r['ok']}.", ""]
    if "segments_cycle" in sc and "keep" in sc["segments_cycle"]:
        r = sc["segments_cycle"]
        k = r["keep"]
        out += ["## Tenant segments cycling while a client keeps them", "",
                f"A {k['cpu_bytes'] >> 20} MiB CPU arena in {k['segment_bytes'] >> 20} MiB tenant segments, two tenants; "
                f"{k['cycles']} times tenant A fills the arena and a process of A's takes and keeps a descriptor and a "
                "mapping of every segment A owns, then tenant B fills it, so every segment passes to B and gets fresh "
                "memory. Segment memory = the pages of every segment the daemon, A's holder and B's client still "
                "reference (`st_blocks` of each memfd); bound = the arena + 2 tenants x "
                f"`max_held_segment_bytes_per_tenant` ({k['held_cap_bytes'] >> 20} MiB, its default: the arena). "
                "`keep`: the holder never touches what it keeps; `touch`: it writes every page of everything it "
                "holds before each of B's fills. Host Shmem (`/proc/meminfo`, moved by other processes too) is the "
                "change since before the daemon started.", "",
                _row("holder", "cycle", "arena segments (MiB)", "replaced segments in memory (MiB)",
                     "replaced segments still held", "host Shmem change (MiB)", "A's fill", "B stored / exact"),
                _row(*["---"] * 8)]
        for mode, g in r.items():
            if not isinstance(g, dict) or "rounds" not in g:
                continue
            for x in g["rounds"]:
                a_fill = f"{x['a_stored']} stored" if not x["a_put_error"] else "refused: " + (
                    "max_held_segment_bytes_per_tenant" if "max_held_segment_bytes_per_tenant" in x["a_put_error"]
                    else x["a_put_error"][:60])
                out.append(_row(mode, x["cycle"], round(x["current_bytes"] / 2**20, 1),
                                round(x["replaced_bytes"] / 2**20, 1), x["replaced_segments"],
                                round(x["host_shmem_delta_bytes"] / 2**20, 1), a_fill,
                                f"{x['b_stored']} / {x['b_exact']}"))
        out += ["", "Worst segment memory: " + "; ".join(
            f"{mode} {g['worst_segment_bytes'] / 2**20:.1f} MiB of a {g['bound_bytes'] / 2**20:.0f} MiB bound "
            f"(passed: {g['ok']})" for mode, g in r.items() if isinstance(g, dict) and "rounds" in g) + ".", ""]
    if "tenancy" in sc:
        r = sc["tenancy"]
        iso, q = r["isolation"], r["quota"]
        out += ["## Tenancy", "",
                f"- Tenant B against tenant A's namespace: {iso['refused']} (the same answer as a namespace that does "
                f"not exist); leaked: {iso['leaked'] or 'nothing'}.",
                f"- B claiming A's tenant name gets its own namespace ({iso['namespace_ids_differ']}); B writing garbage "
                f"under the very same hash bytes left A's blocks exact: {iso['victim_blocks_exact']}/{iso['victim_blocks']}.",
                f"- Wrong tokens refused: {r.get('bad_tokens_refused')}; accepted: {r.get('bad_tokens_accepted', 'none')}.",
                f"- Quota {q['quota_bytes']} bytes, {q['writers']} concurrent writers attempting {q['attempted_blocks']} blocks: "
                f"tenant holds {q['tenant_bytes_after']} bytes (held: {q['held']}), refusals {q['refusals']}, "
                f"acknowledged blocks exact {q['acknowledged_served_exact']}/{q['acknowledged']}.",
                f"- Lease hijack: {r['lease_hijack']}.", f"- sha256 block keys: {r['sha256_keys']}.",
                f"- TLS with a test CA: {r['tls']}.", ""]
    if "load" in sc:
        r = sc["load"]
        out += ["## Load", "", _row("run", "clients", "ops/s", "errors", "wrong bytes", "lookup p50/p99 ms",
                                    "get p50/p99 ms", "put p50/p99 ms"), _row(*["---"] * 8)]
        for name in ("single_client", "concurrent"):
            g = r[name]
            lat = g["latency"]
            out.append(_row(name, g["clients"], g["ops_per_s"], g["error_count"], g["wrong_bytes"],
                            *[f"{lat[op].get('p50_ms')} / {lat[op].get('p99_ms')}" for op in LOAD_OPS]))
        out += ["", f"{r['concurrent']['seconds']} s per run, {r['block_bytes'] // 1024} KiB blocks; get = 4 blocks, "
                "put = 2 new blocks, lookup = a 32-block chain. Clients: " + ", ".join(
                    f"{n}x {mode}/{t}" for mode, t, n in r["plan"]) + f". Throughput vs one client: "
                f"{r['throughput_ratio']}x (the machine has {m['cpus']} cores shared by clients and daemon, so "
                "latency grows with queueing). Leases left after: " + str(r["leases_left"]) + ".", ""]
    if "deps" in sc:
        r = sc["deps"]
        out += ["## Dependencies down", "", _row("transport", "raised", "seconds to raise (kill -> exception)",
                                                 "hung", "reconnected after restart (s)", "hits after restart", "wrong"),
                _row(*["---"] * 7)]
        for t, runs in r["daemon_killed_mid_request"]["per_transport"].items():
            for g in runs:
                out.append(_row(t, g["raised"], g["seconds_to_raise"], g["hung"], g["reconnected_s"],
                                g["hits_after_restart"], g["wrong"] + g["wrong_after_restart"]))
        rd = r.get("redis_down", {})
        out += ["", f"Client deadline {r['daemon_killed_mid_request']['client_timeout_s']} s. The same Client objects "
                "were reused after the daemon came back on the same port and directory.", "",
                f"Redis killed under a fleet-publishing Store: {rd}", ""]
    if "churn" in sc and "churn" in sc["churn"]:
        r = sc["churn"]
        c, i = r["churn"], r["idle"]
        out += ["## Client churn and idle callers", "",
                "Phase 1: clients connect over the side channel, read one block and close. Phase 2: idle "
                "connections parked on the side-channel port (a third sending half a greeting), unary calls "
                "that never send their message and stalled Put streams, each reopened when the daemon cuts "
                "it, while a legitimate client probes health and a 1 MiB get every 50 ms.", "",
                _row("what", "figure"), _row("---", "---"),
                *[_row(f"churn: {k}", v) for k, v in c.items() if not isinstance(v, (dict, list))],
                *[_row(f"idle: {k}", v) for k, v in i.items() if not isinstance(v, (list,))],
                _row("passed", r.get("ok")), ""]
    return "\n".join(out)

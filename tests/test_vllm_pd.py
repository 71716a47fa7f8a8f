"""Prefill/decode disaggregation end to end: real vLLM OpenAI servers (CPU build, engine core in its
own process), real kvstore daemons in fleet mode on real Redis, ``kvstore pd-proxy`` in front.

One prefill server P (``kv_producer``) on daemon A; two decode servers (``kv_consumer``): D1 on A
(same daemon: 1P1D through one daemon) and D2 on B (B fetches P's blocks from A by verified peer
fetch: the XpYd case). The proxy takes the decoders in turn. The scenario runs once, in order
(engine starts are the cost), and the tests below read its record:

1. healthy: prompts one at a time through the proxy (one streamed), then four at once (the race
   a decode engine used to lose: it looked the prompt up before the prefill's saves landed);
2. prefill dies mid-save: a prefill's last two blocks are deleted from A before decode runs, as
   if they never arrived; decode waits ``pd_wait_s``, loads the rest, recomputes those two;
3. params naming another prompt are refused;
4. daemon A is SIGKILLed: P's saves fail, D1's daemon is down (recompute at once), D2's daemon
   cannot fetch from the dead producer daemon (recompute after ``pd_wait_s``);
5. the colocated reference: every prompt sent straight to P with the full ``max_tokens``
   (prefill and decode on one engine; nothing loaded, daemon A is dead).
"""

from __future__ import annotations

import os
import random
import sys
import textwrap
import threading
import time
import uuid

import pytest

from kvstore.keys import ChainHasher

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402
from pd_cluster import PdProxy, VllmServer, complete, metrics  # noqa: E402

BLOCK = 32
MAX_TOKENS = 8
WAIT_S = 3.0
SECRET = "test-pd-fleet-secret-0123456789abcdef"

pytestmark = pytest.mark.timeout(900)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(20261204)
    lengths = {"S1": 200, "S2": 170, "S3": 230, "S4": 150, "C1": 180, "C2": 210, "C3": 140, "C4": 190,
               "M": 220, "K1": 160, "K2": 175}
    return {name: [rng.randrange(3, 1000) for _ in range(n)] for name, n in lengths.items()}


PROMPTS = _prompts()
HASHER = ChainHasher("xxh3_128", seed=0)


def _full_blocks(name: str) -> int:
    return len(PROMPTS[name]) // BLOCK


def _fleet_daemon(workdir, redis_url: str, prefix: str, node_id: str):
    from daemon_util import start_daemon

    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "kvstore.yaml"
    config.write_text(textwrap.dedent(f"""
        shm_dir: {workdir}
        fleet:
          enabled: true
          redis_url: {redis_url}
          node_id: {node_id}
          key_prefix: {prefix}
          secret: {SECRET}
          heartbeat_s: 0.2
          ttl_s: 1.5
          peer_timeout_s: 2.0
    """))
    return start_daemon(workdir, "--config", str(config), nvme_bytes="0")


def _transfer_config(daemon_url: str, role: str) -> dict:
    cfg = vllm_runner.kvstore_transfer_config(f"grpc://{daemon_url}", retry_after_s=30, pd_wait_s=WAIT_S)
    cfg["kv_role"] = role
    return cfg


def _delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after) if after.get(k, 0) != before.get(k, 0)}


class Cluster:
    def __init__(self, root, redis_url: str) -> None:
        self.prefix = f"kvstest-pd-{uuid.uuid4().hex[:10]}"
        self.redis_url = redis_url
        self.root = root
        python = vllm_runner.vllm_python()
        self.model = str(root / "tiny")
        import subprocess

        subprocess.run([python, os.path.join(vllm_runner.HERE, "tiny_model.py"), self.model], check=True,
                       capture_output=True, timeout=300)
        self.a = _fleet_daemon(root / "a", redis_url, self.prefix, "a")
        self.b = _fleet_daemon(root / "b", redis_url, self.prefix, "b")
        wd = str(root)
        self.servers = []
        self.p = self._server(python, wd, "prefill", self.a.url, "kv_producer")
        self.d1 = self._server(python, wd, "decode1", self.a.url, "kv_consumer")
        self.d2 = self._server(python, wd, "decode2", self.b.url, "kv_consumer")
        for s in self.servers:
            s.wait_healthy("/health", 400)
        self.proxy = PdProxy.start(wd, [self.p.url], [self.d1.url, self.d2.url])

    def _server(self, python, wd, name, daemon_url, role):
        server = VllmServer.start(python, self.model, wd, name, _transfer_config(daemon_url, role), wait=False)
        self.servers.append(server)
        return server

    def decode_metrics(self) -> dict[str, dict]:
        return {"d1": metrics(self.d1.url), "d2": metrics(self.d2.url)}

    def via_proxy(self, name: str, stream: bool = False) -> dict:
        t0 = time.monotonic()
        out = complete(self.proxy.url, self.model, PROMPTS[name], MAX_TOKENS, stream=stream)
        out["seconds"] = time.monotonic() - t0
        return out

    def close(self) -> None:
        for s in [self.proxy, *self.servers]:
            s.stop()
        for d in (self.a, self.b):
            d.kill()
        import redis

        r = redis.Redis.from_url(self.redis_url)
        keys = list(r.scan_iter(match=f"{self.prefix}:*", count=1000))
        if keys:
            r.delete(*keys)


def _phase(cluster: Cluster, run) -> dict:
    """Run ``run()``; its result with each decoder's counters added meanwhile (``counters``)."""
    before = cluster.decode_metrics()
    out = run()
    # the engines record a step's stats after answering: read until two reads agree
    after = cluster.decode_metrics()
    for _ in range(20):
        time.sleep(0.5)
        again = cluster.decode_metrics()
        if again == after:
            break
        after = again
    return {"out": out, "counters": {k: _delta(before[k], after[k]) for k in before}}


def _sum(counters: dict, key: str) -> float:
    return sum(c.get(key, 0) for c in counters.values())


@pytest.fixture(scope="module")
def record(tmp_path_factory, redis_url):
    cluster = Cluster(tmp_path_factory.mktemp("pd"), redis_url)
    rec: dict = {}
    try:
        rec["health_all_up"] = _health(cluster)
        # 1. healthy, one at a time (S4 streamed), then four at once
        rec["sequential"] = _phase(cluster, lambda: {n: cluster.via_proxy(n, stream=n == "S4")
                                                     for n in ("S1", "S2", "S3", "S4")})

        def at_once():
            out: dict = {}
            threads = [threading.Thread(target=lambda n=n: out.__setitem__(n, cluster.via_proxy(n)))
                       for n in ("C1", "C2", "C3", "C4")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return out

        rec["concurrent"] = _phase(cluster, at_once)

        # 2. prefill dies mid-save: its last two blocks never reach the daemon
        prefill = complete(cluster.p.url, cluster.model, PROMPTS["M"], 1,
                           extra={"kv_transfer_params": {"do_remote_decode": True}})
        rec["prefill_params"] = params = prefill["answer"]["kv_transfer_params"]
        hashes = HASHER.chain(PROMPTS["M"], BLOCK)
        ns_id = bytes.fromhex(params["kvstore"]["namespace"])
        with cluster.a.client() as c:
            deadline = time.monotonic() + 10
            while not all(c.exists(ns_id, hashes)) and time.monotonic() < deadline:
                time.sleep(0.05)
            rec["mid_save_deleted"] = c.delete(ns_id, hashes[-2:])

        def mid_save():
            t0 = time.monotonic()
            out = complete(cluster.d1.url, cluster.model, PROMPTS["M"], MAX_TOKENS,
                           extra={"kv_transfer_params": params})
            out["seconds"] = time.monotonic() - t0
            return out

        rec["mid_save"] = _phase(cluster, mid_save)
        # 3. params of prompt M handed to a request for prompt S1
        rec["refused"] = _phase(cluster, lambda: complete(cluster.d1.url, cluster.model, PROMPTS["S1"], MAX_TOKENS,
                                                          extra={"kv_transfer_params": params}))
        # 4. the producer's daemon (also D1's) dies
        cluster.a.kill()
        rec["daemon_a_dead"] = _phase(cluster, lambda: {n: cluster.via_proxy(n) for n in ("K1", "K2")})
        rec["health_after_kill"] = _health(cluster)
        # 5. the colocated reference: prefill and decode on P alone
        rec["colocated"] = {n: complete(cluster.p.url, cluster.model, p, MAX_TOKENS)["token_ids"]
                            for n, p in PROMPTS.items()}
        # 6. the prefill instance is gone: the proxy has decode compute the prompt
        cluster.p.stop()
        rec["prefill_down"] = cluster.via_proxy("S2")
        rec["health_no_prefill"] = _health(cluster)
    finally:
        cluster.close()
    return rec


def _health(cluster: Cluster) -> tuple[int, dict]:
    import json

    from pd_cluster import _get

    status, raw = _get(cluster.proxy.url + "/healthcheck")
    return status, json.loads(raw or b"{}")


def test_pd_decode_is_token_identical_to_a_colocated_engine(record):
    seq, conc = record["sequential"]["out"], record["concurrent"]["out"]
    for name in ("S1", "S2", "S3", "S4"):
        assert seq[name]["token_ids"] == record["colocated"][name], name
        assert len(seq[name]["token_ids"]) == MAX_TOKENS
    assert seq["S4"]["events"] >= MAX_TOKENS   # streamed through the proxy, token by token
    for name in ("C1", "C2", "C3", "C4"):
        assert conc[name]["token_ids"] == record["colocated"][name], name


def test_prefill_names_exactly_the_prompt_blocks_it_saves(record):
    p = record["prefill_params"]
    assert p["do_remote_prefill"] is True
    kv = p["kvstore"]
    assert kv["blocks"] == _full_blocks("M") and kv["block_tokens"] == BLOCK
    assert kv["last_hash"] == HASHER.chain(PROMPTS["M"], BLOCK)[-1].hex()


def test_decode_loads_every_full_prompt_block_and_recomputes_none(record):
    """1P1D (D1, same daemon) and 1P2D across the fleet (D2): all named blocks loaded, nothing
    recomputed, also when four prompts arrive at once (the race the wait closes)."""
    for phase, names in (("sequential", ("S1", "S2", "S3", "S4")), ("concurrent", ("C1", "C2", "C3", "C4"))):
        counters = record[phase]["counters"]
        blocks = sum(_full_blocks(n) for n in names)
        assert _sum(counters, "vllm:kvstore_pd_waits") == len(names), counters
        assert _sum(counters, "vllm:kvstore_pd_loaded_requests") == len(names), counters
        assert _sum(counters, "vllm:kvstore_pd_loaded_blocks") == blocks, counters
        assert _sum(counters, "vllm:kvstore_loaded_blocks") == blocks, counters
        assert _sum(counters, "vllm:kvstore_pd_recomputes") == 0, counters
        # consumers save no prompt block, only blocks generated tokens fill (save_decode; a save
        # that lands after the phase's last step is counted at the next one)
        decode_blocks = sum((len(PROMPTS[n]) + MAX_TOKENS - 1) // BLOCK - _full_blocks(n) for n in names)
        assert _sum(counters, "vllm:kvstore_saved_blocks") <= decode_blocks, counters
        # the proxy took the decoders in turn: both served, D2 through its own daemon's peer fetch
        assert counters["d1"].get("vllm:kvstore_pd_loaded_requests", 0) == len(names) // 2, counters
        assert counters["d2"].get("vllm:kvstore_pd_loaded_requests", 0) == len(names) // 2, counters


def test_prefill_dying_mid_save_costs_a_bounded_wait_and_a_partial_recompute(record):
    assert record["mid_save_deleted"] == 2
    phase = record["mid_save"]
    assert phase["out"]["token_ids"] == record["colocated"]["M"]
    c = phase["counters"]["d1"]
    assert c.get("vllm:kvstore_pd_recomputes_timeout") == 1, c
    assert c.get("vllm:kvstore_pd_recomputed_blocks") == 2, c
    assert c.get("vllm:kvstore_loaded_blocks") == _full_blocks("M") - 2, c    # the leading blocks that did land
    assert WAIT_S <= phase["out"]["seconds"] < WAIT_S + 20


def test_params_of_another_prompt_are_refused_and_the_request_served(record):
    phase = record["refused"]
    assert phase["out"]["token_ids"] == record["colocated"]["S1"]
    c = phase["counters"]["d1"]
    assert c.get("vllm:kvstore_pd_params_refused") == 1 and not c.get("vllm:kvstore_pd_waits"), c


def test_producer_daemon_dead_decode_recomputes_without_waiting(record):
    """P's lookups fail on the dead daemon, so it knows its saves fail: its params name no block
    and mark the prompt's blocks unsaved. Neither decoder waits (D1's own daemon is down too; D2's
    is up but could not fetch from the dead one); both recompute, count why, and answer right."""
    phase = record["daemon_a_dead"]
    for name in ("K1", "K2"):
        assert phase["out"][name]["token_ids"] == record["colocated"][name], name
        assert phase["out"][name]["seconds"] < WAIT_S, name
    for d in ("d1", "d2"):
        c = phase["counters"][d]
        assert c.get("vllm:kvstore_pd_recomputes_unsaved") == 1 and c.get("vllm:kvstore_pd_recomputes") == 1, c
        assert not c.get("vllm:kvstore_pd_waits") and not c.get("vllm:kvstore_pd_wait_seconds"), c
    assert _sum(phase["counters"], "vllm:kvstore_pd_recomputed_blocks") == _full_blocks("K1") + _full_blocks("K2")


def test_proxy_health_check_follows_its_instances(record):
    status, body = record["health_all_up"]
    assert status == 200 and body["prefill_up"] == 1 and body["decode_up"] == 2
    assert record["health_after_kill"][0] == 200     # a dead daemon: the engines still serve
    status, body = record["health_no_prefill"]
    assert status == 503 and body["prefill_up"] == 0 and body["decode_up"] == 2
    assert body["counters"]["requests"] == 11 and body["counters"]["prefill_failures"] == 1


def test_proxy_without_a_prefill_instance_still_answers_right(record):
    assert record["prefill_down"]["token_ids"] == record["colocated"]["S2"]


# -- the rules, without an engine -------------------------------------------------------------------


def test_roles_split_loading_and_saving():
    from kvstore.connectors.vllm.roles import Role
    from kvstore.connectors.vllm.settings import ConnectorSettings

    s = ConnectorSettings()
    producer, consumer, both = (Role.of(r, s) for r in ("kv_producer", "kv_consumer", "kv_both"))
    assert (producer.loads, producer.saves_prompt, producer.saves_decode, producer.is_producer) == (False, True, True, True)
    assert (consumer.loads, consumer.saves_prompt, consumer.saves_decode, consumer.is_producer) == (True, False, True, False)
    assert (both.loads, both.saves_prompt, both.saves_decode) == (True, True, True)
    quiet = Role.of("kv_consumer", ConnectorSettings(save_decode=False))
    assert not quiet.saves
    assert Role.of(None, s) == both
    with pytest.raises(ValueError, match="kv_role"):
        Role.of("kv_sideways", s)


def test_handoff_params_round_trip_and_refuse_what_does_not_match():
    from kvstore.connectors.vllm.handoff import Handoff

    prompt = PROMPTS["S1"]
    hashes = HASHER.chain(prompt, BLOCK)
    ns = bytes(range(16))
    h = Handoff(ns, 6, BLOCK, hashes[5], "127.0.0.1:7373")
    back = Handoff.from_params(h.to_params())
    assert back == h and back.mismatch(ns, BLOCK, hashes) is None
    assert "namespace" in back.mismatch(bytes(16), BLOCK, hashes)
    assert "another prompt" in back.mismatch(ns, BLOCK, HASHER.chain(PROMPTS["S3"], BLOCK))
    assert "tokens" in back.mismatch(ns, 16, hashes)
    assert "full ones" in Handoff(ns, 7, BLOCK, hashes[5]).mismatch(ns, BLOCK, hashes)
    assert Handoff.from_params({"do_remote_decode": True}) is None      # a prefill request's params
    assert Handoff.from_params(None) is None
    for bad, field in (({"blocks": "6"}, "blocks"), ({"last_hash": "zz"}, "last_hash"),
                       ({"blocks": -1}, "blocks"), ({"block_tokens": True}, "block_tokens")):
        params = h.to_params()
        params["kvstore"].update(bad)
        with pytest.raises(ValueError, match=field):
            Handoff.from_params(params)


def test_settings_bound_the_wait():
    from kvstore.connectors.vllm.settings import ConnectorSettings

    assert ConnectorSettings.from_extra_config({"pd_wait_s": "0.5"}).pd_wait_s == 0.5
    with pytest.raises(ValueError, match="pd_wait_s"):
        ConnectorSettings.from_extra_config({"pd_wait_s": 10_000})
    with pytest.raises(ValueError, match="pd_poll_s"):
        ConnectorSettings.from_extra_config({"pd_poll_s": 0})

"""Layer-wise loads from a remote daemon (issue 13 item 2): ``LoadJob.fetch_by_layers`` against a
real daemon over the side channel, in the vLLM venv (no engine; tests/engines/vllm_layer_fetch.py).
Three layers: layer 0 comes alone, then layers 1-2 with a second ranged get. Every planned vLLM
block gets every layer as stored; a block deleted from the daemon between the two gets is a load
error while the others are placed; chunks of two vLLM blocks load by layers alike, the block the
plan marks -1 untouched."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))
import vllm_runner  # noqa: E402


def test_layer_groups_arrive_and_a_block_lost_between_them_is_a_load_error(daemon_factory):
    d = daemon_factory()
    r, _ = vllm_runner.run_script("vllm_layer_fetch.py", d.url)
    blocks, deleted, chunks = r["blocks"], r["deleted"], r["chunks"]
    assert blocks["ranged_gets"] == 2 and blocks["bad"] == [] and blocks["good"] == [0, 2]
    assert blocks["placed"] == {"3": True, "5": True} and blocks["written_elsewhere"] == []
    assert deleted["ranged_gets"] == 2 and deleted["bad"] == [5] and deleted["good"] == [0, 1]
    assert deleted["placed"]["3"] and deleted["placed"]["4"] and not deleted["placed"]["5"]
    assert chunks["bad"] == [] and chunks["placed"] == {"2": True, "6": True, "7": True}
    assert chunks["written_elsewhere"] == []    # source block 0's target (-1) and the rest untouched

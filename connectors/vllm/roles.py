"""What a connector instance does, by vLLM's ``kv_role`` and the ``load``/``save`` settings.

Disaggregated serving splits one request over two engines: a *producer* (prefill) computes the
prompt's KV and saves it, a *consumer* (decode) loads it and generates. Each role does only its
half, so a decode node's cache is not filled with prompts it was handed and a prefill node never
waits on a load for blocks it will compute anyway:

* ``kv_producer``: saves every full prompt block its daemon does not hold yet (and generated
  blocks with ``save_decode``); looks prompts up without a lease only to skip those, never loads.
* ``kv_consumer``: looks up and loads; never saves prompt blocks. With ``save_decode`` it saves the
  blocks its generated tokens fill (the next turn of a conversation hits through them).
* ``kv_both``: both, as a colocated engine.

This module does not import vLLM, so the rules are tested without an engine.
"""

from __future__ import annotations

import dataclasses

from kvstore.connectors.vllm.settings import ConnectorSettings

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclasses.dataclass(frozen=True)
class Role:
    name: str
    loads: bool            # looks prompts up and loads what the daemon holds
    saves_prompt: bool     # saves the prompt's full blocks
    saves_decode: bool     # saves blocks filled by generated tokens

    @property
    def saves(self) -> bool:
        return self.saves_prompt or self.saves_decode

    @property
    def is_producer(self) -> bool:
        """Names the blocks it saves in the finished request's ``kv_transfer_params``."""
        return self.name == "kv_producer"

    @classmethod
    def of(cls, kv_role: str | None, settings: ConnectorSettings) -> "Role":
        name = kv_role or "kv_both"
        if name not in KV_ROLES:
            raise ValueError(f"kv_role: {name!r} is not one of {list(KV_ROLES)}")
        return cls(name=name,
                   loads=settings.load and name != "kv_producer",
                   saves_prompt=settings.save and name != "kv_consumer",
                   saves_decode=settings.save and settings.save_decode)

"""Engine connectors (installed as ``kvstore.connectors``): ``vllm/`` (a vLLM v1 KV connector),
``sglang`` (an SGLang HiCache storage backend) and ``lmcache`` (an LMCache remote-storage plugin).
Each owns the translation between its engine's API and KV layout and a kvstore namespace: naming
the namespace, hashing or adopting the engine's block keys, copying pages in and out. They talk to
the daemon only through ``kvstore.client``'s public API (``Client``, ``NamespaceHandle``,
``CircuitBreaker``) and use the leaves ``kvstore.keys`` and ``kvstore.wire``; they must not import
``kvstore.store``, ``kvstore.service``, ``kvstore.fleet``, ``kvstore.tiers``,
``kvstore.transport``, ``kvstore.ops``, ``kvstore.proto`` or a private module of
``kvstore.client``. Engine packages (vllm, sglang, lmcache) are imported only by the module that
serves that engine, so importing one connector never needs another engine installed.
"""

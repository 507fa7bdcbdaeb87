"""Data-parallel serving: N engine replicas behind one server, each a Ray actor with its own
devices (ReplicatedEngine, EngineReplica), each request routed by prompt-prefix affinity and load
(Router). `zipage-jax serve --data-parallel-size N` and `zipage-jax bench data-parallel` import
it, and with it Ray; the single-process server never does."""

"""Benchmarks (`zipage-jax bench NAME`): each module has add_arguments(parser) and run(args) -> int,
and measures through the public engine API; zipage_jax/harness.py holds what they share with
the evaluations."""

SUBCOMMANDS = {
    "throughput": "requests per second and tokens per second: full KV against compressed, side by side",
    "host": "host time per engine step at batches up to 1,024, against the bare model step; the server's streams "
            "against offline generation",
    "engine": "decode step time and tokens per second of one engine, against transformers",
    "long": "long generations: step time and throughput per window of positions, compressed against full KV",
    "startup": "seconds from import to the first token, cold and warm, with and without warm-up",
    "gpu": "the Pallas kernels and the engine on a GPU, each against its reference",
    "xla-attention": "the XLA decode attention path's time per step",
    "moe": "a mixture-of-experts decode step against one dense MLP of the same active width",
    "data-parallel": "replicas on Ray behind the server: cache-aware routing against round robin, a replica killed "
                     "mid-workload, outputs against one engine's",
    "soak": "mixed traffic against a live server for a bounded time: unexpected errors, greedy answers against "
            "offline, leaked KV blocks, memory growth and latency drift",
    "plot": "the figures in docs/ from the JSON results",
}

"""Cross-checks (`zipage-jax crosscheck NAME`): each module has add_arguments(parser) and
run(args) -> int (the exit status)."""

SUBCOMMANDS = {
    "logits": "this model's logits vs transformers' on the same weights",
    "generate": "batched greedy generation vs transformers' generate",
    "golden": "scoring and compaction vs the reference's golden vectors",
    "tp": "greedy outputs with tensor parallelism vs one device",
}

"""Pure Python: the scheduler and the logical KV cache (pages, tables, prefix cache); no torch."""

"""Prefill/decode disaggregation: prefill workers hand a request's KV pages to decode workers
over NIXL, in vLLM's kv_transfer_params protocol, so vllm-router fronts them unchanged."""

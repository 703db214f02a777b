"""Offline API shaped like vLLM's: `LLM(model).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from frugal.config import CacheConfig, EngineConfig, SchedulerConfig
from frugal.engine.llm_engine import LLMEngine
from frugal.request import RequestOutput, SamplingParams, join
from frugal.tokenizer import Conversation, Tokenizer

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline batches. model None loads the bundled SmolLM2-135M-Instruct GGUF."""

    def __init__(self, model: str | None = None, *, load_format: str = "auto", dtype: str = "auto",
                 device: str = "auto", ops_backend: str = "auto", seed: int = 0,
                 dummy_init: str = "uniform",
                 page_size: int = 16,
                 kv_cache_memory: str | int | float | None = None,
                 gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto",
                 kv_scales_path: str | None = None, calibration_file: str | None = None,
                 kv_cache_max_kl: float | None = None, kv_cache_check: bool = True,
                 max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 quantization: str = "none", num_layers: int | None = None,
                 enable_prefix_caching: bool = True, tensor_parallel_size: int = 1,
                 shared_experts_fusion: bool = True) -> None:
        config = EngineConfig(
            model=model, load_format=load_format, dummy_init=dummy_init, dtype=dtype,
            device=device, ops_backend=ops_backend, seed=seed, enforce_eager=enforce_eager,
            quantization=quantization, num_layers=num_layers,
            tensor_parallel_size=tensor_parallel_size,
            shared_experts_fusion=shared_experts_fusion,
            cache=CacheConfig(page_size=page_size, kv_cache_memory=kv_cache_memory,
                              gpu_memory_utilization=gpu_memory_utilization,
                              kv_cache_dtype=kv_cache_dtype, kv_scales_path=kv_scales_path,
                              calibration_file=calibration_file,
                              kv_cache_max_kl=kv_cache_max_kl,
                              kv_cache_check=kv_cache_check,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len))
        self.engine = LLMEngine(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or {'prompt_token_ids': [...]}).

        Returns one RequestOutput per prompt, in order. Every prompt is validated before any runs.
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [p["prompt_token_ids"] if isinstance(p, dict) else p for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        """Answer one conversation ([{'role', 'content'}, ...]) or a list of them."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat: this model has no tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [tokenizer.encode_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        ids = []
        try:  # all or nothing: a bad prompt withdraws the ones queued before it
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        pending = set(ids)
        joined: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
                while pending:
                    for output in self.engine.step():
                        if output.request_id in pending and join(joined, output).finished:
                            pending.discard(output.request_id)
                            bar.update(1)
        finally:  # an error or Ctrl-C must not leave requests holding pages in the engine
            for request_id in pending:
                self.engine.abort_request(request_id)
        self.engine.check_integrity()
        return [joined[i] for i in ids]

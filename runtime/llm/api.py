"""The offline API, shaped like vLLM's:

from runtime import LLM, SamplingParams
llm = LLM()                                   # SmolLM2-135M-Instruct, float32, on CPU
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from runtime.llm.engine import EngineConfig, LLMEngine
from runtime.llm.outputs import RequestOutput
from runtime.llm.sampling_params import SamplingParams
from runtime.memory import DeviceMemoryManager

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        scheduler: str = "continuous",
        enable_prefix_caching: bool = True,
        device: str | None = None,
        max_model_len: int | None = None,
        policy: str = "fcfs",
        num_kv_blocks: int | None = None,
        cache_dir: str | None = None,
        memory: DeviceMemoryManager | None = None,
        quantization: str | None = None,
        enforce_eager: bool | None = None,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=block_size,
            kv_cache_bytes=kv_cache_bytes,
            num_kv_blocks=num_kv_blocks,
            scheduler=scheduler,
            policy=policy,
            enable_prefix_caching=enable_prefix_caching,
            cache_dir=cache_dir,
            quantization=quantization,
            enforce_eager=enforce_eager,
        )
        self.engine = LLMEngine(config, memory)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order given. Every prompt is
        checked before any is queued, so one bad prompt leaves the engine untouched."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params must be one SamplingParams or one per prompt ({len(prompts)}), got {len(params)}"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        for p in prompts:
            self.engine.tokenize(p)  # raises ValueError before anything is queued
        ids = []
        try:
            for p, sp, prio in zip(prompts, params, priorities):
                ids.append(self.engine.add_request(p, sp, priority=prio))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) > 1)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm, leave=False)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.request_id in wanted and out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                        n = sum(len(o.token_ids) for o in done.values())
                        bar.set_postfix_str(f"{n} tokens")
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: str | list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts, or a string: one user
        message) or several, through the model's chat template."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, (list, tuple)) or not messages or isinstance(messages[0], str):
            raise ValueError(
                "messages must be a string (one user message), a list of {'role', 'content'} dicts "
                f"or a list of such lists, got {type(messages).__name__}"
                + (" of strings" if isinstance(messages, (list, tuple)) and messages else "")
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict]) -> str:
        return self.engine.apply_chat_template(conversation)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs of one request as its text grows (`delta_text`), then the final one."""
        return self.engine.stream(prompt, sampling_params)

"""The offline API, shaped like vLLM's:

from runtime import LLM, SamplingParams
llm = LLM()                                   # SmolLM2-135M-Instruct, float32, on CPU
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from runtime.llm.engine import EngineConfig, LLMEngine
from runtime.llm.outputs import RequestOutput
from runtime.llm.sampling_params import SamplingParams
from runtime.llm.tools import ParsedMessage, ToolCall, ToolFormat, parse_tools, tool_format_for
from runtime.memory import DeviceMemoryManager

Prompt = str | list[int]


@dataclass(slots=True)
class ChatResult:
    """One answer of LLM.chat with tools: the request's output and the message parsed from it.
    Other attributes (token_ids, metrics, ...) are the output's."""

    output: RequestOutput
    message: ParsedMessage

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.message.tool_calls

    @property
    def content(self) -> str | None:
        return self.message.content

    @property
    def text(self) -> str:
        return self.output.text

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's: "tool_calls" when the model ended by calling tools."""
        if self.message.tool_calls and self.output.finish_reason == "stop":
            return "tool_calls"
        return self.output.finish_reason

    def __getattr__(self, name: str):
        return getattr(self.output, name)


def _has_tool_turns(conversation: list[dict]) -> bool:
    return any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in conversation)


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
        speculative_config: dict | None = None,
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
            speculative_config=speculative_config,
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
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        tool_format: str | None = None,
    ) -> list[RequestOutput] | list[ChatResult]:
        """One conversation (a list of {"role", "content"} dicts, or a string: one user
        message) or several, through the model's chat template.

        With `tools` (OpenAI's, with tool_choice and parallel_tool_calls), or with tool turns in
        the conversation (assistant tool_calls, role "tool"), the prompt is the tool format's
        (runtime/llm/tools.py; `tool_format` overrides the template's family), the calls are held
        to the tools' schemas by a grammar, and each answer is a ChatResult whose `tool_calls`
        and `content` are parsed; otherwise RequestOutputs, as without tools."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, (list, tuple)) or not messages or isinstance(messages[0], str):
            raise ValueError(
                "messages must be a string (one user message), a list of {'role', 'content'} dicts "
                f"or a list of such lists, got {type(messages).__name__}"
                + (" of strings" if isinstance(messages, (list, tuple)) and messages else "")
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        request = parse_tools(tools, tool_choice, parallel_tool_calls)
        if request is None and tool_format is None and not any(_has_tool_turns(c) for c in conversations):
            prompts = [self.apply_chat_template(conv) for conv in conversations]
            return self.generate(prompts, sampling_params, use_tqdm)
        fmt = self.tool_format(tool_format)
        prompts = [fmt.render(self.engine.tokenizer, conv, request) for conv in conversations]
        params = self._with_tool_grammar(sampling_params, fmt.structured_outputs(request), len(prompts))
        outs = self.generate(prompts, params, use_tqdm)
        return [ChatResult(out, fmt.parse(out.text, request)) for out in outs]

    def tool_format(self, override: str | None = None) -> ToolFormat:
        """The tool format of this model's chat template (or the one `override` names)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template; use plain prompts")
        return tool_format_for(tokenizer, override)

    @staticmethod
    def _with_tool_grammar(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, spec: dict | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * n
        else:
            params = list(sampling_params)
        if spec is None:
            return params
        out = []
        for sp in params:
            if sp.structured_outputs is not None:
                raise ValueError("structured_outputs cannot be combined with tools: the tool grammar holds the output")
            out.append(dataclasses.replace(sp, structured_outputs=spec))
        return out

    def apply_chat_template(self, conversation: list[dict]) -> str:
        return self.engine.apply_chat_template(conversation)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs of one request as its text grows (`delta_text`), then the final one."""
        return self.engine.stream(prompt, sampling_params)

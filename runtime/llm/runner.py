"""ModelRunner: turns a StepPlan into one forward pass over the paged KV cache, then samples.

It keeps, per running request, the token ids and block table it was sent once (plans are
diffs, as in vLLM v1): a decode step adds only the token it sampled itself and any new
blocks. Block tables live in preallocated numpy rows (runtime/llm/input_batch.py), so a step
reads its decodes' tables, positions and slots with a few vectorized ops and hands them to
torch without copying. It runs the model once, samples all rows at once, and syncs with the
host once, in the final `to_host` (the sampled ids, with the logprobs of the rows that asked).

Rows of requests held to a grammar (structured outputs) get their allowed-token mask: the
engine hands over each such request's matcher (keep_request_data); `_sample` fills the masks
of all the step's constrained rows in one `fill_bitmasks` call into a reusable host buffer and
hands them to the sampler, which masks those rows on the device. Logprobs still read the raw
logits. The matcher advances (accept_token) in runtime/llm/output_processor.py, once the
tokens are on the host.

Attention runs, on CPU, on the C++ kernel that reads the blocks in place
(kernels/cpu_attention.py, "cpp", where it builds) or the torch reference
(kernels/paged_attention.py, "torch"), and on the Triton kernels (kernels/triton_attention.py)
on CUDA. The torch path takes an additive mask and int64 tables; the C++ and Triton kernels
take int32 tables, context lengths and one varlen batch of prefill chunks.

Decode rows (one scheduled token) go first in the flattened batch so that attention can
serve them all with one batched call; prefill chunks follow, one attention call each.

With enforce_eager=False, decode-only steps (every row one token) run a captured graph of the
model instead: on CPU one torch.compile graph (runtime/llm/compiled.py), compiled on a
background thread while steps run eagerly, used once it is ready; on CUDA one CUDA graph per
batch bucket (runtime/llm/cuda_graphs.py), captured at start (runtime/llm/captured_decode.py).
Steps with a prefill chunk, a fork or prompt logprobs stay eager.

Prompt logprobs (runtime/llm/prompt_logprobs.py): the rows of the prompt positions of the
requests that ask follow the sampled rows into the lm_head, and their logprobs come back in the
same host sync. Parallel sampling (plan.forks): a choice forked this step samples from its
parent's last row, and after the forward each gets its copy of the parent's partial last
prompt block (plan.copy_blocks), before anyone writes it.

The runner takes the weights out of `loaded.state_dict` (it empties it unless
release_state_dict=False): the model keeps fused, pre-packed copies, and holding both would
double the weight memory.

Device memory is reserved under one owner instance claimed from the manager ("llm", or
"llm#2" for a second runner on the same device): "<owner>.weights", ".activations",
".kv_scratch" and the KV pool's ".kv_cache"; release_memory() gives all of it back at once.

A newcomer whose data cannot be admitted (`_add_request` raises ValueError: a token id outside the
vocabulary, say) is left out of the step and named in `StepResult.failed`; the others run as
if it had never been planned. If execute() raises, the caller aborts the plan's requests and
calls drop_requests() with their ids. Nothing else needs undoing: a step changes runner state only for requests of its
plan (their block tables, their K/V slots, their sampled tokens, which are appended last,
after the only host sync), and it pops freed ids with a default, so a later plan that frees
an already-dropped id is fine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.paged_attention import decode_mask
from runtime.block_pool import BlockPool
from runtime.llm.cached_request import CachedRequestState, sampling_batch
from runtime.llm.captured_decode import CapturedDecode
from runtime.llm.input_batch import InputBatch
from runtime.llm.loader import DTYPES, LoadedModel
from runtime.llm.model import AttentionMetadata, LlamaModel, ModelSpec, PrefillChunk
from runtime.llm.prompt_logprobs import PromptRows, prompt_rows, split
from runtime.llm.sampler import Sampler, compute_logprobs, compute_prompt_logprobs, to_host
from runtime.llm.sampling_params import GREEDY_EPS
from runtime.llm.spec_verify import accepted_tokens, verify_tensors
from runtime.llm.structured import GrammarCompiler, GrammarMatcher
from runtime.memory import DeviceMemoryManager
from schedulers.plan import StepPlan, StepResult

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("torch", "cpp", "triton")


def _default_backend(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    from kernels import cpu_attention

    return "cpp" if device.type == "cpu" and cpu_attention.available() else "torch"


@dataclass(slots=True)
class RunnerResult(StepResult):
    """StepResult plus what only the engine reads: for each request that asked for logprobs
    and sampled this step, (token ids, logprobs) of the sampled token then its top k; for each
    that asked for prompt logprobs and computed some of its prompt, (position of the first
    prompt token they score, one [token id, top ids...] row per token, the rows' logprobs)."""

    logprobs: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[list[int]], list[list[float]]]] = field(default_factory=dict)


class ModelRunner(CapturedDecode):
    def __init__(
        self,
        loaded: LoadedModel,
        memory: DeviceMemoryManager,
        *,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        dtype: str = "float32",
        device: str = "cpu",
        release_state_dict: bool = True,
        attention_backend: str | None = None,
        quantization: str | None = None,
        enforce_eager: bool = True,
        compile_in_background: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        spec = ModelSpec.from_config(loaded.config)
        limit = getattr(loaded.config, "max_position_embeddings", None)
        if limit and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        if spec.sliding_window and spec.sliding_window < max_model_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's sliding_window={spec.sliding_window}, "
                f"which this runner does not implement; use max_model_len <= {spec.sliding_window}"
            )
        self.spec = spec
        self.device = torch.device(device)
        # Triton kernels on CUDA; on CPU the C++ kernel that reads blocks in place
        # (kernels/cpu_attention.py) where it builds, else the torch reference. Tests run
        # "triton" on CPU under TRITON_INTERPRET=1 to check the runner's metadata for the GPU path.
        self.attention_backend = attention_backend or _default_backend(self.device)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        self.dtype = getattr(torch, dtype)
        self.block_size = block_size
        self.max_model_len = max_model_len
        # An id past the vocabulary (a config may list one) can never be sampled: dropped here,
        # once, rather than refused with every request at admission.
        self.eos_token_ids = [t for t in loaded.eos_token_ids if 0 <= t < spec.vocab_size]
        self.memory = memory
        self.kv_block_bytes = self._kv_block_bytes()
        if num_kv_blocks is None and kv_cache_bytes is not None:
            num_kv_blocks = kv_cache_bytes // self.kv_block_bytes
            if num_kv_blocks < 1:
                raise ValueError(
                    f"kv_cache_bytes={kv_cache_bytes} is smaller than one KV block ({self.kv_block_bytes} bytes)"
                )
        self._max_num_seqs = max_num_seqs
        self.graph = None  # CPU: the torch.compile decode step (runtime/llm/compiled.py)
        self.cuda_graphs = None  # CUDA: one graph per decode batch bucket (runtime/llm/cuda_graphs.py)
        self.memory_owner = owner = memory.claim("llm")
        self._memory_released = False
        try:
            self._load_weights(loaded, release_state_dict, quantization)
            self._size_kv_cache(max_num_batched_tokens, num_kv_blocks, enable_prefix_caching)
            if not enforce_eager and self.device.type == "cuda" and self.attention_backend == "triton":
                self._capture_cuda_graphs()
        except BaseException:
            memory.release(owner)  # a runner that failed to start keeps no name and no bytes
            raise
        if release_state_dict:
            loaded.state_dict = {}  # the model holds (fused copies of) every weight now
        self.sampler = Sampler(spec.vocab_size, self.device)
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, self.pad_block)
        self.requests: dict[str, CachedRequestState] = {}
        # Structured outputs and resumed requests: data that belongs to the request, not to its
        # runner state, kept from add to finish (keep_request_data / forget_request_data). A
        # preempted request is dropped from `requests` and re-admitted with its outputs as
        # prompt, and finds its matcher here, already past those outputs.
        self.grammar_compiler: GrammarCompiler | None = None
        self.grammars: dict[str, GrammarMatcher] = {}
        # How many of a resumed request's prompt tokens are earlier outputs, which min_tokens,
        # the seeds' output index and the penalties count.
        self.num_resumed_outputs: dict[str, int] = {}
        # Requests whose prompt logprobs are not all given yet (empty in the common case: the
        # step then spends nothing on them).
        self.prompt_logprob_ids: set[str] = set()
        self._grammar_mask = None  # host int32 [max_num_seqs, words], made on first use
        self.last_logits: torch.Tensor | None = None  # the last step's logits, for tests and debugging
        self.num_graph_steps = 0  # steps run by the captured graph
        # A captured decode step on CPU, on either CPU attention path.
        if not enforce_eager and self.device.type == "cpu" and self.attention_backend in ("torch", "cpp"):
            self._start_compiled_decode(cache_dir, compile_in_background)

    # ---- start-up steps, in the order __init__ takes them --------------------------------

    def _kv_block_bytes(self) -> int:
        """Bytes of one KV block: K and V of `block_size` tokens in every layer."""
        s = self.spec
        elt = torch.empty((), dtype=self.dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elt

    def _load_weights(self, loaded: LoadedModel, release_state_dict: bool, quantization: str | None) -> None:
        """Build the model from the loaded weights and reserve their bytes."""
        # from_state_dict consumes the dict it is given, tensor by tensor.
        weights = loaded.state_dict if release_state_dict else dict(loaded.state_dict)
        self.model = LlamaModel.from_state_dict(
            self.spec,
            weights,
            self.dtype,
            self.device,
            self.max_model_len,
            batch_hint=self._max_num_seqs,
            quantization=quantization,
            gguf_path=loaded.gguf_path,
        )
        self.memory.reserve(f"{self.memory_owner}.weights", self.model.num_parameter_bytes())

    def _size_kv_cache(self, max_num_batched_tokens: int, num_kv_blocks: int | None, prefix_caching: bool) -> None:
        """Reserve a step's activations and one scratch block, then make the KV pool: exactly
        `num_kv_blocks`, or (None) every block the device budget has left after them. The cache
        tensor holds one block more than the pool, the pad block:

            kv_cache[layer, k|v, block, token in block, kv head, head dim]
            blocks 0 .. n-1: the pool's    block n: pad (never handed out, always zero)
        """
        owner, bytes_per_block = self.memory_owner, self.kv_block_bytes
        self.memory.reserve(f"{owner}.activations", self._activation_bytes(self._max_num_seqs, max_num_batched_tokens))
        self.memory.reserve(f"{owner}.kv_scratch", bytes_per_block)  # before the pool, which may take all the rest
        self.kv_pool: BlockPool = self.memory.create_kv_pool(
            bytes_per_block, self.block_size, num_kv_blocks, prefix_caching, owner=f"{owner}.kv_cache"
        )
        n = self.kv_pool.num_blocks
        # Block n is scratch: the pool never hands it out, so nothing writes it and it
        # stays zero; batched decode pads every block table with it (see
        # kernels/paged_attention.py for why masking alone is not enough).
        self.pad_block = n
        s = self.spec
        shape = (s.num_layers, 2, n + 1, self.block_size, s.num_kv_heads, s.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(s.num_layers)]

    # ---- per-request data the engine hands over --------------------------------------------

    def keep_request_data(
        self,
        request_id: str,
        *,
        grammar: GrammarMatcher | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        num_resumed_outputs: int = 0,
    ) -> None:
        """Hold what belongs to a queued request rather than to its runner state, until
        forget_request_data: its grammar matcher (with the compiler that fills its masks) and
        how many of its prompt's last tokens are its own earlier outputs."""
        if grammar is not None:
            self.grammar_compiler = grammar_compiler
            self.grammars[request_id] = grammar
        if num_resumed_outputs:
            self.num_resumed_outputs[request_id] = num_resumed_outputs

    def forget_request_data(self, request_id: str) -> None:
        """The request ended: drop what keep_request_data held (unknown ids are fine)."""
        self.grammars.pop(request_id, None)
        self.num_resumed_outputs.pop(request_id, None)

    def release_memory(self) -> None:
        """Give back every byte reserved for this runner and drop the tensors they paid for
        (the runner cannot execute afterwards). Idempotent: a second call must not release
        the reservations of a newer runner that claimed the same owner name since."""
        if self._memory_released:
            return
        self._memory_released = True
        self.memory.release(self.memory_owner)
        self.model = None
        if self.graph is not None:
            self.graph.close()
        self.graph = None
        self.cuda_graphs = None
        self.kv_cache = None
        self.kv_caches = []
        self.last_logits = None
        self.requests.clear()
        self.sampler.penalties.clear()

    def drop_requests(self, request_ids: Iterable[str]) -> None:
        """Forget the state of `request_ids` (unknown ids are fine): the engine's cleanup after
        an execute() that raised, once it has aborted those requests in the scheduler."""
        requests = self.requests
        for rid in request_ids:
            requests.pop(rid, None)
            self.batch.remove(rid)
            self.sampler.penalties.remove(rid)
            self.prompt_logprob_ids.discard(rid)

    def _activation_bytes(self, max_num_seqs: int, max_tokens: int) -> int:
        """An upper estimate of one step's temporaries, so the KV pool leaves room for them."""
        s = self.spec
        elt = torch.empty((), dtype=self.dtype).element_size()
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        per_token = (4 * s.hidden_size + 2 * qkv + s.num_heads * s.head_dim + 3 * s.intermediate_size) * elt
        per_token += 2 * s.hidden_size * 4  # RMSNorm's float32 copies
        # The torch reference's batched decode gathers K and V of every sequence, padded to the
        # longest context.
        kv_gather = 2 * max_num_seqs * self.max_model_len * s.num_kv_heads * s.head_dim * elt
        if self.attention_backend != "torch":  # the C++ and Triton kernels read blocks in place
            kv_gather = 0
        scores = s.num_heads * max_tokens * min(self.max_model_len, 1024) * 4
        logits = 4 * max_num_seqs * s.vocab_size * 4  # logits, probabilities, masked copy, cdf (float32)
        return max_tokens * per_token + kv_gather + scores + logits

    # ---- one step ------------------------------------------------------------------------

    def _add_request(self, nr, fresh: list[int]) -> None:
        """Take a newcomer's data into runner state. Everything of it that will index a tensor
        (its token ids, its stop ids) is checked here, so that bad data fails this request at
        admission (ValueError) and never the batched forward or sampler of everyone else."""
        sp = nr.sampling
        eos = [] if sp is not None and sp.ignore_eos else self.eos_token_ids
        stop_ids = list(dict.fromkeys(eos + (list(sp.stop_token_ids) if sp is not None else [])))
        vocab = self.spec.vocab_size
        for name, ids in (("token_ids", nr.token_ids), ("stop_token_ids", stop_ids)):
            if ids and not (0 <= min(ids) and max(ids) < vocab):
                raise ValueError(
                    f"{name} must be token ids in [0, {vocab}), got {[t for t in ids if not 0 <= t < vocab][:4]!r}"
                )
        num_prompt = nr.num_prompt_tokens - self.num_resumed_outputs.get(nr.request_id, 0)
        self.requests[nr.request_id] = CachedRequestState(
            token_ids=list(nr.token_ids),
            block_ids=list(nr.block_ids),
            num_prompt_tokens=num_prompt,
            # Below vLLM's epsilon a temperature is greedy (1/T would overflow float32).
            temperature=float(sp.temperature) if sp is not None and sp.temperature >= GREEDY_EPS else 0.0,
            top_k=sp.top_k if sp is not None else 0,
            top_p=float(sp.top_p) if sp is not None else 1.0,
            seed=sp.seed if sp is not None else None,
            min_tokens=sp.min_tokens if sp is not None else 0,
            stop_ids=stop_ids,
            penalized=sp is not None and sp.has_penalties,
            min_p=float(sp.min_p) if sp is not None else 0.0,
            num_logprobs=sp.logprobs if sp is not None else None,
            grammar=self.grammars.get(nr.request_id),
        )
        # Only a first pass over the prompt gives prompt logprobs: a request that holds outputs
        # already gave them before it was preempted.
        if sp is not None and sp.prompt_logprobs is not None and len(nr.token_ids) == nr.num_prompt_tokens:
            self.requests[nr.request_id].num_prompt_logprobs = sp.prompt_logprobs
            self.prompt_logprob_ids.add(nr.request_id)
        if sp is not None and sp.structured_outputs is not None and self.requests[nr.request_id].grammar is None:
            raise ValueError("structured_outputs: no grammar matcher was registered for this request")
        self.batch.add(nr.request_id, nr.block_ids)
        # Blocks past the prefix-cache hit are new to this request: zero them (see execute).
        fresh.extend(nr.block_ids[-(-nr.num_computed_tokens // self.block_size) :])
        if sp is not None and sp.has_penalties:
            self.sampler.penalties.add(
                nr.request_id,
                list(nr.token_ids),
                num_prompt,
                sp.repetition_penalty,
                sp.presence_penalty,
                sp.frequency_penalty,
            )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerResult:
        if self._memory_released:
            raise RuntimeError("this runner has released its memory (release_memory) and cannot execute")
        requests, batch = self.requests, self.batch
        if plan.freed_req_ids:
            self.drop_requests(plan.freed_req_ids)
        for rid, keep in plan.trimmed_block_ids.items():  # speculation's rolled-back blocks
            st = requests.get(rid)
            if st is not None:
                del st.block_ids[keep:]
                batch.trim_blocks(batch.row_of[rid], keep)
        fresh: list[int] = []  # blocks handed to a request this step
        failed: dict[str, str] = {}  # newcomers refused at admission: left out of this step
        for nr in plan.new_requests:
            try:
                self._add_request(nr, fresh)
            except ValueError as exc:  # one request's bad data fails that request alone
                self.drop_requests([nr.request_id])
                failed[nr.request_id] = str(exc)
        if not plan.req_ids:
            self._zero_blocks(fresh)
            return RunnerResult(sampled_token_ids=[], failed=failed)

        bs = self.block_size
        states = [requests.get(rid) for rid in plan.req_ids]  # None: refused at admission
        decodes: list[int] = []
        prefills: list[int] = []
        for i, (rid, st) in enumerate(zip(plan.req_ids, states)):
            if st is None:
                continue
            new_blocks = plan.new_block_ids.get(rid)
            if new_blocks:
                st.block_ids.extend(new_blocks)
                batch.append_blocks(batch.row_of[rid], new_blocks)
                fresh.extend(new_blocks)
            n = plan.num_scheduled_tokens[i]
            if n == 1:
                decodes.append(i)
            elif n > 1:
                prefills.append(i)
        # The unwritten tail of a request's last block is read (and masked) by batched decode;
        # zeroing each block as it is handed out keeps another request's stale K/V out of it.
        self._zero_blocks(fresh)
        # Forks and prompt logprobs need rows the captured graphs do not give: those steps
        # (rare: one per n > 1 request, the prefill of a scored prompt) run eagerly.
        if decodes and not prefills and not plan.forks and not self.prompt_logprob_ids:
            if self.cuda_graphs is not None:
                return self._execute_cuda_graph(plan, states, decodes, failed)
            if self._graph_ready():
                result = self._execute_graph(plan, states, decodes, failed)
                if result is not None:
                    return result  # else the graph failed and is dropped: this step runs eagerly

        ids: list[int] = []
        row_of_last: dict[int, int] = {}  # plan index -> row of its last token in the batch
        meta = AttentionMetadata(slot_mapping=torch.empty(0), backend=self.attention_backend, num_decodes=len(decodes))
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        # Both kernels take int32 tables, context lengths and one varlen batch of prefill chunks.
        varlen = self.attention_backend in ("triton", "cpp")
        dev = self.device
        if decodes:
            num_computed = plan.num_computed_tokens
            dec_pos = np.fromiter((num_computed[i] for i in decodes), dtype=np.int64, count=len(decodes))
            rows = np.fromiter((batch.row_of[plan.req_ids[i]] for i in decodes), dtype=np.int64, count=len(decodes))
            for k, i in enumerate(decodes):
                row_of_last[i] = k
                ids.append(states[i].token_ids[num_computed[i]])
            dec_slots, tables = batch.decode_inputs(rows, dec_pos)
            ctx = torch.from_numpy(dec_pos + 1)
            if varlen:
                meta.decode_block_tables = torch.from_numpy(tables.astype(np.int32)).to(dev, non_blocking=True)
                meta.decode_context_lens = ctx.to(dev, torch.int32, non_blocking=True)
                if self.attention_backend == "cpp":
                    meta.decode_cu_q_lens = torch.arange(len(decodes) + 1, dtype=torch.int32)
            else:
                meta.decode_block_tables = torch.from_numpy(tables)
                meta.decode_mask = decode_mask(ctx, tables.shape[1] * bs, self.dtype)
            pos_parts.append(dec_pos)
            slot_parts.append(dec_slots)
        chunk_tables: list[np.ndarray] = []
        spec = plan.spec_token_ids
        for i in prefills:
            st, start, n = states[i], plan.num_computed_tokens[i], plan.num_scheduled_tokens[i]
            end = start + n
            drafts = spec.get(plan.req_ids[i]) if spec else None
            # A decode verifying drafts: its last token, then the drafts (not its tokens yet).
            known = start + 1 if drafts is not None else end
            if known > len(st.token_ids) or (drafts is not None and len(drafts) != n - 1):
                raise RuntimeError(
                    f"plan schedules tokens [{start}, {end}) of request {plan.req_ids[i]!r}, which has {len(st.token_ids)}"
                )
            row = len(ids)
            ids.extend(st.token_ids[start:end] if drafts is None else [st.token_ids[start], *drafts])
            row_of_last[i] = row + n - 1
            table = batch.block_table[batch.row_of[plan.req_ids[i]], : -(-end // bs)]
            pos = np.arange(start, end, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            chunk_tables.append(table)
            blocks = torch.from_numpy(table.copy()) if start > 0 and not varlen else None
            meta.prefills.append(PrefillChunk(row, n, start, blocks))
        if varlen and prefills:
            width = max(len(t) for t in chunk_tables)
            padded = np.full((len(prefills), width), self.pad_block, dtype=np.int32)
            for k, t in enumerate(chunk_tables):
                padded[k, : len(t)] = t
            q_lens = [plan.num_scheduled_tokens[i] for i in prefills]
            meta.prefill_max_q_len = max(q_lens)
            meta.prefill_block_tables = torch.from_numpy(padded).to(dev, non_blocking=True)
            meta.prefill_cu_q_lens = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32).to(dev)
            meta.prefill_context_lens = torch.tensor(
                [plan.num_computed_tokens[i] + q for i, q in zip(prefills, q_lens)], dtype=torch.int32
            ).to(dev)

        if not ids:  # every planned request had zero tokens scheduled, or was refused
            return RunnerResult(sampled_token_ids=[[] for _ in plan.req_ids], failed=failed)
        if plan.forks:  # a forked choice samples from its parent's last row
            where = {rid: i for i, rid in enumerate(plan.req_ids)}
            for child, parent in plan.forks.items():
                i, j = where[child], where[parent]
                if states[i] is not None and j in row_of_last:
                    row_of_last[i] = row_of_last[j]
        sample_idx = [i for i, s in enumerate(plan.sample) if s and i in row_of_last]
        spec_idx: list[int] = []  # requests verifying drafts: every row of their chunk is scored
        if spec:
            spec_idx = [i for i in sample_idx if plan.req_ids[i] in spec]
            sample_idx = [i for i in sample_idx if plan.req_ids[i] not in spec]
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        positions = torch.from_numpy(np.concatenate(pos_parts) if len(pos_parts) > 1 else pos_parts[0]).to(dev)
        meta.slot_mapping = torch.from_numpy(np.concatenate(slot_parts) if len(slot_parts) > 1 else slot_parts[0]).to(
            dev
        )
        rows = [row_of_last[i] for i in sample_idx]
        for i in spec_idx:
            last = row_of_last[i]
            rows += range(last - len(spec[plan.req_ids[i]]), last + 1)
        num_spec_rows = len(rows) - len(sample_idx)
        prompt = prompt_rows(self.prompt_logprob_ids, plan, states, row_of_last) if self.prompt_logprob_ids else None
        if prompt is not None:  # the prompt positions' rows follow the sampled ones
            rows += prompt.rows
        rows_t = torch.tensor(rows, dtype=torch.long).to(dev) if rows else None
        logits = self.model(input_ids, positions, meta, self.kv_caches, rows_t)
        if plan.copy_blocks:  # after the forward, which wrote the parents' last prompt tokens
            self._copy_blocks(plan.copy_blocks)
        prompt_logits = spec_logits = None
        if spec_idx:
            n = len(sample_idx)
            spec_logits = logits[n : n + num_spec_rows]
            logits, prompt_logits = (logits[:n] if n else None), logits[n + num_spec_rows :]
        elif prompt is not None:
            logits, prompt_logits = (logits[: len(sample_idx)] if sample_idx else None), logits[len(sample_idx) :]
        self.last_logits = logits

        verify = None
        if spec_idx:  # speculation's verification: device tensors read in the step's one sync
            drafts = [spec[plan.req_ids[i]] for i in spec_idx]
            verify = (
                spec_idx,
                drafts,
                *verify_tensors(self.sampler, spec_logits, [states[i] for i in spec_idx], drafts),
            )
        return self._sample(plan, states, sample_idx, logits, failed, prompt, prompt_logits, verify)

    def _sample(
        self,
        plan: StepPlan,
        states,
        sample_idx: list[int],
        logits,
        failed: dict[str, str],
        prompt: PromptRows | None = None,
        prompt_logits=None,
        verify=None,
    ) -> RunnerResult:
        out: list[list[int]] = [[] for _ in plan.req_ids]
        extra = ()  # prompt logprobs' and verification's device tensors, fetched in the step's one sync
        if prompt is not None:
            pl = compute_prompt_logprobs(prompt_logits, prompt.targets, prompt.k)
            extra = (pl.token_ids, pl.logprobs)
        if verify is not None:
            extra += verify[2:]
        if logits is None:
            result = RunnerResult(sampled_token_ids=out, failed=failed)
            if extra:
                self._take_extra(result, states, prompt, verify, to_host(*extra))
            return result
        sampled = [states[i] for i in sample_idx]
        sbatch = sampling_batch(sampled, [plan.req_ids[i] for i in sample_idx])
        # No constrained request anywhere (the common case): not even a scan of the rows.
        grammar_rows = [row for row, st in enumerate(sampled) if st.grammar is not None] if self.grammars else []
        if grammar_rows:
            # The masks are filled here, after the forward is launched and before the sampler:
            # on CUDA the forward's kernels are queued asynchronously and still running when the
            # host gets here (unless something in the forward synced), so the fill overlaps them
            # (not yet measured on a GPU); on CPU the forward is synchronous and the fill simply
            # precedes sampling (0.3 ms for one JSON row, benchmarks/structured.py). One
            # fill_bitmasks call for every constrained row of the step (llguidance's native
            # threads, without the GIL). The buffer's previous contents are no longer read: the
            # last step's to_host synced after its copy to the device.
            mask = self._grammar_bitmask(len(grammar_rows))
            self.grammar_compiler.fill_bitmasks([(sampled[r].grammar, k) for k, r in enumerate(grammar_rows)], mask)
            sbatch.grammar_rows, sbatch.grammar_mask = grammar_rows, mask
        tokens_t = self.sampler(logits, sbatch)
        logprobs: dict[str, tuple[list[int], list[float]]] = {}
        if sbatch.logprobs:
            lp = compute_logprobs(logits, tokens_t, sbatch.logprobs)
            tokens, lp_ids, lp_vals, *host = to_host(tokens_t, lp.token_ids, lp.logprobs, *extra)
            for (row, k), ids, vals in zip(sbatch.logprobs, lp_ids, lp_vals):
                logprobs[plan.req_ids[sample_idx[row]]] = (ids[: k + 1], vals[: k + 1])
        else:
            tokens, *host = to_host(tokens_t, *extra)
        for i, tok in zip(sample_idx, tokens):
            states[i].token_ids.append(tok)
            out[i] = [tok]
        result = RunnerResult(sampled_token_ids=out, failed=failed, logprobs=logprobs)
        if host:
            self._take_extra(result, states, prompt, verify, host)
        return result

    @staticmethod
    def _take_extra(result: RunnerResult, states, prompt: PromptRows | None, verify, host: list) -> None:
        """The host copies of the step's extra tensors: prompt logprobs, then verification."""
        if prompt is not None:
            result.prompt_logprobs = split(prompt, *host[:2])
            host = host[2:]
        if verify is not None:
            spec_idx, drafts = verify[0], verify[1]
            for i, tokens in zip(spec_idx, accepted_tokens(host[0], host[1], drafts)):
                states[i].token_ids.extend(tokens)
                result.sampled_token_ids[i] = tokens

    def _grammar_bitmask(self, rows: int):
        mask = self._grammar_mask
        if mask is None or mask.shape[0] < rows:
            mask = self._grammar_mask = self.grammar_compiler.allocate_bitmask(max(rows, self._max_num_seqs))
        return mask

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) KV block, every layer's K and V."""
        dev = self.device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long).to(dev)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long).to(dev)
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))

    def _zero_blocks(self, block_ids: list[int]) -> None:
        if block_ids:
            idx = torch.tensor(block_ids, dtype=torch.long).to(self.device)
            self.kv_cache.index_fill_(2, idx, 0)

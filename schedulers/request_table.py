"""Mechanics shared by the LLM schedulers: admission checks, KV blocks per request, writing a
request into a plan, and applying a runner's result (new tokens, stop checks, freeing).

The schedulers decide *who* runs; this table does the bookkeeping the same way for both, so
the continuous and static schedulers differ only in policy.
"""

from __future__ import annotations

from schedulers.interface import BlockAllocator
from schedulers.plan import NewRequestData, StepOutputs, StepPlan, StepResult
from schedulers.request import Request, RequestStatus


class RequestTable:
    def __init__(self, pool: BlockAllocator, max_model_len: int) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_model_len = max_model_len
        self.caching = pool.enable_prefix_caching
        self.requests: dict[str, Request] = {}  # every request not yet finished
        self._freed: list[str] = []  # runner state to drop, sent with the next plan
        self.num_preemptions = 0
        # Prompt tokens whose KV a step computed: prefix-cache hits and forked choices' shared
        # prompts are not counted; a recompute after preemption is.
        self.num_computed_prompt_tokens = 0
        # Speculative decoding: block tables cut back by apply (request id -> blocks kept), for
        # the next plan; and (request id, drafted, accepted) of this step's verifications.
        self.trims: dict[str, int] = {}
        self.verified: list[tuple[str, int, int]] = []
        # Unfinished requests of the batch tier (the scheduler looks for batch victims only then).
        self.num_batch = 0
        # policy="fair": told of every request's arrival, start, stop and leaving (schedulers/fair.py).
        self.tenants = None

    # ---- admission -------------------------------------------------------------------------

    def validate(self, req: Request) -> None:
        """Raise ValueError if `req` (with its followers) can never run; called before it is queued."""
        group = [req, *req.followers]
        ids = [r.request_id for r in group]
        for rid in ids:
            if rid in self.requests or ids.count(rid) > 1:
                raise ValueError(f"request_id {rid!r} is already in use")
        n = req.num_prompt_tokens
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, but max_model_len is {self.max_model_len}: "
                f"the prompt must be shorter than max_model_len to generate anything"
            )
        for r in group:
            r.max_len = min(r.max_len, self.max_model_len)
        total = max(r.max_len for r in group)
        # The choices share the prompt's full blocks; each holds the rest of its tokens alone.
        shared = n // self.block_size
        need = shared + len(group) * (-(-total // self.block_size) - shared)
        if need > self.pool.num_blocks:
            choices = f" for its {len(group)} choices" if len(group) > 1 else ""
            raise ValueError(
                f"request {req.request_id!r} needs up to {need} KV blocks{choices} ({total} tokens of "
                f"block_size {self.block_size}), but the whole pool has {self.pool.num_blocks}: "
                f"lower max_tokens or give the KV cache more memory"
            )

    def admit(self, req: Request, budget: int) -> int:
        """Give a waiting request its blocks (reusing cached prefix blocks); return the number
        of tokens it computes this step, or 0 if the pool cannot hold them now."""
        pool, bs = self.pool, self.block_size
        cached: list[int] = []
        if self.caching and not req.skip_prefix_cache:
            pool.extend_block_hashes(req.token_ids, req.block_hashes)
            # At least one token must be computed, to have logits to sample from.
            usable = (req.num_tokens - 1) // bs
            cached = pool.find_cached_prefix(req.block_hashes[:usable], req.token_ids)
        num_computed = len(cached) * bs
        num_new = min(req.num_tokens - num_computed, budget)
        need = -(-(num_computed + num_new) // bs) - len(cached)
        tails = len(req.followers) if req.num_tokens % bs else 0
        if need + tails + pool.num_evictable(cached) > pool.num_free_blocks:
            return 0
        pool.touch(cached)
        new = pool.allocate(need + tails)
        assert new is not None  # checked just above
        req.block_ids = cached + new[:need]
        req.fork_tails = new[need:]
        req.num_computed_tokens = num_computed
        req.num_cached_tokens = num_computed
        req.num_published_blocks = len(cached)
        req.next_publish_at = (len(cached) + 1) * bs
        req.status = RequestStatus.RUNNING
        if self.tenants is not None:
            self.tenants.started(req.tenant)
        return num_new

    def grow(self, req: Request, num_new: int) -> list[int] | None:
        """Blocks appended so `req` can hold `num_new` more tokens ([] if none were needed),
        or None if the pool is out of blocks (the caller preempts)."""
        need = (req.num_computed_tokens + num_new + self.block_size - 1) // self.block_size - len(req.block_ids)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        if new is not None:
            req.block_ids.extend(new)
        return new

    def fork(self, leader: Request) -> list[tuple[Request, int | None]]:
        """Start the leader's followers from its prompt, as computed by the end of this step:
        each takes a reference on the prompt's full blocks and, when the prompt ends inside a
        block, one of the leader's `fork_tails`, which the runner fills with a copy of the
        leader's last block (copy on write: every choice writes its first tokens there).
        Returns each follower, running now with nothing left to compute before it samples,
        with the block its tail copies (None: no tail)."""
        followers, leader.followers = leader.followers, []
        tails, leader.fork_tails = leader.fork_tails, []
        num_full = leader.num_tokens // self.block_size
        shared = leader.block_ids[:num_full]
        source = leader.block_ids[num_full] if tails else None
        for k, f in enumerate(followers):
            self.pool.share(shared)
            f.block_ids = shared + tails[k : k + 1]
            f.num_computed_tokens = leader.num_tokens
            f.block_hashes = list(leader.block_hashes)
            f.num_published_blocks = leader.num_published_blocks
            f.next_publish_at = leader.next_publish_at
            f.leader = None
            f.status = RequestStatus.RUNNING
            f.needs_full_state = True
            f.num_charged_prompt_tokens = f.num_prompt_tokens  # the leader's prompt, paid once
            if self.tenants is not None:
                self.tenants.started(f.tenant)
        return [(f, source) for f in followers]

    def detach_follower(self, req: Request) -> Request:
        """A follower leaves before its fork (an abort): its leader forks the others only, and
        gives back the block it held for this one. Returns the leader."""
        leader, req.leader = req.leader, None
        leader.followers.remove(req)
        if leader.fork_tails:
            self.pool.free([leader.fork_tails.pop()])
        return leader

    def hand_over(self, leader: Request) -> Request | None:
        """A leader leaves before its fork: the first follower takes over the rest, and the
        prefill, from scratch (None: it had no followers)."""
        self._free_tails(leader)
        if not leader.followers:
            return None
        heir, *rest = leader.followers
        leader.followers = []
        heir.leader = None
        heir.followers = rest
        for f in rest:
            f.leader = heir
        return heir

    # ---- leaving ---------------------------------------------------------------------------

    def register(self, req: Request) -> None:
        """Know a validated request and its followers by id (they are queued by the caller)."""
        for r in (req, *req.followers):
            r.leader = req if r is not req else None
            self.requests[r.request_id] = r
            if r.is_batch:
                self.num_batch += 1
            if self.tenants is not None:
                self.tenants.arrive(r.tenant)

    def preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the KV cache, keep the tokens, start over later."""
        if self.tenants is not None and req.status is RequestStatus.RUNNING:
            self.tenants.stopped(req.tenant)
        self.pool.free(req.block_ids)
        req.block_ids = []
        self._free_tails(req)
        req.num_computed_tokens = 0
        req.num_published_blocks = 0
        req.status = RequestStatus.PREEMPTED
        req.needs_full_state = True
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._freed.append(req.request_id)
        self.trims.pop(req.request_id, None)  # re-sent in full when it runs again

    def finish(self, req: Request, status: RequestStatus) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        self._free_tails(req)
        if not req.needs_full_state:  # the runner has state for it
            self._freed.append(req.request_id)
        if self.requests.pop(req.request_id, None) is not None:
            if req.is_batch:
                self.num_batch -= 1
            if self.tenants is not None:
                if req.status is RequestStatus.RUNNING:
                    self.tenants.stopped(req.tenant)
                self.tenants.leave(req.tenant)
        req.status = status
        self.trims.pop(req.request_id, None)

    def _free_tails(self, req: Request) -> None:
        if req.fork_tails:
            self.pool.free(req.fork_tails)
            req.fork_tails = []

    def take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    # ---- plans and results -----------------------------------------------------------------

    def add_to_plan(self, plan: StepPlan, req: Request, num_new: int) -> None:
        computed = req.num_computed_tokens
        plan.req_ids.append(req.request_id)
        plan.num_scheduled_tokens.append(num_new)
        plan.num_computed_tokens.append(computed)
        # A request with max_tokens=0 (scoring its prompt) reaches its max_len with its prompt:
        # nothing to sample.
        plan.sample.append(computed + num_new >= len(req.token_ids) and len(req.token_ids) < req.max_len)
        if req.needs_full_state:
            plan.new_requests.append(
                NewRequestData(
                    req.request_id,
                    list(req.token_ids),
                    list(req.block_ids),
                    computed,
                    req.num_prompt_tokens,
                    req.sampling,
                )
            )
            req.needs_full_state = False

    def apply(self, plan: StepPlan, reqs: list[Request], result: StepResult, out: StepOutputs) -> None:
        """Advance every planned request (`reqs`, in plan order) by the runner's result and
        record finishes in `out`. The hot loop of a step: kept to plain compares and appends."""
        caching = self.caching
        running = RequestStatus.RUNNING
        spec = plan.spec_token_ids
        prompt_tokens = 0
        for req, num_new, tokens in zip(reqs, plan.num_scheduled_tokens, result.sampled_token_ids):
            if req.status is not running:  # aborted or preempted since the plan was made
                continue
            if spec and tokens and req.request_id in spec:
                self._apply_verified(req, spec[req.request_id], tokens, out)
                continue
            start = req.num_computed_tokens
            computed = req.num_computed_tokens = start + num_new
            if start < req.num_prompt_tokens:  # [start, computed) holds prompt tokens
                prompt_tokens += min(computed, req.num_prompt_tokens) - start
            if caching and computed >= req.next_publish_at:
                self._publish(req)
            if not tokens:
                # Past max_len only with nothing to sample: a request with max_tokens=0 whose
                # prompt is computed (a running one always holds fewer tokens than max_len).
                if computed >= req.max_len:
                    self.finish(req, RequestStatus.FINISHED_LENGTH)
                    out.finished[req.request_id] = "length"
                continue
            token_ids = req.token_ids
            token_ids.extend(tokens)
            n = len(token_ids)
            if n >= req.max_len:
                self.finish(req, RequestStatus.FINISHED_LENGTH)
                out.finished[req.request_id] = "length"
            elif tokens[-1] in req.stop_token_ids and n >= req.min_len:
                self.finish(req, RequestStatus.FINISHED_STOPPED)
                out.finished[req.request_id] = "stop"
        self.num_computed_prompt_tokens += prompt_tokens

    def _apply_verified(self, req: Request, drafts: list[int], tokens: list[int], out: StepOutputs) -> None:
        """A decode that verified `drafts`: `tokens` are the accepted drafts and one token of the
        runner's own. Only the accepted drafts' K/V stands (the last token's and theirs); the
        rejected ones' slots are free again, and blocks they alone held go back to the pool.
        Several tokens arrive at once, so the stop checks run over each, in order, and cut
        `tokens` (the list the engine streams) where the request ends."""
        self.verified.append((req.request_id, len(drafts), len(tokens) - 1))
        computed = req.num_computed_tokens = req.num_computed_tokens + len(tokens)
        token_ids = req.token_ids
        before = len(token_ids)
        for j, tok in enumerate(tokens):
            n = before + j + 1
            if n >= req.max_len or (tok in req.stop_token_ids and n >= req.min_len):
                del tokens[j + 1 :]
                token_ids.extend(tokens)
                status = RequestStatus.FINISHED_LENGTH if n >= req.max_len else RequestStatus.FINISHED_STOPPED
                self.finish(req, status)
                out.finished[req.request_id] = "length" if n >= req.max_len else "stop"
                return
        token_ids.extend(tokens)
        if self.caching and computed >= req.next_publish_at:  # accepted tokens only: computed counts no rejected draft
            self._publish(req)
        keep = computed // self.block_size + 1  # through the block the next token's K/V goes in
        if len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:])
            del req.block_ids[keep:]
            self.trims[req.request_id] = keep

    def _publish(self, req: Request) -> None:
        """Enter the request's newly computed full blocks in the prefix cache."""
        upto = req.num_computed_tokens // self.block_size
        self.pool.publish_blocks(req.token_ids, req.block_ids, req.block_hashes, req.num_published_blocks, upto)
        req.num_published_blocks = upto
        req.next_publish_at = (upto + 1) * self.block_size

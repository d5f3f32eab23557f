"""The job state machine, as Lua scripts Redis runs atomically. Every transition of a job is
one script, so a client, a worker and a reaper racing on one job see it in one state.

Keys (P = "tandem:"):

    P job:{id}           hash: task, queue, digest, message, state, attempt, owner, token, seq,
                         ttl, timestamps, num_tokens (n > 1: and num_tokens.<k> per choice),
                         num_appended, max_tokens, prompt_token_ids, error
    P events:{id}        stream: the job's events (workers/events.py)
    P end:{id}           stream: one entry once the job is final, with its result or error
                         (what result() blocks on: it returns whenever it is called)
    P queued:{queue}     zset: queued job ids by submission order (queue positions)
    P running            zset: claimed job ids (what the reaper checks)
    P worker:{id}        string with a TTL: the worker's lease, "end:<t>" (its end, on the
                         writer's clock), renewed by its heartbeat; an older release's value
                         (its beat time) is alive while the key exists
    P seq                counter: submission order
    <queue>[sep<step>]   Kombu's broker lists (message.py): a job's Celery message is pushed
                         by the same script that records or requeues the job

    queued --claim--> running --finish--> done | failed | cancelled
       ^                 |
       +----reap---------+   (the owner's lease expired: run again elsewhere)

`token` is unique per claim and fences writes: a worker that lost its claim (it stalled past
its lease and the job moved on) cannot add events or a result any more.
"""

from __future__ import annotations

# Shared helpers, prepended to every script.
_PRELUDE = r"""
local P = ARGV[1]
local function jobkey(id) return P .. 'job:' .. id end
local function eventskey(id) return P .. 'events:' .. id end
local function endkey(id) return P .. 'end:' .. id end
local function terminal(state) return state == 'done' or state == 'failed' or state == 'cancelled' end

-- A worker's lease is live while its key exists (Redis expires it lease_s after the last beat)
-- and the end it holds is after `now`. The end is on the callers' clock, as `now` is: that is
-- what lets a test move time on without waiting (tests/test_leases.py). Between machines it
-- asks only that their clocks agree to well within lease_s - heartbeat_s (8 s by default).
local function alive(worker, now)
  if not worker or worker == '' then return false end
  local v = redis.call('GET', P .. 'worker:' .. worker)
  if not v then return false end
  -- 'end:<t>': the lease's end on the writer's clock. Anything else is an older worker's key
  -- (its beat time): alive while it exists, its TTL the lease, as those workers' scripts read it.
  if string.sub(v, 1, 4) ~= 'end:' then return true end
  local ends = tonumber(string.sub(v, 5))
  return ends ~= nil and ends > tonumber(now)
end

-- stop: the JSON of the stop string or token id that ended a generation ('' or nil: none).
local function close_job(id, state, result, err, reason, now, maxlen, by, text, stop)
  local job = jobkey(id)
  local q = redis.call('HGET', job, 'queue') or ''
  local n = redis.call('HGET', job, 'num_tokens') or '0'
  redis.call('HSET', job, 'state', state, 'error', err, 'finish_reason', reason,
             'finished_at', now, 'owner', '', 'finished_by', by)
  redis.call('HDEL', job, 'message')
  local fields = {'type', state, 'token_ids', '[]', 'text', text, 'finish_reason', reason, 'error', err,
                  'num_tokens', n}
  if stop and stop ~= '' then
    table.insert(fields, 'stop_reason')
    table.insert(fields, stop)
  end
  redis.call('XADD', eventskey(id), 'MAXLEN', '~', maxlen, '*', unpack(fields))
  redis.call('XADD', endkey(id), '*', 'state', state, 'result', result, 'error', err)
  redis.call('ZREM', P .. 'running', id)
  redis.call('ZREM', P .. 'queued:' .. q, id)
  local ttl = tonumber(redis.call('HGET', job, 'ttl') or '86400')
  redis.call('EXPIRE', job, ttl)
  redis.call('EXPIRE', eventskey(id), ttl)
  redis.call('EXPIRE', endkey(id), ttl)
end

local function create_job(id, task, queue, digest, message, submitted_at, ttl, max_tokens)
  local seq = redis.call('INCR', P .. 'seq')
  redis.call('HSET', jobkey(id), 'task', task, 'queue', queue, 'digest', digest, 'message', message,
             'state', 'queued', 'attempt', 0, 'seq', seq, 'submitted_at', submitted_at, 'ttl', ttl,
             'max_tokens', max_tokens, 'num_tokens', 0, 'cancel', 0, 'owner', '', 'token', '', 'published', 1)
  redis.call('ZADD', P .. 'queued:' .. queue, seq, id)
end

-- Queue the job's stored message again, first in line (Kombu's priority-0 list is the queue
-- name itself) and under a fresh delivery tag.
local function republish(id)
  local job = jobkey(id)
  local raw = redis.call('HGET', job, 'message')
  if not raw then return 0 end
  local msg = cjson.decode(raw)
  msg['properties']['delivery_tag'] = id .. '#' .. redis.call('HINCRBY', job, 'published', 1)
  msg['properties']['priority'] = 0
  redis.call('LPUSH', redis.call('HGET', job, 'queue'), cjson.encode(msg))
  return 1
end
"""

# ARGV: prefix, id, task, queue, digest, message, broker list, now, ttl, max_tokens, submitter|''
# -> {'new'|'exists', state}; {'conflict', state} when the id was used with other arguments or queue;
#    {'owned', ''} when another submitter (contract G's owner) holds the id.
SUBMIT = (
    _PRELUDE
    + r"""
local id, caller = ARGV[2], ARGV[11] or ''
local state = redis.call('HGET', jobkey(id), 'state')
if state then
  -- Another caller's job id: refused without saying anything of the job (its state stays theirs).
  if (redis.call('HGET', jobkey(id), 'submitter') or '') ~= caller then return {'owned', ''} end
  -- Same arguments on another queue (another model) is another job, not this one.
  if redis.call('HGET', jobkey(id), 'digest') ~= ARGV[5] or redis.call('HGET', jobkey(id), 'queue') ~= ARGV[4] then
    return {'conflict', state}
  end
  return {'exists', state}
end
create_job(id, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[8], ARGV[9], ARGV[10])
if caller ~= '' then redis.call('HSET', jobkey(id), 'submitter', caller) end
redis.call('LPUSH', ARGV[7], ARGV[6])
return {'new', 'queued'}
"""
)

# ARGV: prefix, id, worker, token, now, maxlen, task, queue, digest, message, submitted_at, ttl, max_tokens
# -> {'claimed', attempt, num_tokens, submitted_at, prompt_token_ids} | {'final', state} | {'busy', owner}
CLAIM = (
    _PRELUDE
    + r"""
local id, me, token, now, maxlen = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local job = jobkey(id)
local state = redis.call('HGET', job, 'state')
if not state then
  -- Sent by a plain Celery client: adopt the task as a job under its task id.
  create_job(id, ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13])
  state = 'queued'
end
local function claimed()
  return {'claimed', redis.call('HGET', job, 'attempt'), redis.call('HGET', job, 'num_tokens'),
          redis.call('HGET', job, 'submitted_at'), redis.call('HGET', job, 'prompt_token_ids') or ''}
end
if terminal(state) then return {'final', state} end
if state == 'running' then
  if redis.call('HGET', job, 'token') == token then return claimed() end  -- a retry whose reply was lost
  local owner = redis.call('HGET', job, 'owner')
  if owner ~= me and alive(owner, now) then return {'busy', owner} end
end
if redis.call('HGET', job, 'cancel') == '1' then
  close_job(id, 'cancelled', '', '', 'abort', now, maxlen, '', '')
  return {'final', 'cancelled'}
end
local attempt = redis.call('HINCRBY', job, 'attempt', 1)
redis.call('HSET', job, 'state', 'running', 'owner', me, 'token', token, 'claimed_at', now)
if attempt == 1 then redis.call('HSET', job, 'started_at', now) end
redis.call('ZREM', P .. 'queued:' .. redis.call('HGET', job, 'queue'), id)
redis.call('ZADD', P .. 'running', now, id)
if attempt > 1 then
  redis.call('XADD', eventskey(id), 'MAXLEN', '~', maxlen, '*', 'type', 'restarted', 'attempt', attempt,
             'resumed_from', redis.call('HGET', job, 'num_tokens'), 'worker', me, 'token_ids', '[]', 'text', '')
end
return claimed()
"""
)

# ARGV: prefix, id, token, start, count, token_ids_json, text, prompt_ids_json|'', now, maxlen, logprobs_json|'',
#       choice|''
# -> 1 written (or already written by a retry of this call), 0 fenced out, -1 out of order
# `start` counts in the choice's own output: a job of n > 1 choices keeps one count per choice
# (num_tokens.<k>) beside num_tokens, their sum; a job of one choice ('') keeps num_tokens alone.
EMIT = (
    _PRELUDE
    + r"""
local id, token = ARGV[2], ARGV[3]
local job = jobkey(id)
if redis.call('HGET', job, 'token') ~= token or redis.call('HGET', job, 'state') ~= 'running' then return 0 end
local choice = ARGV[12] or ''
local counter = choice == '' and 'num_tokens' or ('num_tokens.' .. choice)
local have = tonumber(redis.call('HGET', job, counter) or '0')
local start, count = tonumber(ARGV[4]), tonumber(ARGV[5])
if have >= start + count then return 1 end
if have ~= start then return -1 end
local fields = {'type', 'token', 'attempt', redis.call('HGET', job, 'attempt'), 'index', start,
                'token_ids', ARGV[6], 'text', ARGV[7]}
if ARGV[11] and ARGV[11] ~= '' then
  table.insert(fields, 'logprobs')  -- a JSON list aligned with token_ids (the job asked for them)
  table.insert(fields, ARGV[11])
end
if choice ~= '' then
  table.insert(fields, 'choice')
  table.insert(fields, choice)
end
redis.call('XADD', eventskey(id), 'MAXLEN', '~', ARGV[10], '*', unpack(fields))
local total = tonumber(redis.call('HGET', job, 'num_tokens'))
redis.call('HSET', job, counter, start + count)
if choice ~= '' then redis.call('HSET', job, 'num_tokens', total + count) end
if total == 0 then redis.call('HSET', job, 'first_token_at', ARGV[9]) end
if ARGV[8] ~= '' then redis.call('HSET', job, 'prompt_token_ids', ARGV[8]) end
return 1
"""
)

# ARGV: prefix, id, token, state, result_json, error, finish_reason, now, maxlen, trailing text,
#       stop_reason_json|''
# -> 1 final now (or already, by this claim), 0 fenced out
FINISH = (
    _PRELUDE
    + r"""
local id, token = ARGV[2], ARGV[3]
local job = jobkey(id)
local state = redis.call('HGET', job, 'state')
if terminal(state) then return redis.call('HGET', job, 'finished_by') == token and 1 or 0 end
if state ~= 'running' or redis.call('HGET', job, 'token') ~= token then return 0 end
close_job(id, ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], token, ARGV[10], ARGV[11])
return 1
"""
)

# ARGV: prefix, id, now, maxlen, submitter|'' -> 'missing' (none, or another submitter's) | 'cancelled' |
#       'cancelling' | 'final:<the state it already had>'
CANCEL = (
    _PRELUDE
    + r"""
local id, now, maxlen = ARGV[2], ARGV[3], ARGV[4]
local job = jobkey(id)
local state = redis.call('HGET', job, 'state')
if not state then return 'missing' end
local submitter = redis.call('HGET', job, 'submitter') or ''
if submitter ~= '' and submitter ~= (ARGV[5] or '') then return 'missing' end  -- another's job
if terminal(state) then return 'final:' .. state end
redis.call('HSET', job, 'cancel', 1)
local owner = redis.call('HGET', job, 'owner')
if state == 'queued' or not alive(owner, now) then
  close_job(id, 'cancelled', '', '', 'abort', now, maxlen, '', '')
  return 'cancelled'
end
redis.call('PUBLISH', P .. 'cancel', id)
return 'cancelling'
"""
)

# ARGV: prefix, id, now, maxlen -> 'requeued' | 'cancelled' | 'alive' | 'gone'
REAP = (
    _PRELUDE
    + r"""
local id, now, maxlen = ARGV[2], ARGV[3], ARGV[4]
local job = jobkey(id)
local state = redis.call('HGET', job, 'state')
if state ~= 'running' then
  redis.call('ZREM', P .. 'running', id)
  return 'gone'
end
if alive(redis.call('HGET', job, 'owner'), now) then return 'alive' end
if redis.call('HGET', job, 'cancel') == '1' then
  close_job(id, 'cancelled', '', '', 'abort', now, maxlen, '', '')
  return 'cancelled'
end
redis.call('HSET', job, 'state', 'queued', 'owner', '', 'requeued_at', now)
redis.call('ZREM', P .. 'running', id)
redis.call('ZADD', P .. 'queued:' .. redis.call('HGET', job, 'queue'), redis.call('HGET', job, 'seq'), id)
republish(id)
return 'requeued'
"""
)

# ARGV: prefix, id -> 1 queued again, 0 not queued any more (claimed or final meanwhile)
REPUBLISH = (
    _PRELUDE
    + r"""
if redis.call('HGET', jobkey(ARGV[2]), 'state') ~= 'queued' then return 0 end
return republish(ARGV[2])
"""
)

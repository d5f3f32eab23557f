"""APPEND: the script that writes a job's events that are neither tokens nor its end (events.py's
APPENDED kinds: a tool job's tool_call and tool_args, a prompt's logprobs, an n > 1 job's
choice_end entries), fenced and idempotent as EMIT is.

It changes no state of the job's machine (lua.py), only adds to its stream: so it sits beside
lua.py, not inside it (lua.py had another owner when tool calls came; it may well move there).

Fenced by the claim's token, as every worker write: a worker that lost its job adds nothing.
Idempotent by a sequence number per job (the job hash's `num_appended`): a retry after a lost
reply writes nothing twice, and a resumed attempt, which re-derives the same events from the
tokens already streamed, skips those the earlier attempt wrote.
"""

from __future__ import annotations

# ARGV: prefix, id, token, seq, maxlen, field, value, field, value, ...
# -> 1 written (or already written by a retry of this call, or by an earlier attempt), 0 fenced out,
#    -1 out of order (an earlier seq is missing)
APPEND = r"""
local P, id, token = ARGV[1], ARGV[2], ARGV[3]
local job = P .. 'job:' .. id
if redis.call('HGET', job, 'token') ~= token or redis.call('HGET', job, 'state') ~= 'running' then return 0 end
local have = tonumber(redis.call('HGET', job, 'num_appended') or '0')
local seq = tonumber(ARGV[4])
if have > seq then return 1 end
if have ~= seq then return -1 end
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', P .. 'events:' .. id, 'MAXLEN', '~', ARGV[5], '*', unpack(fields))
redis.call('HSET', job, 'num_appended', seq + 1)
return 1
"""

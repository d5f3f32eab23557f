#!/usr/bin/env bash
# `vllm bench serve` (vLLM's own client: random 128/64, 48 requests at rate inf) against the
# production stack of the tree in TREE: a private redis-server, one `tandem worker`
# (--max-num-seqs 16, float32) and `tandem serve` (--keepalive KA seconds, so that queued
# streams wait past it). Prints the CPU flags and the client's report to OUT.
#   benchmarks/vllm_bench_tandem.sh TREE OUT [KA]
# Needs vLLM's CPU build at ../peers/vllm (../shared/PEERS.md) and this checkout's .venv.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
tree=$(cd "$1" && pwd); out=$2; ka=${3:-2}
py=$here/.venv/bin/python
vllm_py=$here/../peers/vllm/bin/python
tmp=$(mktemp -d)
port() { $py -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
rport=$(port); sport=$(port)
redis-server --port "$rport" --bind 127.0.0.1 --dir "$tmp" --save "" --logfile "$tmp/redis.log" >/dev/null 2>&1 &
rpid=$!
export PYTHONPATH=$tree HF_HUB_OFFLINE=1 TANDEM_REDIS_URL=redis://127.0.0.1:$rport/0
cd "$tree"
$py -m workers.worker --hostname w@vllmbench --queues llm --dtype float32 --max-num-seqs 16 >"$tmp/worker.log" 2>&1 &
wpid=$!
$py -m tandem serve --redis-url "$TANDEM_REDIS_URL" --port "$sport" --keepalive "$ka" >"$tmp/serve.log" 2>&1 &
spid=$!
trap 'kill $spid $wpid 2>/dev/null; sleep 2; kill $rpid 2>/dev/null' EXIT
for _ in $(seq 600); do  # until the worker has registered its model
  curl -sf "http://127.0.0.1:$sport/v1/models" | grep -q '"id"' && break
  sleep 1
done
model=$(curl -s "http://127.0.0.1:$sport/v1/models" | $py -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
tok=$($py -c "from runtime.llm.loader import resolve_hf_dir; print(resolve_hf_dir(None)[0])")
{
  echo "tree $(git -C "$tree" log --oneline -1 | cut -c1-72); model $model; keepalive ${ka} s"
  echo "cpu flags: $(grep -o 'avx[^ ]*\|amx[^ ]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
} >"$out"
unset PYTHONPATH
"$vllm_py" "$here/benchmarks/vllm_cli.py" bench serve --backend openai --base-url "http://127.0.0.1:$sport" \
  --endpoint /v1/completions --model "$model" --tokenizer "$tok" --dataset-name random --random-input-len 128 \
  --random-output-len 64 --num-prompts 48 --request-rate inf --ignore-eos --seed 0 >>"$out" 2>&1
echo "rc=$?" >>"$out"

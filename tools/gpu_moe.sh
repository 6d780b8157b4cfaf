#!/usr/bin/env bash
# One device call: where the arena MoE layer's decode overhead (issue 7) goes. tools/moe_overhead.py
# with --profile at residency 1.0 under each variant below (XLA's command-buffer setting, route_shed's
# impl), one JSON per variant under $OUT. MOE_TOKENS (default "1 2") picks the token counts.
source "$(dirname "$0")/gpu_env.sh" gpu_moe.txt
run() {  # label, XLA_FLAGS, impl
  echo "== $1" | tee -a "$LOG"
  XLA_FLAGS="$2" timeout 240 python3 tools/moe_overhead.py --tokens ${MOE_TOKENS:-1 2} --residency 1.0 --profile \
    --impl "$3" --json "$OUT/moe_$1.json" 2>&1 | grep -v Warning | tee -a "$LOG"
}
run default "" auto
run no_command_buffers "--xla_gpu_enable_command_buffer=" auto
run custom_calls_in_graphs "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1" auto
run reference "" reference

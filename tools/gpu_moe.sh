#!/usr/bin/env bash
# One device call for issue 7's arena overhead: the GPU tests of topk_route_shed and the MoE layers,
# the fused kernel's launch sweep (tools/gpu_topk_tune.py), then tools/moe_overhead.py at residency 1.0
# (the bar; with --profile) and 0.25. Logs and JSON under $OUT. MOE_TOKENS (default "1 2 4 8") picks
# the token counts; PARTS (default "pytest tune moe") the parts; PYTEST_FILES / PYTEST_K / PYTEST_TIMEOUT the tests;
# MOE_ARGS (default --profile) extra overhead arguments; QUARTER=0 skips residency 0.25; XLA_VARIANTS=1 also runs the overhead
# with XLA's command buffers off and with custom calls in them (session 5's first call: no change).
source "$(dirname "$0")/gpu_env.sh" gpu_moe.txt
overhead() {  # label, XLA_FLAGS, residency, extra args
  echo "== moe_overhead $1" | tee -a "$LOG"
  XLA_FLAGS="$2" timeout 300 python3 tools/moe_overhead.py --tokens ${MOE_TOKENS:-1 2 4 8} --residency "$3" ${4:-} \
    --json "$OUT/moe_$1.json" 2>&1 | grep -v Warning | tee -a "$LOG"
}
status=0
parts=" ${PARTS:-pytest tune moe} "
if [[ $parts == *" pytest "* ]]; then
  timeout ${PYTEST_TIMEOUT:-240} python3 -m pytest -q -x -k "${PYTEST_K:-not interpret}" ${PYTEST_FILES:-tests/test_topk_route_shed.py tests/test_moe_jax.py} \
    2>&1 | tail -15 | tee -a "$LOG"; rc=("${PIPESTATUS[@]}"); status=$(( status || rc[0] ))
fi
if [[ $parts == *" tune "* ]]; then
  timeout 200 python3 tools/gpu_topk_tune.py --json "$OUT/topk_tune.json" 2>&1 | grep -v Warning | tee -a "$LOG"
  rc=("${PIPESTATUS[@]}"); status=$(( status || rc[0] ))
fi
if [[ $parts == *" moe "* ]]; then
  overhead default "" 1.0 "${MOE_ARGS---profile}"
  [ "${QUARTER:-1}" = 0 ] || overhead residency_quarter "" 0.25
fi
if [ "${XLA_VARIANTS:-0}" = 1 ]; then
  overhead no_command_buffers "--xla_gpu_enable_command_buffer=" 1.0 --profile
  overhead custom_calls_in_graphs "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1" 1.0 --profile
fi
exit $status

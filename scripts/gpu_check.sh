#!/usr/bin/env bash
# One short GPU check of trl_stable's scaling paths (issue 17). A session with a GPU runs it as is:
#
#   bash scripts/gpu_check.sh             # every check, one PASS/FAIL/SKIP line each, then a summary
#   bash scripts/gpu_check.sh --dry-run   # list the checks and their commands, check their files exist, run nothing
#   CHECK_TIMEOUT=300 bash scripts/gpu_check.sh   # seconds per check (default 240)
#
# Installs nothing (the GPU machine may have no hub access): a check whose package is missing (vllm, bitsandbytes,
# deepspeed) is a SKIP naming it. Each check runs under `timeout`; its last output line is the reason printed.
# Exit status: 0 when no check FAILs. Full logs: $GPU_CHECK_LOGS (default a fresh temporary folder).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 HF_DATASETS_OFFLINE=1 WANDB_DISABLED=true TOKENIZERS_PARALLELISM=false

DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
CHECK_TIMEOUT="${CHECK_TIMEOUT:-240}"
LOGS="${GPU_CHECK_LOGS:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$LOGS"
SKIP_EXIT=77
PASS=0 FAIL=0 SKIP=0

# check NAME [+MODULE]... FILE... -- COMMAND...: a +MODULE that python cannot import (+cuda: no CUDA device) makes it
# a SKIP (nothing is installed), a missing FILE a FAIL; then COMMAND runs under the timeout.
check() {
  local name="$1"; shift
  local files=() modules=()
  while [ "$1" != "--" ]; do
    case "$1" in +*) modules+=("${1#+}") ;; *) files+=("$1") ;; esac
    shift
  done
  shift
  local missing=()
  for f in "${files[@]}"; do [ -e "$f" ] || missing+=("$f"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "FAIL  $name  (missing: ${missing[*]})"; FAIL=$((FAIL + 1)); return
  fi
  if [ "$DRY_RUN" = 1 ]; then
    echo "DRY   $name  (${modules[*]:+needs ${modules[*]}; }$*)"; return
  fi
  for m in "${modules[@]}"; do
    if [ "$m" = cuda ]; then
      if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        echo "SKIP  $name  no CUDA device"; SKIP=$((SKIP + 1)); return
      fi
    elif ! python -c "import $m" >/dev/null 2>&1; then
      echo "SKIP  $name  $m not installed"; SKIP=$((SKIP + 1)); return
    fi
  done
  local log="$LOGS/$name.log" start=$SECONDS rc
  timeout --kill-after=15 "$CHECK_TIMEOUT" "$@" >"$log" 2>&1
  rc=$?
  local reason
  reason="$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-160)"
  local took="$((SECONDS - start))s"
  if [ $rc = 0 ]; then
    echo "PASS  $name  [$took] ${reason}"; PASS=$((PASS + 1))
  elif [ $rc = $SKIP_EXIT ]; then
    echo "SKIP  $name  ${reason#SKIP: }"; SKIP=$((SKIP + 1))
  elif [ $rc = 124 ] || [ $rc = 137 ]; then
    echo "FAIL  $name  [$took] timed out after ${CHECK_TIMEOUT}s (log: $log)"; FAIL=$((FAIL + 1))
  else
    echo "FAIL  $name  [$took] rc=$rc: ${reason} (log: $log)"; FAIL=$((FAIL + 1))
  fi
}

if [ "$DRY_RUN" = 0 ]; then
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || echo "note: torch sees no CUDA device; the GPU checks will SKIP"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1
fi

check lora_4bit_ppo +bitsandbytes +peft scripts/gpu_checks/ppo_lora_4bit.py -- python scripts/gpu_checks/ppo_lora_4bit.py
check bf16_logprobs scripts/gpu_checks/bf16_logprobs.py -- python scripts/gpu_checks/bf16_logprobs.py
check grpo_vllm_colocate +vllm scripts/gpu_checks/grpo_vllm_colocate.py -- python scripts/gpu_checks/grpo_vllm_colocate.py
check ppo_vllm_colocate +vllm scripts/gpu_checks/ppo_vllm_colocate.py -- python scripts/gpu_checks/ppo_vllm_colocate.py
# the engines: `accelerate launch` on one GPU with the configs of examples/accelerate_configs/
check zero2_one_gpu +deepspeed examples/accelerate_configs/deepspeed_zero2.yaml scripts/gpu_checks/ppo_engine.py -- \
  accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml --num_processes 1 \
  scripts/gpu_checks/ppo_engine.py
check fsdp_one_gpu examples/accelerate_configs/fsdp.yaml scripts/gpu_checks/ppo_engine.py -- \
  accelerate launch --config_file examples/accelerate_configs/fsdp.yaml --num_processes 1 scripts/gpu_checks/ppo_engine.py
check bench_ppo_memory +cuda benchmarks/bench_ppo_memory.py -- python benchmarks/bench_ppo_memory.py --device cuda

echo "SUMMARY  pass=$PASS fail=$FAIL skip=$SKIP  (logs: $LOGS)"
[ "$FAIL" = 0 ]

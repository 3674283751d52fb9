#!/usr/bin/env bash
# The GPU step measurements (MFU, XLA flags, batch, remat, loss chunk) in one command, for a lent H100/H200.
#
# Here, once (the device machine reaches no index; its image already has jax, flax, optax, orbax, tensorstore):
#   bash scripts/gpu_bench.sh --download          # wheels of what the image lacks, into .whl/ (.gitignore'd)
# On the device machine (`run` with carry [".whl"]; one call runs at most 10 minutes, so split the variants):
#   bash scripts/gpu_bench.sh cudnn base lhs batch16
#   bash scripts/gpu_bench.sh cudnn+lhs cudnn+batch16 cudnn+remat_none cudnn+chunk16k
#   bash scripts/gpu_bench.sh cudnn cudnn+unroll cudnn+fp8 cudnn+unroll+fp8            # the layers unrolled
#   bash scripts/gpu_bench.sh cudnn cudnn+fp8 cudnn+int8 cudnn+muon cudnn+moments16   # quantization, optimizers
#   bash scripts/gpu_bench.sh cudnn cudnn+offload cudnn+offload_dots                   # host offload
#   bash scripts/gpu_bench.sh cudnn cudnn+lora16                                        # LoRA against full
#   bash scripts/gpu_bench.sh moe     # dropless MoE: ragged_dot (XLA's, tokamax's), then bench_moe.py --tokamax
#                                     # (RAGGED_ARGS, MOE_ARGS: more arguments for each script)
#   bash scripts/gpu_bench.sh ring    # the ring's flash kernels against its XLA blocks (bench_ring_kernel.py;
#                                     # RING_ARGS), packed documents with no window and with a 4,096-token one
# Variants joined by + run together (their XLA flags and arguments combined). XLA's attention caps bench_gpu's
# roofline (`jaxtrain plan --compiler gpu`) far below cuDNN's (docs/planning.md, Figures), so tune on top of cudnn.
# Each variant is one `scripts/bench_step.py` run; its JSON line, with the variant and XLA_FLAGS, is appended to
# $OUT/gpu_bench.jsonl (stderr to $OUT/<variant>.log, a + written as -). A variant after the first that would
# start after BUDGET_S seconds (default 480) is skipped and said so, so the call ends inside its limit.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS="grain==0.2.18 array_record==0.8.6 ml_collections==1.1.0 portpicker==1.6.0 qwix==0.1.8"
# tokamax (model.moe_kernel=tokamax) and what it imports; each name here is also its import name. The image's
# jax 0.11 needs tokamax >= 0.0.13 (0.0.12's Mosaic GPU kernels call the API jax 0.11 renamed); 0.0.17 imports xprof.
KERNEL_WHEELS="tokamax==0.0.17 xprof==2.24.2 einshape==1.0 immutabledict==4.3.1 jaxtyping==0.3.11 wadler_lindig==0.1.8
pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 tqdm==4.70.1 fire==0.7.1
termcolor==3.3.0"
if [[ "${1:-}" == "--download" ]]; then
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $WHEELS $KERNEL_WHEELS && ls .whl
  exit
fi

LHS="--xla_gpu_enable_latency_hiding_scheduler=true"
one_variant() {  # variant -> "XLA_FLAGS|bench_step flags"
  case "$1" in
    base)       echo "|" ;;
    lhs)        echo "$LHS|" ;;
    batch16)    echo "|--config.train.batch_size=16" ;;
    remat_none) echo "|--config.model.remat=none" ;;
    remat_full) echo "|--config.model.remat=full" ;;
    unroll)     echo "|--config.model.scan_unroll=18" ;;  # bench_gpu's 18 layers with no layer loop
    chunk0)     echo "|--config.model.loss_chunk_tokens=0" ;;
    chunk16k)   echo "|--config.model.loss_chunk_tokens=16384" ;;
    attn512)    echo "|--config.model.attention_block=512" ;;
    cudnn)      echo "|--config.model.attention_impl=cudnn" ;;
    fp8)        echo "|--config.model.quant=fp8" ;;
    int8)       echo "|--config.model.quant=int8" ;;
    muon)       echo "|--config.optim.name=muon" ;;
    moments16)  echo "|--config.optim.moments_dtype=bfloat16" ;;
    offload)    echo "|--config.optim.offload=true" ;;
    offload_dots) echo "|--config.model.remat=offload_dots" ;;
    lora16)     echo "|--config.model.lora_rank=16" ;;
    *) return 1 ;;
  esac
}
variant_args() {  # variant, or variants joined by + (e.g. cudnn+batch16): their flags and arguments together
  local flags="" args="" part spec f a
  local IFS=+
  for part in $1; do
    spec=$(one_variant "$part") || { echo "$part"; return 1; }
    f="${spec%%|*}"; a="${spec#*|}"
    [[ -n "$f" ]] && flags="${flags:+$flags }$f"
    [[ -n "$a" ]] && args="${args:+$args }$a"
  done
  echo "$flags|$args"
}

MOE=0 RING=0
if [[ "${1:-}" == "moe" || "${1:-}" == "ring" ]]; then
  [[ "$1" == "moe" ]] && MOE=1 || RING=1
  # Their scripts take their own arguments (RAGGED_ARGS, MOE_ARGS, RING_ARGS), not bench_step's variants.
  if (( $# > 1 )); then echo "gpu_bench: $1 takes no variants (got '${*:2}'); use its *_ARGS" >&2; exit 2; fi
  shift
fi
for v in "${@:-base}"; do
  bad=$(variant_args "$v") || { echo "gpu_bench: unknown variant '$bad'" >&2; exit 2; }
done
OUT="${OUT:-/tmp/gpu_bench}"
mkdir -p "$OUT"
CONFIG="${CONFIG:-configs/bench_gpu.py}"
STEPS="${STEPS:-10}"
BUDGET_S="${BUDGET_S:-480}"
PY="${PY:-python3}"

# Install only what this Python cannot import: a carried wheel must not shadow the image's own packages.
modules=()
# An installed tokamax came with what it imports (pip); only a missing one needs its wheels.
"$PY" -c "import importlib.util as u; exit(u.find_spec('tokamax') is not None)" && WHEELS="$WHEELS $KERNEL_WHEELS"
for wheel in $WHEELS; do modules+=("${wheel%%==*}"); done  # each wheel's import name is its package name
missing=$("$PY" -c "import importlib.util as u, sys
print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" "${modules[@]}")
if [[ -n "$missing" ]]; then
  wheels=()
  for name in $missing; do wheels+=(.whl/"$name"-*.whl); done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${wheels[@]}" || {
    echo "gpu_bench: cannot install ${missing} from .whl/ (run 'bash scripts/gpu_bench.sh --download' here and" \
         "carry .whl)" >&2; exit 2; }
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
jax.devices())"; } | tee "$OUT/env.txt"

if (( MOE )); then
  # Mixtral's expert shape (8 groups of 4096 -> 14336), then bench_gpu with 8 experts of half its d_ff, top 2
  # (the dense model's active width), 6 layers so that its three models fit together.
  # shellcheck disable=SC2086
  "$PY" scripts/bench_ragged_dot.py ${RAGGED_ARGS:-} >"$OUT/ragged_dot.log" 2>&1
  tail -n 8 "$OUT/ragged_dot.log"; tail -n 1 "$OUT/ragged_dot.log" >> "$OUT/gpu_moe.jsonl"
  # shellcheck disable=SC2086
  "$PY" scripts/bench_moe.py --config "$CONFIG" --tokamax --expert_d_ff 2816 --config.model.n_layers=6 \
    --steps "$STEPS" ${MOE_ARGS:-} >"$OUT/bench_moe.log" 2>&1
  tail -n 6 "$OUT/bench_moe.log"; tail -n 1 "$OUT/bench_moe.log" >> "$OUT/gpu_moe.jsonl"
  exit
fi
if (( RING )); then
  status=0
  for window in 0 4096; do
    # shellcheck disable=SC2086
    "$PY" scripts/bench_ring_kernel.py --window "$window" ${RING_ARGS:-} >"$OUT/ring_$window.log" 2>&1 || status=1
    tail -n 2 "$OUT/ring_$window.log"; tail -n 1 "$OUT/ring_$window.log" >> "$OUT/gpu_ring.jsonl"
  done
  exit "$status"
fi

start=$SECONDS
ran=0
for v in "${@:-base}"; do
  spec=$(variant_args "$v")
  log="$OUT/${v//+/-}.log"  # a plain file name for cudnn+batch16 too
  # The first variant always runs: SECONDS ticks in whole seconds, so even BUDGET_S=0 could read as passed.
  if (( ran++ && SECONDS - start > BUDGET_S )); then
    echo "gpu_bench: skipped $v (past BUDGET_S=${BUDGET_S}s)"; continue
  fi
  flags="${spec%%|*}"; args="${spec#*|}"
  t0=$SECONDS
  # shellcheck disable=SC2086
  line=$(XLA_FLAGS="$flags" "$PY" scripts/bench_step.py --config "$CONFIG" --steps "$STEPS" $args 2>"$log" \
         | tail -n 1)
  rc=$?
  if [[ $rc -ne 0 || "$line" != "{"* ]]; then
    echo "gpu_bench: $v failed (exit $rc), see $log:"; tail -n 5 "$log"; continue
  fi
  "$PY" -c "import json, sys; r = json.loads(sys.argv[1]); r.update(variant=sys.argv[2], xla_flags=sys.argv[3],
args=sys.argv[4]); print(json.dumps(r))" "$line" "$v" "$flags" "$args" >> "$OUT/gpu_bench.jsonl"
  echo "gpu_bench: $v $((SECONDS - t0))s | $(grep '^step ' "$log" | tail -n 1)"
done

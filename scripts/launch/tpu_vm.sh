#!/bin/bash
# jaxtrain on a multi-host Cloud TPU VM slice: starts the same trainer on every worker over gcloud ssh.
#
#   TPU_NAME=my-tpu ZONE=us-east5-a scripts/launch/tpu_vm.sh [CONFIG [--config.x=y ...]]
#
# On your machine this runs, once for the whole slice:
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE [--project=$PROJECT] --worker=all \
#       --command="cd $REMOTE_DIR && bash scripts/launch/tpu_vm.sh worker CONFIG ARGS..."
# and on each worker the `worker` mode below reads the slice from the metadata server, exports it and
# starts `python3 -m jaxtrain.main --config CONFIG ARGS...`.
#
# Environment (read on your machine and passed on to the workers):
#   TPU_NAME, ZONE  the TPU VM and its zone (required); PROJECT: the gcloud project (optional)
#   GCLOUD_FLAGS    extra flags for `gcloud ... ssh`, split on spaces (e.g. "--internal-ip")
#   REMOTE_DIR      the jaxtrain checkout on every worker (default: jaxtrain, relative to the home dir)
#   REPO_URL        git clone it into REMOTE_DIR on workers that lack it (optional)
#   INSTALL=1       pip install jax[tpu] and the checkout (-e) on every worker before starting
#   CONFIG, ARGS    config file (default configs/default.py) and extra flags; script arguments override
#   WORKDIR         passed as --config.workdir; must be storage every worker sees (a Filestore/NFS or
#                   gcsfuse mount at the same path): all workers write the same Orbax checkpoint
#   DETACH=1        start the trainer with nohup and return (log: $REMOTE_DIR/logs/jaxtrain-worker-N.log).
#                   Default: stream every worker's output here; losing the ssh session then kills the run
#   PYTHON          interpreter on the workers (default python3)
#
# What the trainers see (jaxtrain.parallel.distributed, TPU path): TPU_WORKER_HOSTNAMES (the workers' addresses in
# worker order, from the `worker-network-endpoints` attribute), TPU_WORKER_ID (`agent-worker-number`),
# and MEGASCALE_NUM_SLICES / MEGASCALE_SLICE_ID / MEGASCALE_COORDINATOR_ADDRESS when `tpu-env` has them
# (multislice). On a plain TPU VM these live only in the metadata server. jaxtrain takes process id =
# slice x hosts + worker id; JAX's own TPU detection picks the coordinator (worker 0, port 8482).
# Values already in the environment win.
#
# Preemption: a spot/preemptible TPU VM or a maintenance event sends SIGTERM; jaxtrain saves and exits 75
# ("rerun to resume"). A preempted TPU VM must be recreated; then run this script again with the same
# WORKDIR. Nothing here restarts it.

set -euo pipefail

METADATA_URL="${METADATA_URL:-http://metadata.google.internal/computeMetadata/v1/instance/attributes}"

metadata() {  # one attribute of this VM; tests put a fake curl first on PATH
  curl -sSf --retry 3 -H "Metadata-Flavor: Google" "${METADATA_URL}/$1"
}

# "worker-network-endpoints" is either "host,host,..." or "name:id:ip,..." triples (as JAX parses it).
worker_addresses() {
  local out=() items=() item parts=()
  IFS=, read -ra items <<< "$1"
  for item in "${items[@]}"; do
    IFS=: read -ra parts <<< "$item"
    case "${#parts[@]}" in
      1) out+=("${parts[0]}") ;;
      3) out+=("${parts[2]}") ;;
      *) echo "tpu_vm.sh: unexpected worker-network-endpoints entry '$item'" >&2; return 1 ;;
    esac
  done
  (IFS=,; echo "${out[*]}")
}

worker() {
  local config="${CONFIG:-configs/default.py}" args=() python="${PYTHON:-python3}"
  read -ra args <<< "${ARGS:-}"
  if (( $# > 0 )); then
    config="$1"; shift
    args=("$@")
  fi
  if [[ -n "${WORKDIR:-}" ]]; then
    args+=("--config.workdir=${WORKDIR}")
  fi

  if [[ -z "${TPU_WORKER_ID:-}" ]]; then
    TPU_WORKER_ID="$(metadata agent-worker-number)"
  fi
  if [[ -z "${TPU_WORKER_HOSTNAMES:-}${TPU_PROCESS_ADDRESSES:-}" ]]; then
    TPU_WORKER_HOSTNAMES="$(worker_addresses "$(metadata worker-network-endpoints)")"
  fi
  export TPU_WORKER_ID TPU_WORKER_HOSTNAMES
  # tpu-env holds lines like "MEGASCALE_NUM_SLICES: '2'"; only multislice sets these keys.
  local tpu_env key value
  tpu_env="$(metadata tpu-env 2>/dev/null || true)"
  for key in MEGASCALE_NUM_SLICES MEGASCALE_SLICE_ID MEGASCALE_COORDINATOR_ADDRESS; do
    value="$(sed -n "s/^${key}: *'\{0,1\}\([^']*\)'\{0,1\} *$/\1/p" <<< "$tpu_env" | head -n 1)"
    if [[ -n "$value" && -z "${!key:-}" ]]; then
      export "$key=$value"
    fi
  done

  if [[ "${INSTALL:-0}" == 1 ]]; then
    "$python" -m pip install -q -U "jax[tpu]"
    "$python" -m pip install -q -e .
  fi

  local cmd=("$python" -m jaxtrain.main --config "$config" "${args[@]}")
  echo "tpu_vm.sh: worker ${TPU_WORKER_ID} of ${TPU_WORKER_HOSTNAMES}: ${cmd[*]}" >&2
  if [[ "${DETACH:-0}" == 1 ]]; then
    mkdir -p logs
    local log="logs/jaxtrain-worker-${TPU_WORKER_ID}.log"
    # Its own session: the trainer outlives the ssh connection (and its SIGHUP).
    setsid nohup "${cmd[@]}" > "$log" 2>&1 < /dev/null &
    echo "tpu_vm.sh: worker ${TPU_WORKER_ID}: started pid $!, log $(pwd)/${log}" >&2
  else
    exec "${cmd[@]}"
  fi
}

launch() {
  : "${TPU_NAME:?set TPU_NAME to the TPU VM name}" "${ZONE:?set ZONE to its zone}"
  local dir="${REMOTE_DIR:-jaxtrain}" remote=() extra=() word
  # Settings the worker reads, passed explicitly: gcloud ssh does not forward the local environment.
  for word in CONFIG ARGS WORKDIR INSTALL DETACH PYTHON; do
    if [[ -n "${!word:-}" ]]; then
      remote+=("${word}=$(printf '%q' "${!word}")")
    fi
  done
  local cmd="cd $(printf '%q' "$dir") && ${remote[*]+${remote[*]} }bash scripts/launch/tpu_vm.sh worker"
  if (( $# > 0 )); then
    cmd+="$(printf ' %q' "$@")"
  fi
  if [[ -n "${REPO_URL:-}" ]]; then
    cmd="{ [ -d $(printf '%q' "$dir") ] || git clone -q $(printf '%q %q' "$REPO_URL" "$dir"); } && $cmd"
  fi
  read -ra extra <<< "${GCLOUD_FLAGS:-}"
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"} \
    --worker=all ${extra[@]+"${extra[@]}"} --command="$cmd"  # (macOS bash 3.2: empty arrays and set -u)
}

if [[ "${1:-}" == worker ]]; then
  shift
  worker "$@"
else
  launch "$@"
fi

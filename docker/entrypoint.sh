#!/usr/bin/env bash
# Container entrypoint: `tandem serve` on 0.0.0.0:$TANDEM_PORT with the container's arguments,
#   docker run ... IMAGE /models/NAME [options]   ->   tandem serve --host 0.0.0.0 --port 8000 /models/NAME [options]
# (options given later win, so --host/--port in the arguments still apply; keep TANDEM_PORT equal
# to --port for the HEALTHCHECK).
#
# Multi-node (docker/compose.yaml): with NNODES set, this node's NPROC_PER_NODE ranks start under
# torchrun with the standard torch.distributed environment (MASTER_ADDR, MASTER_PORT, NODE_RANK);
# torchrun gives each rank its RANK, LOCAL_RANK and WORLD_SIZE = NNODES * NPROC_PER_NODE.
set -euo pipefail

serve=(tandem serve --host "${TANDEM_HOST:-0.0.0.0}" --port "${TANDEM_PORT:-8000}" "$@")

if [[ -z "${NNODES:-}" ]]; then
    exec "${serve[@]}"
fi

fail() {
    echo "entrypoint: $*" >&2
    exit 2
}
for name in MASTER_ADDR MASTER_PORT NODE_RANK NPROC_PER_NODE; do
    [[ -n "${!name:-}" ]] || fail "NNODES is set, so $name must be set too"
done
for name in NNODES NODE_RANK NPROC_PER_NODE MASTER_PORT; do
    [[ "${!name}" =~ ^[0-9]+$ ]] || fail "$name=${!name} is not a non-negative integer"
done
(( NODE_RANK < NNODES )) || fail "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"
world=$(( NNODES * NPROC_PER_NODE ))
if [[ -n "${WORLD_SIZE:-}" && "$WORLD_SIZE" != "$world" ]]; then
    fail "WORLD_SIZE=$WORLD_SIZE but NNODES * NPROC_PER_NODE = $world"
fi
# torchrun sets these per rank; stale values from the environment must not leak into it.
unset RANK LOCAL_RANK WORLD_SIZE

exec torchrun \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --master-addr "$MASTER_ADDR" \
    --master-port "$MASTER_PORT" \
    --no-python \
    "${serve[@]}"

#!/usr/bin/env bash
# A two-node Ray cluster on this one machine, to try the cluster path (recipes/submit_ray_job.sh) before a real
# cluster; CI runs the tiny GRPO job on it (tests/verl/test_grpo_cpu.py).
#
#   bash recipes/local_ray_cluster.sh start     # head (no GPU slot) + worker node (one GPU slot)
#   bash recipes/local_ray_cluster.sh exec env RAY_ADDRESS=http://127.0.0.1:28265 ALIGN=all \
#       bash recipes/submit_ray_job.sh recipes/grpo_tiny_cpu.sh
#   bash recipes/local_ray_cluster.sh stop      # stops every Ray process of this machine; checks none is left;
#                                               # removes the sessions' runtime envs (GBs each) from the temp dirs
#
# Loopback only: Ray 2.60's `ray start` replaces 127.0.0.1 by the machine's routable address for every node
# that may join a cluster, and its raylets listen on 0.0.0.0. So, as root, the cluster runs in its own network
# namespace (NETNS, default rlalign-ray) that has nothing but the loopback interface: nothing outside this
# machine, or outside the namespace, can reach it; `exec` runs a client command (submit, logs) inside it.
# NETNS= (empty) or a non-root user: no namespace, Ray binds the machine's address (said on stderr).
# Ports are fixed from BASE_PORT (default 28200): the GCS on BASE_PORT+79, the dashboard (Jobs API) on +65.
# The head node has 2 CPUs and no GPU slot, so the job's driver and verl's TaskRunner may run there, but every
# actor that asks for a GPU slot (the FSDP workers, the rollout) lands on the worker node. On a CPU-only machine
# "GPU" is only Ray's resource name for the slot (verl's CPU path asks for it).
# Ray >= 2.60 uses token authentication: every node and client needs RAY_AUTH_MODE=token (exported here and in
# submit_ray_job.sh) and the cluster's token. `ray start` does not create one, so `start` first makes sure
# ~/.ray/auth_token exists (`ray get-auth-token --generate`: kept when present; not with RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH set).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "${here}/.." && pwd)
if [[ -z "${RAY:-}" ]]; then
    if [[ -x "${root}/.venv/bin/ray" ]]; then RAY="${root}/.venv/bin/ray"; else RAY=ray; fi
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
export RAY_USAGE_STATS_ENABLED=0
BASE_PORT=${BASE_PORT:-28200}
TEMP_DIR=${RAY_TEMP_DIR:-/tmp/rlalign-ray}   # short: Ray's socket paths must stay under 108 bytes
WORKER_CPUS=${WORKER_CPUS:-16}
WORKER_GPUS=${WORKER_GPUS:-1}
if [[ -z "${NETNS+set}" ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v ip >/dev/null 2>&1; then NETNS=rlalign-ray; else NETNS=; fi
fi

die() { echo "[local_ray_cluster] ERROR $*" >&2; exit 2; }
[[ "${BASE_PORT}" =~ ^[0-9]+$ && "${BASE_PORT}" -ge 1024 && "${BASE_PORT}" -le 65000 ]] \
    || die "BASE_PORT=${BASE_PORT} must be a number in 1024..65000"
[[ "${NETNS}" =~ ^[A-Za-z0-9_.-]*$ ]] || die "NETNS=${NETNS} is not a valid namespace name"
[[ "${TEMP_DIR}" == /?* ]] || die "RAY_TEMP_DIR=${TEMP_DIR} must be an absolute path (default /tmp/rlalign-ray)"

# inside the namespace (if any): the command's network is the cluster's
in_ns() { if [[ -n "${NETNS}" ]]; then ip netns exec "${NETNS}" "$@"; else "$@"; fi; }
ns_exists() { [[ -n "${NETNS}" ]] && ip netns list 2>/dev/null | grep -qw "^${NETNS}"; }

# head: node manager +0, object manager +1, agents +2..+4, metrics +5, client +6; worker node: +10..+15;
# worker processes: +20..+59; dashboard +65; GCS +79
head_ports=(--node-manager-port=$((BASE_PORT)) --object-manager-port=$((BASE_PORT + 1))
    --dashboard-agent-listen-port=$((BASE_PORT + 2)) --dashboard-agent-grpc-port=$((BASE_PORT + 3))
    --runtime-env-agent-port=$((BASE_PORT + 4)) --metrics-export-port=$((BASE_PORT + 5))
    --ray-client-server-port=$((BASE_PORT + 6)) --min-worker-port=$((BASE_PORT + 20))
    --max-worker-port=$((BASE_PORT + 39)))
worker_ports=(--node-manager-port=$((BASE_PORT + 10)) --object-manager-port=$((BASE_PORT + 11))
    --dashboard-agent-listen-port=$((BASE_PORT + 12)) --dashboard-agent-grpc-port=$((BASE_PORT + 13))
    --runtime-env-agent-port=$((BASE_PORT + 14)) --metrics-export-port=$((BASE_PORT + 15))
    --min-worker-port=$((BASE_PORT + 40)) --max-worker-port=$((BASE_PORT + 59)))
GCS_PORT=$((BASE_PORT + 79))
DASHBOARD_PORT=$((BASE_PORT + 65))

# TCP sockets in LISTEN state on BASE_PORT..BASE_PORT+99 as "hexaddr:port" lines, from /proc (no ss needed);
# run through in_ns to see the namespace's sockets
listening() {
    local file sl local_addr state rest port
    for file in /proc/net/tcp /proc/net/tcp6; do
        [[ -r "${file}" ]] || continue
        while read -r sl local_addr _ state rest; do
            [[ "${state}" == 0A ]] || continue   # 0A: LISTEN
            port=$((16#${local_addr##*:}))
            if ((port >= BASE_PORT && port <= BASE_PORT + 99)); then echo "${local_addr%:*}:${port}"; fi
        done < <(tail -n +2 "${file}")
    done
}
# the Ray processes still alive (raylet, GCS, dashboard, workers)
ray_processes() { pgrep -f 'ray/core/src/ray/(raylet|gcs)|ray/dashboard/|default_worker.py|ray::' || true; }

case "${1:-}" in
start)
    [[ -z "$(ray_processes)" ]] || die "Ray processes are running on this machine; stop them first: bash $0 stop"
    if [[ -n "${NETNS}" ]]; then
        ns_exists || ip netns add "${NETNS}" || die "cannot create network namespace ${NETNS} (set NETNS= to skip)"
        ip netns exec "${NETNS}" ip link set lo up
    else
        echo "[local_ray_cluster] WARNING no network namespace (not root, or NETNS=): Ray binds this machine's" \
            "address, not only loopback" >&2
    fi
    [[ -z "$(in_ns bash -c "$(declare -f listening); BASE_PORT=${BASE_PORT} listening")" ]] \
        || die "ports ${BASE_PORT}..$((BASE_PORT + 99)) are in use; run: bash $0 stop (or set BASE_PORT)"
    if [[ "${RAY_AUTH_MODE}" == token && -z "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ]]; then
        "${RAY}" get-auth-token --generate >/dev/null || die "could not create the Ray token (~/.ray/auth_token)"
    fi
    # the namespace has no other address: torch's gloo and vLLM must not look for one
    export GLOO_SOCKET_IFNAME=lo VLLM_HOST_IP=127.0.0.1
    log=$(mktemp)
    trap 'rm -f "${log}"' EXIT
    in_ns "${RAY}" start --head --node-ip-address=127.0.0.1 --port="${GCS_PORT}" --dashboard-host=127.0.0.1 \
        --dashboard-port="${DASHBOARD_PORT}" --num-cpus=2 --num-gpus=0 --temp-dir="${TEMP_DIR}" \
        --disable-usage-stats "${head_ports[@]}" >"${log}" 2>&1 || { cat "${log}" >&2; die "the head node did not start"; }
    # its own temp dir: two nodes sharing one would build the job's runtime env (pip) in the same folder at once
    in_ns "${RAY}" start --address="127.0.0.1:${GCS_PORT}" --temp-dir="${TEMP_DIR}-worker" --num-cpus="${WORKER_CPUS}" \
        --num-gpus="${WORKER_GPUS}" --disable-usage-stats "${worker_ports[@]}" >"${log}" 2>&1 \
        || { cat "${log}" >&2; "${RAY}" stop --force >/dev/null 2>&1; die "the worker node did not start"; }
    if [[ -n "${NETNS}" ]]; then
        # the namespace's only interface is loopback, so whatever listens in it is loopback-only; nothing may
        # listen on the cluster's ports on the machine's own network
        host_side=$(listening)
        if [[ -n "${host_side}" ]]; then
            "${RAY}" stop --force >/dev/null 2>&1 || true
            die "a Ray port listens outside the namespace (${host_side//$'\n'/ }); stopped the cluster"
        fi
        [[ -n "$(in_ns bash -c "$(declare -f listening); BASE_PORT=${BASE_PORT} listening")" ]] \
            || die "no Ray port listens inside namespace ${NETNS}"
    fi
    echo "RAY_ADDRESS=http://127.0.0.1:${DASHBOARD_PORT}"  # the Jobs API (ray job submit)
    echo "GCS_ADDRESS=127.0.0.1:${GCS_PORT}"               # ray.init / the state API (ray list actors, ray logs)
    ;;
exec)
    shift
    [[ $# -gt 0 ]] || die "usage: $0 exec <command...>"
    in_ns "$@"
    ;;
stop)
    "${RAY}" stop --force >/dev/null 2>&1 || true
    left=""
    for _ in $(seq 1 30); do
        left="$(ray_processes)$(listening)"
        if ns_exists; then left+=$(ip netns exec "${NETNS}" bash -c "$(declare -f listening); BASE_PORT=${BASE_PORT} listening"); fi
        [[ -z "${left}" ]] && break
        sleep 1
    done
    if ns_exists; then ip netns del "${NETNS}"; fi
    [[ -z "${left}" ]] || die "Ray processes or listening ports left after ray stop: ${left//$'\n'/ }"
    # Ray keeps every session's runtime envs in the temp dir and never removes them; a pip runtime env clones the
    # nodes' virtualenv (3.8 GB per node for the CPU test environment), so each job would leave ~7.6 GB behind.
    # They are rebuilt per session: remove them once nothing runs (the session logs stay).
    for dir in "${TEMP_DIR}" "${TEMP_DIR}-worker"; do
        [[ -d "${dir}" ]] || continue
        find "${dir}" -mindepth 2 -maxdepth 2 -type d -name runtime_resources -prune -exec rm -rf {} + \
            || die "could not remove the runtime envs under ${dir} (delete its session_*/runtime_resources)"
    done
    ;;
*)
    echo "usage: $0 start|exec <command...>|stop" >&2
    exit 2
    ;;
esac

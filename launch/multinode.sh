#!/usr/bin/env bash
# Several nodes: the deepspeed launcher with a hostfile, around `python -m ds_packdpo.train`.
#
#   launch/multinode.sh [launcher options] [--] [ds_packdpo.train flags]
#
# From one node over passwordless ssh (deepspeed starts every node through pdsh):
#   launch/multinode.sh --hostfile launch/hostfile --master_addr node1 -- --model /models/m --dataset prefs.jsonl
# Without ssh (this script started on every node, by hand or by a job's script), each with its node rank:
#   launch/multinode.sh --hostfile H --no_ssh --node_rank 1 --master_addr node1 --master_port 29500 -- [flags]
#
# Launcher options (each can also come from the environment variable in brackets):
#   --hostfile FILE      [HOSTFILE]     "host slots=N" lines, see launch/hostfile.example (required)
#   --include SPEC       [INCLUDE]      only these nodes/GPUs, e.g. "node1@node2:0,1" (exclusive with --exclude)
#   --exclude SPEC       [EXCLUDE]      every node/GPU except these, e.g. "node3" or "node2:7"
#   --num_nodes N        [NUM_NODES]    the first N hosts of the hostfile
#   --num_gpus N         [NUM_GPUS]     the first N GPUs of every host
#   --master_addr ADDR   [MASTER_ADDR]  address of rank 0's node (default with ssh: `hostname -I` of the first host)
#   --master_port PORT   [MASTER_PORT]  rendezvous port, the same on every node (default 29500)
#   --no_ssh             [NO_SSH=1]     this process launches only its own node's ranks
#   --node_rank R        [NODE_RANK]    this node's index among the active hosts (required with --no_ssh)
#   --launcher NAME      [LAUNCHER]     multi-node backend of deepspeed: pdsh (default), openmpi, mvapich, slurm, ...
#   --ssh_port PORT      [SSH_PORT]     ssh port of the other nodes
#   --export NAME[=VALUE]               set NAME (to VALUE, or to this shell's value) for every rank; repeatable
# Launcher options stop at "--" or at the first other argument; everything after goes to the trainer unchanged.
#
# The ranks on other nodes get, besides DeepSpeed's own (PYTHON*, NCCL*, ... and the lines of .deepspeed_env in
# ~ and here, as DeepSpeed reads them), this shell's PATH, LD_LIBRARY_PATH, DS_ACCELERATOR, HF_HOME and
# TORCH_EXTENSIONS_DIR (launch/env.sh), so they find this venv without a shell set-up on those nodes, and --export.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

die() { echo "launch/multinode.sh: $*" >&2; exit 2; }

hostfile=${HOSTFILE:-}
include=${INCLUDE:-}
exclude=${EXCLUDE:-}
num_nodes=${NUM_NODES:-}
num_gpus=${NUM_GPUS:-}
master_addr=${MASTER_ADDR:-}
master_port=${MASTER_PORT:-29500}
no_ssh=${NO_SSH:-0}
node_rank=${NODE_RANK:-}
launcher=${LAUNCHER:-}
ssh_port=${SSH_PORT:-}
exports=()

while [[ $# -gt 0 ]]; do
    case "$1" in
        --hostfile|--include|--exclude|--num_nodes|--num_gpus|--master_addr|--master_port|--node_rank|--launcher|--ssh_port)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            case "$1" in
                --hostfile) hostfile=$2 ;;
                --include) include=$2 ;;
                --exclude) exclude=$2 ;;
                --num_nodes) num_nodes=$2 ;;
                --num_gpus) num_gpus=$2 ;;
                --master_addr) master_addr=$2 ;;
                --master_port) master_port=$2 ;;
                --node_rank) node_rank=$2 ;;
                --launcher) launcher=$2 ;;
                --ssh_port) ssh_port=$2 ;;
            esac
            shift 2 ;;
        --export)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            name=${2%%=*}
            [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--export $2: '$name' is not a variable name"
            if [[ "$2" == *=* ]]; then
                value=${2#*=}
            else
                [[ -v "$name" ]] || die "--export $name: not set in this shell (give NAME=VALUE)"
                value=${!name}
            fi
            # DeepSpeed writes each value into the command line that the other nodes' shell runs, in double quotes
            [[ "$value" != *[\$\`\"\\]* && "$value" != *$'\n'* ]] ||
                die "--export $name: its value holds \$, \`, \", \\ or a newline, which the other nodes' shell would expand"
            exports+=("$name=$value")
            shift 2 ;;
        --no_ssh) no_ssh=1; shift ;;
        --) shift; break ;;
        *) break ;;
    esac
done

[[ -n "$hostfile" ]] || die "--hostfile (or HOSTFILE) is required; see launch/hostfile.example"
[[ -f "$hostfile" ]] || die "hostfile $hostfile: no such file"
[[ -z "$include" || -z "$exclude" ]] || die "--include and --exclude are mutually exclusive"

launcher_args=(--hostfile "$hostfile" --master_port "$master_port")
[[ -n "$include" ]] && launcher_args+=(--include "$include")
[[ -n "$exclude" ]] && launcher_args+=(--exclude "$exclude")
[[ -n "$num_nodes" ]] && launcher_args+=(--num_nodes "$num_nodes")
[[ -n "$num_gpus" ]] && launcher_args+=(--num_gpus "$num_gpus")
[[ -n "$master_addr" ]] && launcher_args+=(--master_addr "$master_addr")
[[ -n "$launcher" ]] && launcher_args+=(--launcher "$launcher")
[[ -n "$ssh_port" ]] && launcher_args+=(--ssh_port "$ssh_port")
if [[ "$no_ssh" == 1 ]]; then
    # Without ssh deepspeed cannot ask rank 0's node for its address, and must be told which node this is.
    [[ -n "$node_rank" ]] || die "--no_ssh needs --node_rank (or NODE_RANK)"
    [[ -n "$master_addr" ]] || die "--no_ssh needs --master_addr (or MASTER_ADDR): the address of node rank 0"
    launcher_args+=(--no_ssh --node_rank "$node_rank")
fi

for assignment in "${exports[@]}"; do
    export "$assignment"  # this node's ranks inherit it (one launcher per node with --no_ssh, or one node)
done
if [[ "$no_ssh" != 1 ]]; then
    # DeepSpeed's multi-node runners (pdsh, openmpi, ...) export on the other nodes the lines of one environment file,
    # DS_ENV_FILE: this one, read through a descriptor of this process (deleted at once, so nothing is left behind).
    ds_env=${DS_ENV_FILE:-.deepspeed_env}
    if [[ "$ds_env" == /* ]]; then
        user_env_files=("$ds_env")
    else
        user_env_files=(~/"$ds_env" "./$ds_env")  # where DeepSpeed looks, in its order (a later line wins)
    fi
    env_file=$(mktemp)
    {
        for var in "${JOB_ENV[@]}"; do
            if [[ -n "${!var:-}" ]]; then
                printf '%s=%s\n' "$var" "${!var}"
            fi
        done
        for file in "${user_env_files[@]}"; do
            if [[ -f "$file" ]]; then
                sed -e '$a\' "$file"  # its lines as they are (a last one without a newline gets one)
            fi
        done
        if [[ ${#exports[@]} -gt 0 ]]; then
            printf '%s\n' "${exports[@]}"
        fi
    } > "$env_file"
    exec {env_fd}<"$env_file"
    rm -f "$env_file"
    export DS_ENV_FILE=/dev/fd/$env_fd
fi

exec deepspeed "${launcher_args[@]}" --module ds_packdpo.train "$@"

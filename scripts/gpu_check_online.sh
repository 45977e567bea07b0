#!/usr/bin/env bash
# Online training on a GPU machine: the target served by a GPU build of vLLM (the producer) on one
# device, the EAGLE-3 draft trained on the others (on a one-device machine: the same device, the
# producer held to PRODUCER_MEM of it), states streamed through Ray, nothing captured on disk.
# Then the same samples and steps captured and trained offline, for the ratio. Prints, from the
# run's own train_report.json: the trainer's tokens/s, the producer's tokens/s, which side waited
# (the run log's producer-bound / trainer-bound line), and the final losses side by side.
# Then two hf producers and (with 3+ devices) two trainer ranks through a Ray cluster this script
# starts, placed by node resources (docs/online-cluster.md): the balance from both sides.
# Prepared for a lent GPU machine: short runs (~8 min for SmolLM2).
#
#   scripts/gpu_check_online.sh [TARGET=embedded SmolLM2] [SAMPLES=200] [STEPS=200]
#
# Needs: draftsmith's .venv with a GPU torch, and a vLLM GPU build whose Python is
# $DRAFTSMITH_VLLM_PYTHON (Ray comes with vLLM). DEVICES: the visible devices (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-}
SAMPLES=${2:-200}
STEPS=${3:-200}
OUT=${OUT:-runs/gpu-check-online}
PRODUCER_MEM=${PRODUCER_MEM:-0.5}
: "${DRAFTSMITH_VLLM_PYTHON:?set DRAFTSMITH_VLLM_PYTHON to the python of a GPU vLLM build}"
export DRAFTSMITH_VLLM_PYTHON TOKENIZERS_PARALLELISM=false
CONFIGS=recipes/configs/smollm2-135m
ngpu=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())")
[ "$ngpu" -ge 1 ] || { echo "gpu_check_online: no GPU visible to .venv's torch" >&2; exit 1; }
ours=$(.venv/bin/python -c "import ray; print(ray.__version__)")
theirs=$("$DRAFTSMITH_VLLM_PYTHON" -c "import ray; print(ray.__version__)")
[ "$ours" = "$theirs" ] || { echo "gpu_check_online: Ray $ours in .venv, $theirs beside vLLM: install ray==$ours there" >&2; exit 1; }
target=()
[ -n "$TARGET" ] && target=("target=$TARGET")
mkdir -p "$OUT"
.venv/bin/python -m recipes.cli prepare --config $CONFIGS/prepare.yaml "max_records=$SAMPLES" \
    "output_dir=$OUT/prepared" "${target[@]}" overwrite=true
common=(--config $CONFIGS/eagle3.yaml "max_steps=$STEPS" epochs=1 save_every=100000 log_every=20
        "max_samples=$SAMPLES" "${target[@]}" overwrite=true)
launch=(.venv/bin/python)
if [ "$ngpu" -ge 2 ]; then  # the producer on device 0, the trainer on the rest (DDP over them when several)
    split=("online.devices=[0]")
    trainer_devices=$(seq -s, 1 $((ngpu - 1)))
    [ "$ngpu" -ge 3 ] && launch=(.venv/bin/accelerate launch --multi_gpu --num_processes $((ngpu - 1)))
else                        # one device holds both: the producer takes PRODUCER_MEM of it
    split=("online.gpu_memory_utilization=$PRODUCER_MEM")
    trainer_devices=0
fi
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=$trainer_devices "${launch[@]}" recipes/train.py "${common[@]}" "data=$OUT/prepared" \
    "output_dir=$OUT/online" online.engine=vllm online.target_dtype=bfloat16 online.store_dtype=bfloat16 \
    "${split[@]}" 2>&1 | tee "$OUT/online.log" | { grep -E "producer|trainer-bound|producer-bound|trained" || true; }
t1=$(date +%s)
.venv/bin/python recipes/capture.py --config $CONFIGS/capture.yaml "data=$OUT/prepared" "output_dir=$OUT/capture" \
    "max_samples=$SAMPLES" drafts=[eagle3] store_dtype=bfloat16 target_dtype=bfloat16 "${target[@]}" overwrite=true \
    > "$OUT/capture.log" 2>&1
.venv/bin/python recipes/train.py "${common[@]}" "data=$OUT/capture" "output_dir=$OUT/offline" > "$OUT/offline.log" 2>&1
t2=$(date +%s)
.venv/bin/python - "$OUT" $((t1 - t0)) $((t2 - t1)) <<'PY'
import json, sys
out, online_s, offline_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
on = json.load(open(f"{out}/online/train_report.json"))
off = json.load(open(f"{out}/offline/train_report.json"))
print(f"online (vLLM producer): {online_s} s wall, {on['tokens'] / online_s:.0f} trained tok/s, final loss "
      f"{on['final']['loss']:.4f}; producer {json.dumps(on['final'].get('online'))}")
print(f"capture then train:     {offline_s} s wall, {off['tokens'] / offline_s:.0f} trained tok/s, final loss "
      f"{off['final']['loss']:.4f}")
print(f"online / offline wall: {online_s / offline_s:.2f}x")
PY

# Then two hf producers (the target in Ray actors, docs/online-cluster.md) through a Ray cluster
# started as a user starts one, the producers placed by the node's resources on device 0 (half of
# it each), the trainer ranks on the other devices: two ranks (DDP) with 3+ devices, else one (on
# device 1, or sharing device 0). The cluster is this script's own (its own temp dir and port),
# stopped by its process group at exit, never `ray stop`.
RAY_TMP=$(mktemp -d /tmp/dsray.XXXXXX)
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0  # this machine's own cluster (a real one: its token)
RAY_PORT=${RAY_PORT:-6390}
CUDA_VISIBLE_DEVICES=0 setsid .venv/bin/ray start --head --block --port=$RAY_PORT --temp-dir="$RAY_TMP" \
    --include-dashboard=false --disable-usage-stats --num-gpus=1 --resources='{"producer_node": 2}' \
    > "$OUT/ray-head.log" 2>&1 &
RAY_PID=$!
trap 'kill -9 -- -$RAY_PID 2>/dev/null || true' EXIT
for _ in $(seq 60); do grep -q "Ray runtime started" "$OUT/ray-head.log" && break; sleep 1; done
address=$(grep -o "ray start --address='[^']*'" "$OUT/ray-head.log" | head -1 | cut -d"'" -f2)
[ -n "$address" ] || { echo "gpu_check_online: the Ray head did not start; see $OUT/ray-head.log" >&2; exit 1; }
ranks=1; rank_devices=0; hf_launch=(.venv/bin/python)
[ "$ngpu" -ge 2 ] && rank_devices=1
if [ "$ngpu" -ge 3 ]; then ranks=2; rank_devices=1,2
    hf_launch=(.venv/bin/accelerate launch --multi_gpu --num_processes 2); fi
t3=$(date +%s)
CUDA_VISIBLE_DEVICES=$rank_devices "${hf_launch[@]}" recipes/train.py "${common[@]}" "data=$OUT/prepared" \
    "output_dir=$OUT/online-hf" online.engine=hf online.store_dtype=bfloat16 "online.address=$address" \
    "online.producer_resources={producer_node: 1, GPU: 0.5}" online.data_parallel_size=2 2>&1 \
    | tee "$OUT/online-hf.log" | { grep -E "online: buffer|trainer-bound|producer-bound|error" || true; }
t4=$(date +%s)
.venv/bin/python - "$OUT" $((t4 - t3)) $ranks <<'PY'
import json, sys
out, wall, ranks = sys.argv[1], int(sys.argv[2]), sys.argv[3]
r = json.load(open(f"{out}/online-hf/train_report.json"))
line = r["final"]["online"]
busy = r["seconds"] - line["trainer_wait_s"]
print(f"online (2 hf producers, {ranks} rank(s), Ray cluster): {wall} s wall, {r['tokens'] / wall:.0f} trained tok/s; "
      f"producers {line['producer_tokens_per_s']:.0f} tok/s, trainer {r['tokens'] / busy:.0f} tok/s while not "
      f"waiting; trainer waited {line['trainer_wait_s']:.1f} s, producers {line.get('producer_blocked_s', 0):.1f} s "
      f"({line['bound']}); buffer peak {line.get('buffer_peak_tokens')} tokens")
PY

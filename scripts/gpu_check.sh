#!/usr/bin/env bash
# GPU check: ResNet-34 at 32x32 on CIFAR-100-shaped random data (no download), 10
# clients, E = 1, a few rounds each with 1.0, 0.5 and 0.25 GPU per client in fp32,
# then 0.25 GPU per client with bf16 autocast and channels-last, and with precision
# "auto" (bf16 where the GPU has it) and channels-last. Prints per setting
# the first and the steady round time, training images/s and the peak GPU memory of
# one client process. Sized for about 5 minutes on one recent GPU. Exits non-zero
# when any setting failed (its log is kept in the work folder it prints).
#
#   bash scripts/gpu_check.sh
#   ROUNDS=2 SETTINGS="0.5:fp32" bash scripts/gpu_check.sh
#   DEVICE=cpu MODEL=cnn TRAIN=2000 SETTINGS="0:fp32" bash scripts/gpu_check.sh  # dry run
#
# Environment: DEVICE (cuda), MODEL (resnet34), CLIENTS (10), ROUNDS (3), EPOCHS (1),
# TRAIN / TEST (50000 / 10000 synthetic images), SETTINGS (space-separated
# "<gpus per client>:<precision>[:cl]", cl = channels-last), WORK (the folder for data,
# runs and logs; a new temporary one by default).
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-resnet34}
CLIENTS=${CLIENTS:-10}
ROUNDS=${ROUNDS:-3}
EPOCHS=${EPOCHS:-1}
TRAIN=${TRAIN:-50000}
TEST=${TEST:-10000}
SETTINGS=${SETTINGS:-"1.0:fp32 0.5:fp32 0.25:fp32 0.25:bf16:cl 0.25:auto:cl"}
PYTHON=${PYTHON:-python}

if [ -n "${WORK:-}" ]; then
    mkdir -p "$WORK"
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/fedspc-gpu-check-XXXXXX")
fi
export FEDSPC_CACHE_DIR="$WORK/cache"
"$PYTHON" scripts/synthetic_cifar.py "$WORK/data" --train "$TRAIN" --test "$TEST" >/dev/null
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available())"

for setting in $SETTINGS; do
    IFS=: read -r gpus precision layout <<<"$setting"
    channels_last=false
    [ "${layout:-}" = cl ] && channels_last=true
    name="g${gpus}-${precision}$([ "$channels_last" = true ] && echo -cl || true)"
    monitor=""
    if [ "$DEVICE" = cuda ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
            -lms 500 >"$WORK/$name.gpu.csv" 2>/dev/null &
        monitor=$!
    fi
    echo "== $name: $CLIENTS clients, $gpus GPU per client, $precision, channels-last $channels_last"
    "$PYTHON" scripts/benchmark.py --clients "$CLIENTS" --client-cpus 1 \
        --client-gpus "$gpus" --rounds "$ROUNDS" --json "$WORK/$name.json" \
        --log "$WORK/$name.log" \
        --set "dataset='cifar100' model='$MODEL' data-dir='$WORK/data' download=false
               device='$DEVICE' local-epochs=$EPOCHS precision='$precision'
               channels-last=$channels_last method='fedrep' fedspc=true" \
        || echo "   failed$([ -s "$WORK/$name.log" ] && echo ": see $WORK/$name.log" || true)"
    if [ -n "$monitor" ]; then kill "$monitor" 2>/dev/null || true; fi
done

"$PYTHON" - "$WORK" $SETTINGS <<'PY'
import csv, json, sys
from pathlib import Path

work = Path(sys.argv[1])
failed = []
print(f"\n{'setting':<18} {'round 1 s':>9} {'steady s':>9} {'images/s':>9} {'GPU MiB/client':>15}")
for setting in sys.argv[2:]:
    gpus, precision, *layout = setting.split(":")
    name = f"g{gpus}-{precision}" + ("-cl" if layout == ["cl"] else "")
    try:
        rounds = json.loads((work / f"{name}.json").read_text())["flower"]
    except (OSError, ValueError):
        print(f"{name:<18} failed")
        failed.append(name)
        continue
    steady = rounds[1:] or rounds
    seconds = sum(r["round-seconds"] for r in steady) / len(steady)
    images = sum(r["train-images"] for r in steady) / len(steady)
    memory = "n/a"
    usage = work / f"{name}.gpu.csv"
    if usage.exists():
        peaks = {}
        for row in csv.reader(usage.read_text().splitlines()):
            if len(row) == 2 and row[1].strip().isdigit():
                peaks[row[0]] = max(peaks.get(row[0], 0), int(row[1]))
        memory = str(max(peaks.values())) if peaks else "n/a"
    print(f"{name:<18} {rounds[0]['round-seconds']:>9.2f} {seconds:>9.2f} "
          f"{images / seconds:>9.0f} {memory:>15}")
print(f"runs, logs and GPU samples in {work}")
if failed:
    sys.exit(f"failed settings: {' '.join(failed)} (see the lines above)")
PY

#!/usr/bin/env bash
# The checks a session with a lent GPU runs, in one call (the device tool's `run`, from the
# repository root): the CUDA tests, the benchmarks on the GPU, and a stop-and-resume of
# offload-train on the GPU compared with an uninterrupted run. Logs go to $OUT (the device tool's
# folder that comes back), a short table last.
#
#     bash scripts/gpu_checks.sh tests           # on the GPU machine: one call of the device tool
#     bash scripts/gpu_checks.sh train           # ...the stop-and-resume in another
#     bash scripts/gpu_checks.sh bench           # ...and the benchmarks in a third (each call <= 600 s)
#     DEVICE=cpu bash scripts/gpu_checks.sh train   # the same plumbing on a machine without one
#
# Nothing is installed: the repository is put on PYTHONPATH (the GPU machine's python3 holds
# torch, aiofiles, psutil, pytest, safetensors and transformers). Each step has its own time limit
# and the script goes on after a failure, so that one call brings back every result it can.
set -u
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d)
declare -a SUMMARY=()

step() {  # step NAME SECONDS COMMAND...: run it, its output to $OUT/NAME.txt, its status to the table
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local status=$?
    SUMMARY+=("$(printf '%-22s exit %-3s %4ss  %s' "$name" "$status" "$((SECONDS - start))" "$(tail -n 1 "$OUT/$name.txt" | cut -c1-90)")")
}

step environment 60 python3 -c "
import torch, sys
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)
print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
nvidia-smi >>"$OUT/environment.txt" 2>&1

PARTS=" ${*:-tests train bench} "
wants() { [[ "$PARTS" == *" $1 "* ]]; }

if wants tests && [ "$DEVICE" = cuda ]; then
    step pytest_cuda 540 python3 -m pytest -q -m cuda -p no:cacheprovider tests
fi
if wants bench; then
step bench_compute_bound 150 python3 scripts/bench_offload.py --device "$DEVICE" --nvme-dir "$WORK/swap" --json
step bench_io_bound 120 python3 scripts/bench_offload.py --config io-bound --device "$DEVICE" --nvme-dir "$WORK/swap" --json
step bench_gpt2_124m 240 python3 scripts/bench_offload.py --config gpt2-124m --compare-plain --rounds 1 \
    --device "$DEVICE" --nvme-dir "$WORK/swap" --json
fi

# offload-train on the tiny preset (on the GPU: its batches taken to the device, a pinned checkpoint
# buffer made again at every save): 4 steps, then resumed to 6, against 6 in one go; the losses of
# steps 5 and 6 must be equal (the model's, data order's and random generators' state, the GPU's
# included, all come back from the checkpoint).
if wants train; then
mkdir -p "$WORK/corpus"
python3 - "$WORK/corpus/a.txt" <<'EOF'
import random, sys
random.seed(0)
words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jugglers".split()
open(sys.argv[1], "w").write("\n".join(" ".join(random.choice(words) for _ in range(40)) for _ in range(400)))
EOF
train=(python3 -m offload_trainer --model.preset tiny --data.path "$WORK/corpus" --data.seq_len 64
       --data.batch_size 4 --train.checkpoint_every 2 --train.eval_batches 1
       --tiers.nvme_dir "$WORK/swap_train" --no-progress)
# offload-plan on the same model: the machine's rates and the compute probe, timed on the GPU.
step plan 120 env OFFLOAD_TRAINER_CACHE="$WORK/machine.json" python3 -c \
    "import sys; from offload_trainer.app.plan_cli import main; sys.exit(main(sys.argv[1:]))" \
    --model.preset tiny --data.seq_len 64 --data.batch_size 4 --tiers.nvme_dir "$WORK/swap_plan" --device "$DEVICE"
step train_straight 180 "${train[@]}" --train.out_dir "$WORK/straight" --train.steps 6
# The same run again: where its losses differ from the first's, the GPU's kernels are not
# deterministic here, and a resume that differs says nothing about the resume itself.
step train_straight_again 180 "${train[@]}" --train.out_dir "$WORK/straight_again" --train.steps 6
step train_first_part 120 "${train[@]}" --train.out_dir "$WORK/resumed" --train.steps 4
step train_resumed 120 "${train[@]}" --train.out_dir "$WORK/resumed" --train.steps 6 --resume latest
step train_compare 30 python3 - "$WORK/straight/metrics.jsonl" "$WORK/resumed/metrics.jsonl" \
    "$WORK/straight_again/metrics.jsonl" <<'EOF'
import json, sys
def losses(path):
    try:
        rows = [json.loads(line) for line in open(path) if line.strip()]
    except OSError:
        return {}
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}
a, b, again = (losses(p) for p in sys.argv[1:4])
same = [s for s in (5, 6) if s in a and s in b and a[s] == b[s]]
repeatable = all(s in a and s in again and a[s] == again[s] for s in range(1, 7))
print("straight", {s: a.get(s) for s in (5, 6)}, "resumed", {s: b.get(s) for s in (5, 6)},
      "straight again", {s: again.get(s) for s in (5, 6)})
print("run to run " + ("equal" if repeatable else "DIFFERS (kernels not deterministic)") + "; "
      + ("resume equal" if len(same) == 2 else "resume DIFFERS"))
sys.exit(0 if len(same) == 2 else 1)
EOF
fi

rm -rf "$WORK"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"

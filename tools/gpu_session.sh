#!/usr/bin/env bash
# Everything that needs a GPU, in one pass that fits a short lease of a GPU machine (docs/gpu.md).
#
#   bash tools/gpu_session.sh [SECONDS] [--from STAGE] [--until STAGE]   # on a GPU (570 s)
#   bash tools/gpu_session.sh --rehearse                 # every stage on the CPU, tiny (CI)
#
# Run from the checkout's root with a python3 (or $PYTHON) that has torch, torchvision, triton
# and pycocotools for the GPU. The open GPU questions first, each stage with its own time limit
# (or what is left of the deadline, if less):
#   capture         180 s  the graphed settings (baseline and 4-bit DropIT, the backbone
#                          compiled with Inductor's reduce-overhead mode: a CUDA graph per size
#                          bucket) at 2 and 8 images, both orientations: the first steps one by
#                          one (compile, CUDA graph recording), then steady ones; from the
#                          machine's empty compile cache, which it fills for the next two;
#                          each bucket's row kept as it comes
#   graphed_2img    120 s  the GPU table at 2 images of 800 px, AMP fp16, on the trained
#                          workload (a trained detector's positive RoIs): baseline and quant_4bit
#                          eager and graphed, and the quant recipe (quant_4bit_predictors), in
#                          alternating rounds with their spread and peaks
#   graphed_8img    150 s  the same at 8 images, with accumulate_2, checkpoint_stages and
#                          quant_2bit in the same rounds (the 8-image Pareto)
#   budget_probe     90 s  train.memory_budget's probe at 2 and 8 images on the table's batch:
#                          its choice at 16 GB, its wall time, its peaks beside the table's
#   deterministic_pair 150 s  train.deterministic: two short runs of one seed, losses compared,
#                          and one without the key for its step cost
# then the GPU test tier and the kernels compiled for the GPU (side by side), and the rest as
# before: issue 39's table with its largest batch (with DROPIT_KERNELS=eager if it fails within
# a minute), the compiled rows, the table's other rows, the fused packs, the from-scratch rows,
# the v2 heads. --from STAGE starts there (a second call on a warm machine, when the first ran
# out of time; a device call may not run longer than 10 minutes), --until STAGE stops before it.
#
# Into $OUT (default gpu_out), at most four files at any time, as a lease hands back few:
# summary.txt (versions, then one line per stage: outcome, seconds, limit, command), lease.tar
# (each finished stage's log and JSON, added as the stage ends: a lease that ends mid-way keeps
# them) and the running stage's log. The JSON files are also kept in $WORK (default: a new temp
# folder), where later stages read them. `python tools/results_page.py --lease $OUT` puts them
# into docs/results/gpu_<gpu>_<date>/ and writes the pages. A copy whose .git is not the tree's
# own names the tree's commit with RCNN_DROPIT_COMMIT=<hash>.
#
# --rehearse runs every stage's own command below on the CPU at tiny sizes (tests/instruments/
# test_gpu_session.py, in make test): only the variables of the first if differ (64 px, 1 and 2
# images, one round of one step, two training steps, limits x10; every bench model ResNet-18 and
# narrow through tests/instruments/rehearse_stage.py; torch.compile off; the later tables
# memory-only; pytest collects instead of running), so a flag, a setting's name, a file or a
# writer that would fail on the GPU fails there first. One interpreter imports torch once and
# runs each command in a fork of itself, as python would run it (rehearse_stage.py --serve):
# the rehearsal pays for the stages' work, not for 40 imports.
set -u
rehearse=0
from=""
until=""
budget=""
while [ $# -gt 0 ]; do
  case $1 in
  --rehearse) rehearse=1 ;;
  --from) from=$2 && shift ;;
  --until) until=$2 && shift ;;
  *) budget=$1 ;;
  esac
  shift
done
budget=${budget:-$([ "$rehearse" = 1 ] && echo 3600 || echo 570)}
OUT=${OUT:-gpu_out}
cleanup=""
if [ -z "${WORK:-}" ]; then
  WORK=$(mktemp -d)
  cleanup='rm -rf "$WORK"'  # its files are in lease.tar by then
fi
trap 'eval "$cleanup"' EXIT
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
rm -f "$OUT/lease.tar"  # this call's stages only, as its summary.txt
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "$rehearse" = 1 ]; then
  DEVICE=cpu AMP=bf16 SIZE=64 FEW=1 MANY=2 SIZES=1 MID=1 REPEATS=1 ROUNDS=1 TIMES=1 STEADY=1
  ITERS=2 BATCH_LIMIT=2 WORKERS=0 COLLECT=--collect-only REST_REPEATS=0 SLACK=10
  RUN="$PYTHON tests/instruments/rehearse_stage.py"
  PAIR_SIZE="data.shapes.num_train=8 data.shapes.num_val=2 data.shapes.image_size=64"
  PAIR_SIZE="$PAIR_SIZE model.min_size=64 model.max_size=64 solver.batch_size=2"
  PAIR_SIZE="$PAIR_SIZE solver.warmup_iters=1 data.num_workers=0"
  # One interpreter imports torch; every command of $RUN runs in a fork of it, as python would
  # run it (tests/instruments/rehearse_stage.py), and so do the interpreters a command starts.
  # Its allocator is set as tools/bench.py sets its own (which then need not start again).
  export OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1 MALLOC_MMAP_THRESHOLD_=65536 \
    REHEARSE_SOCKET=$(mktemp -d)/rehearse.sock
  $PYTHON tests/instruments/rehearse_stage.py --serve "$REHEARSE_SOCKET" &
  cleanup="kill $! && wait $!; rm -rf '${REHEARSE_SOCKET%/*}'; $cleanup"
else
  DEVICE=cuda AMP=fp16 SIZE=800 FEW=2 MANY=8 SIZES="2 8" MID=4 REPEATS=2 ROUNDS=5 TIMES=10
  STEADY=5 ITERS=30 BATCH_LIMIT=128 WORKERS=6 COLLECT="" REST_REPEATS=2 SLACK=1
  RUN=$PYTHON
  PAIR_SIZE="data.num_workers=2 data.shapes.num_val=8"  # its evaluation at the end: 8 images
fi
start=$(date +%s)
summary="$OUT/summary.txt"
started=$([ -z "$from" ] && echo 1 || echo 0)
stopped=0

left() { echo $((budget - ($(date +%s) - start))); }
# cap SECONDS: a stage's own limit (times SLACK: a shared CPU's rehearsal is no GPU), or what is
# left of the deadline (less 10 s) when smaller
cap() {
  local own=$(($1 * SLACK)) rest=$(($(left) - 10))
  echo $((own < rest ? own : rest))
}

# stage NAME SECONDS CMD...: run CMD under a time limit (SIGINT first: pytest and the bench then
# print what they have), its output into NAME.log, one line of outcome into the summary.
stage() {
  local name=$1 limit=$2 t0
  shift 2
  [ "$name" = "$from" ] && started=1
  [ "$name" = "$until" ] && stopped=1
  if [ "$started" = 0 ] || [ "$stopped" = 1 ]; then
    local why="--until $until"
    [ "$started" = 0 ] && why="before --from $from"
    echo "$name: not run ($why)" >>"$summary"
    return 1
  fi
  t0=$(date +%s)
  if [ "$limit" -lt 20 ]; then
    echo "$name: skipped, $limit s left" >>"$summary"
    return 1
  fi
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(($(date +%s) - t0)) s (limit $limit s): $*" >>"$summary"
  return $rc
}

# keep NAME...: each stage's log and JSON into lease.tar (the log out of $OUT, the JSON kept in
# $WORK for the stages that read it)
keep() {
  local name
  for name in "$@"; do
    if [ -f "$OUT/$name.log" ]; then
      tar rf "$OUT/lease.tar" -C "$OUT" "$name.log" && rm "$OUT/$name.log"
    fi
    if [ -f "$WORK/$name.json" ]; then tar rf "$OUT/lease.tar" -C "$WORK" "$name.json"; fi
  done
}

{
  what=$([ "$rehearse" = 1 ] && echo " (CPU rehearsal)")
  commit=${RCNN_DROPIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
  echo "gpu_session.sh at $commit, $(date -u +%FT%TZ)$what"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
    echo "no GPU (nvidia-smi: none)"
  $PYTHON -c 'import torch, torchvision as tv; print("torch", torch.__version__, "cuda",
    torch.version.cuda, "torchvision", tv.__version__)'
  $PYTHON -c 'import importlib.metadata as m; print(*(f"{p} {m.version(p)}"
    for p in ("triton", "pycocotools")))' 2>&1 | tail -1
} >"$summary" 2>&1

# 1. The graphed rows (issue 58): capture per bucket, then the table at 2 and at 8 images.
TORCH_LOGS=perf_hints stage capture "$(cap 180)" $RUN tools/gpu_checks.py capture \
  --device $DEVICE --amp $AMP --image-size $SIZE --images $SIZES --repeats $STEADY \
  --settings baseline_graphed quant_4bit_graphed --quiet-machine --json "$WORK/capture.json"
keep capture
table=($RUN tools/bench.py gpu-table --device $DEVICE --amp $AMP --image-size $SIZE
  --rounds $ROUNDS --draws 1 --quiet-machine)
# Every row of the graphed tables trains as a run with the recipe's size buckets does.
stage graphed_2img "$(cap 120)" "${table[@]}" --size-buckets --repeats $REPEATS --batch-limit 0 \
  --images $FEW \
  --settings baseline baseline_graphed quant_4bit quant_4bit_graphed quant_4bit_predictors \
  --json "$WORK/graphed_2img.json"
keep graphed_2img
stage graphed_8img "$(cap 150)" "${table[@]}" --size-buckets --repeats $REPEATS --batch-limit 0 \
  --images $MANY --settings baseline baseline_graphed quant_4bit quant_4bit_graphed accumulate_2 \
  checkpoint_stages quant_2bit quant_4bit_predictors --json "$WORK/graphed_8img.json"
keep graphed_8img

# 2. The memory budget's probe (issue 59) against those rows' peaks, then the deterministic pair.
stage budget_probe "$(cap 90)" $RUN tools/gpu_checks.py budget --device $DEVICE --amp $AMP \
  --image-size $SIZE --images $SIZES --budget 16GB --size-buckets --quiet-machine \
  --against "$WORK/graphed_2img.json" "$WORK/graphed_8img.json" --json "$WORK/budget_probe.json"
keep budget_probe
# shellcheck disable=SC2086  # the sizes are words
stage deterministic_pair "$(cap 150)" $RUN tools/gpu_checks.py pair --device $DEVICE --amp $AMP \
  --config configs/demo/maskrcnn_shapes_quant4.yaml --iters $ITERS --workdir "$WORK/pair" \
  --json "$WORK/deterministic_pair.json" --opts "data.root=$WORK/shapes" $PAIR_SIZE
keep deterministic_pair

# 3. Values: the GPU tier and the kernels compiled for this GPU, side by side.
tier=$(($(left) * 40 / 100))
# shellcheck disable=SC2086  # COLLECT is empty or one flag
stage tests_gpu "$tier" $RUN -m pytest -m gpu -rs -p no:cacheprovider $COLLECT tests &
tiers=$!
# shellcheck disable=SC2086
stage tests_kernels "$tier" $RUN -m pytest -rs -p no:cacheprovider -n $WORKERS $COLLECT \
  tests/core/test_dropit_kernels.py tests/core/test_dropit_compact.py &
tiers="$tiers $!"
# shellcheck disable=SC2086  # two process ids (not a rehearsal's server)
wait $tiers
grep -h -E "^(=+ )?[0-9]+ (passed|failed)|^FAILED|^ERROR" "$OUT"/tests_*.log >>"$summary" \
  2>/dev/null
keep tests_gpu tests_kernels

# 4. The tables of the earlier leases. Their one-off probes (the blocks and tensors alive at the
# peak, a quant step's Python, a launch's host cost, per-pass op costs) were answered there
# (docs/results/gpu_h200_2026-11-26/, gpu_h200_2026-11-28/) and went with issue 68.
# Issue 39's rows with their largest batch; a table that fails within a minute (a kernel that
# does not compile) runs again with DROPIT_KERNELS=eager.
first="baseline quant_4bit checkpoint_stages checkpoint_stages_quant_4bit quant_2bit"
t0=$(date +%s)
# shellcheck disable=SC2086  # the settings are words
if ! stage bench_gpu $(($(left) * 40 / 100)) "${table[@]}" --repeats $REPEATS \
  --images $SIZES --max-batch 16000 --batch-limit $BATCH_LIMIT --settings $first \
  --json "$WORK/bench_gpu.json" && [ -f "$OUT/bench_gpu.log" ] &&
  [ $(($(date +%s) - t0)) -lt 60 ]; then
  DROPIT_KERNELS=eager stage bench_gpu_eager $(($(left) * 40 / 100)) "${table[@]}" \
    --repeats $REPEATS --images $SIZES --max-batch 16000 --batch-limit $BATCH_LIMIT \
    --settings $first --json "$WORK/bench_gpu_eager.json"
fi
keep bench_gpu bench_gpu_eager
# The tables below: steps and peaks only, each with a baseline of its own.
more=("${table[@]}" --repeats $REST_REPEATS --batch-limit 0)
# Issue 40's compiled rows: the backbone through Inductor (default mode), beside the eager ones.
stage bench_gpu_compiled $(($(left) * 50 / 100)) "${more[@]}" --images $SIZES \
  --settings baseline baseline_compiled quant_4bit quant_4bit_compiled \
  --json "$WORK/bench_gpu_compiled.json"
keep bench_gpu_compiled
# The rest of make bench-gpu's GPU_METHODS.
rest="baseline baseline_torchvision_forward quant_4bit_torchvision_forward baseline_torchvision_bn"
rest="$rest baseline_torchvision_fpn mink_0.8 threshold_0.8 accumulate_2 accumulate_4"
# shellcheck disable=SC2086  # the settings are words
stage bench_gpu_rest $(($(left) * 50 / 100)) "${more[@]}" --images $SIZES --settings $rest \
  --json "$WORK/bench_gpu_rest.json"
keep bench_gpu_rest
# The same backbone compiled with its packs and ReLU masks opaque, then fused into Inductor's
# Triton kernels (DROPIT_FUSE): compile seconds, kernels built, step time.
stage bench_fusion_gpu $(($(left) * 20 / 100)) $RUN tools/bench.py fusion --device $DEVICE \
  --image-size $SIZE --images $MANY --repeats $TIMES --quiet-machine \
  --json "$WORK/bench_fusion_gpu.json"
keep bench_fusion_gpu
# From scratch (BatchNorm, issue 28's coverage).
stage bench_scratch_gpu $(($(left) * 60 / 100)) "${more[@]}" --scratch --images $MID \
  --settings baseline quant_4bit quant_4bit_all saved_hooks_4bit checkpoint_stages \
  --json "$WORK/bench_scratch_gpu.json"
keep bench_scratch_gpu
# torchvision's v2 heads (a BatchNorm after every FPN and head conv) on the COCO recipe's body.
stage bench_v2_gpu $(($(left) - 5)) "${more[@]}" --heads v2 --images $MID \
  --settings baseline quant_4bit quant_4bit_all checkpoint_stages --json "$WORK/bench_v2_gpu.json"
keep bench_v2_gpu
echo "done in $(($(date +%s) - start)) s" >>"$summary"
cat "$summary"

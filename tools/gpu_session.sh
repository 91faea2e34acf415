#!/usr/bin/env bash
# Everything that needs a GPU, in one pass that fits a short lease of a GPU machine (docs/gpu.md).
#
# Run from the checkout's root on a machine whose python3 already has torch, torchvision and
# triton for its GPU: `bash tools/gpu_session.sh [SECONDS]` (default 540). In order of what
# matters most now: the live tensors at a step's peak (tools/gpu_probe.py --what live-step),
# issue 39's rows of the GPU table with their largest batch (make bench-gpu, smaller: 5 timed
# steps, 1 draw, batches searched up to 128 images), issue 40's compiled rows, then the GPU
# test tier and the kernels compiled for the GPU (side by side, both only check values), the
# table's other rows (no batch search), the host-time and fusion rows, the from-scratch rows on
# CUDA, the per-pass op costs and the other probes (the peak's blocks, a quant step's Python).
# Each stage gets what is left of the deadline, so a lease that ends early still leaves every
# finished stage's log; the GPU table writes its step columns before its batch search. If the
# table fails within a minute (a kernel that does not compile), it runs again with
# DROPIT_KERNELS=eager, into bench_gpu_eager.json. A copy whose .git is not the tree's own (a
# lease's) names the tree's commit with RCNN_DROPIT_COMMIT=<hash> for the JSON files and the
# log.txt of a training. Into $OUT (default gpu_out): summary.txt, the JSON files and logs.tgz
# (every stage's log), fewer than the 8 files a lease hands back. docs/gpu.md shows the call that ran it on an H200.
set -u
budget=${1:-540}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
summary="$OUT/summary.txt"

left() { echo $((budget - ($(date +%s) - start))); }

# stage NAME SECONDS CMD...: run CMD under a time limit (SIGINT first: pytest and the bench then
# print what they have), its output into NAME.log, one line of outcome into the summary.
stage() {
  local name=$1 limit=$2 t0
  shift 2
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

{
  echo "gpu_session.sh at ${RCNN_DROPIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, torchvision; print("torch", torch.__version__, "cuda", torch.version.cuda, "torchvision", torchvision.__version__, "triton", triton.__version__)'
  python3 -c 'import importlib.metadata as m; print("pycocotools", m.version("pycocotools"))' 2>&1 | tail -1
} >"$summary" 2>&1

# 0. The floor (issue 39), first: the tensors alive at a training step's peak by the line (or,
# in the backward, the autograd node) that made them, in the forward or the backward, where the
# CPU's bf16 proxy put every setting's peak after the lean pooler; the RoI poolers alone
# (torchvision's against the lean one's), then issue 39's rows with their largest batch (the
# search is most of the time).
# (If the probe cannot follow CUDA's backward, which runs on autograd's device thread, it says so
# and stops: then the forward alone, as on the last lease.)
stage probe_live 90 python3 tools/gpu_probe.py --what live-step --device cuda --images 8 --top 25 \
  --settings baseline quant_4bit checkpoint_stages_quant_4bit ||
  stage probe_live_forward 60 python3 tools/gpu_probe.py --what live --device cuda --images 8 \
    --top 25 --settings baseline quant_4bit checkpoint_stages_quant_4bit
stage bench_pooler_gpu 60 python3 tools/bench.py --pooler --device cuda --images 2 8 \
  --image-size 800 --repeats 10 --json "$OUT/bench_pooler_gpu.json"
table=(python3 tools/bench.py --gpu-table --device cuda --amp fp16 --image-size 800 --images 2 8
  --repeats 2 --rounds 5 --draws 1 --quiet-machine)
first="baseline quant_4bit checkpoint_stages checkpoint_stages_quant_4bit quant_2bit"
t0=$(date +%s)
# shellcheck disable=SC2086  # the settings are words
if ! stage bench_gpu $(($(left) * 40 / 100)) "${table[@]}" --max-batch 16000 --batch-limit 128 \
  --settings $first --json "$OUT/bench_gpu.json" && [ -f "$OUT/bench_gpu.log" ] &&
  [ $(($(date +%s) - t0)) -lt 60 ]; then
  DROPIT_KERNELS=eager stage bench_gpu_eager $(($(left) * 40 / 100)) "${table[@]}" \
    --max-batch 16000 --batch-limit 128 --settings $first --json "$OUT/bench_gpu_eager.json"
fi

# 0a. Issue 40's compiled rows: the backbone through Inductor, plain and 4-bit, beside the eager
# ones (no largest-batch search: each batch size would compile again). Compiling twice at two
# batch sizes took more than 40 s on an H200 (2026-11-28): half of what is left.
stage bench_gpu_compiled $(($(left) * 50 / 100)) "${table[@]}" --batch-limit 0 \
  --settings baseline baseline_compiled quant_4bit quant_4bit_compiled \
  --json "$OUT/bench_gpu_compiled.json"

# 1. Values: the GPU tier and the kernels compiled for this GPU, side by side.
tier=$(($(left) * 40 / 100))
stage tests_gpu "$tier" python3 -m pytest -m gpu -rs -p no:cacheprovider tests &
stage tests_kernels "$tier" python3 -m pytest -rs -p no:cacheprovider -n 6 \
  tests/core/test_dropit_kernels.py tests/core/test_dropit_compact.py &
wait
grep -h -E "^(=+ )?[0-9]+ (passed|failed)|^FAILED|^ERROR" "$OUT"/tests_*.log >>"$summary" 2>/dev/null

# 1a. The rest of make bench-gpu's GPU_METHODS, steps and peaks only, with a baseline of their
# own for the ratios.
rest="baseline baseline_torchvision_forward quant_4bit_torchvision_forward baseline_torchvision_bn"
rest="$rest baseline_torchvision_fpn mink_0.8 threshold_0.8 accumulate_2 accumulate_4"
# shellcheck disable=SC2086  # the settings are words
stage bench_gpu_rest $(($(left) * 50 / 100)) "${table[@]}" --batch-limit 0 --settings $rest \
  --json "$OUT/bench_gpu_rest.json"

# 1b. Issue 40's host time: the eager 4-bit step with every conv on its autograd Function
# (DROPIT_HOOKED=0), what the table's quant_4bit ran before dropit_core.layers.hooked; steps only.
DROPIT_HOOKED=0 stage bench_gpu_function $(($(left) * 20 / 100)) "${table[@]}" --batch-limit 0 \
  --settings baseline quant_4bit --json "$OUT/bench_gpu_function.json"

# 1c. The same backbone compiled with its packs and ReLU masks opaque, then fused into Inductor's
# Triton kernels (DROPIT_FUSE): compile seconds, kernels built, step time at 8 images.
stage bench_fusion_gpu $(($(left) * 20 / 100)) python3 tools/bench.py --fusion --device cuda \
  --image-size 800 --images 8 --repeats 10 --quiet-machine --json "$OUT/bench_fusion_gpu.json"

# 2. The host's cost of one launch: an aten op, a bare Triton launch, each DropIT wrapper.
stage probe_launch 90 python3 tools/gpu_probe.py --what launch

# 3. From scratch (BatchNorm, issue 28's coverage) on CUDA: step columns only.
stage bench_scratch_gpu $(($(left) - 40)) python3 tools/bench.py --gpu-table --scratch \
  --device cuda --amp fp16 --image-size 800 --images 4 --repeats 2 --rounds 5 --draws 1 \
  --batch-limit 0 --quiet-machine --settings baseline quant_4bit quant_4bit_all \
  saved_hooks_4bit checkpoint_stages --json "$OUT/bench_scratch_gpu.json"

# 4. What each pass of an element-wise pack costs on this GPU.
stage ops $(($(left) - 60)) python3 tools/bench.py --ops --device cuda

# 5. Where the peak and the host time go (tools/gpu_probe.py): the blocks alive at the peak
# with the toolkit's FPN and torchvision's, and the Python a quant step spends.
stage probe_memory $(($(left) - 30)) python3 tools/gpu_probe.py --images 8 --what memory \
  --settings baseline baseline_torchvision_fpn quant_4bit
stage probe_python $(($(left) - 90)) python3 tools/gpu_probe.py --images 2 --what python \
  --settings quant_4bit --top 40
# 6. torchvision's v2 heads (a BatchNorm after every FPN and head conv) on the COCO recipe's body.
stage bench_v2_gpu $(($(left) - 5)) python3 tools/bench.py --gpu-table --heads v2 \
  --device cuda --amp fp16 --image-size 800 --images 4 --repeats 2 --rounds 5 --draws 1 \
  --batch-limit 0 --quiet-machine --settings baseline quant_4bit quant_4bit_all \
  checkpoint_stages --json "$OUT/bench_v2_gpu.json"
echo "done in $(($(date +%s) - start)) s" >>"$summary"
if compgen -G "$OUT/*.log" >/dev/null; then (cd "$OUT" && tar czf logs.tgz ./*.log && rm ./*.log); fi
cat "$summary"

# One entry point for setup, demo, tests, benchmark and lint. CI runs `make test` (.ci/run).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-gpu gpu-session bench bench-methods bench-forward bench-bf16 bench-proxy8 bench-scratch bench-v2 bench-speed bench-gpu bench-host bench-fusion bench-demo lint format study

setup: $(STAMP)

# Re-installs only when pyproject.toml changes; torch/torchvision are pinned to the tested pair.
$(STAMP): pyproject.toml
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -e '.[test]'
	touch $@

# Trains the shapes Mask R-CNN with DropIT (data generated on first use) and prints the AP table,
# then draws 4 validation images, prediction next to ground truth, into the run's predictions.png.
# Its packs take the C loops (dropit_core/backends/native.c), or eager torch where no C compiler works.
demo: setup
	$(PY) tools/train.py --config configs/demo/maskrcnn_shapes_quant4.yaml --overwrite
	$(PY) tools/infer.py --run outputs/maskrcnn_shapes_quant4 --val 4

# Every tier (CI). test-fast: the inner loop, without the tests marked slow (training runs,
# fresh interpreters, multi-process jobs, tiny benches of a whole model), a pytest-xdist worker
# per core (4 at most), the fuzz tests at 50 examples instead of 200, and the checkout's bytecode
# cached (collection halves on a second run where PYTHONDONTWRITEBYTECODE is set): 81 s on 2
# quiet cores (`time make test-fast`, 2026-11-27; 162 s serial, as `make test` runs them).
test: setup
	$(PY) -m pytest

test-fast: setup
	PYTHONDONTWRITEBYTECODE= RCNN_DROPIT_FUZZ_EXAMPLES=50 \
		$(PY) -m pytest -m "not slow" -n auto --maxprocesses 4

# On a machine with a CUDA GPU: the CUDA paths (ops against CPU, AMP, CUDA memory, NCCL, training).
test-gpu: setup
	$(PY) -m pytest -m gpu -rs

# On a machine with a GPU: the pass every GPU lease runs (tools/gpu_session.sh; docs/gpu.md#on-
# your-own-gpu): the open GPU questions first (graphed rows, the budget's probe, the deterministic
# pair), then the test tier and the earlier tables, within GPU_SECONDS, into gpu_out/; then its
# files into docs/results/gpu_<gpu>_<date>/ and the results page from them.
GPU_SECONDS ?= 1800
gpu-session: setup
	OUT=gpu_out PYTHON=$(abspath $(PY)) bash tools/gpu_session.sh $(GPU_SECONDS)
	$(PY) tools/results_page.py --lease gpu_out

bench: setup
	$(PY) tools/bench.py steps

# Every method of the toolkit on the R50 recipe, each named as the study's setting
# (configs/study/plan.yaml): memory, step and eval time, gradient cosine, norm ratio and bias over
# DRAWS seeded draws. Writes docs/results/cpu_methods/methods.json, its table into
# docs/results/memory.md, and the results page (docs/results/README.md, with README.md's and
# docs/choosing.md's blocks). A quarter hour on 2 quiet cores; QUIET=1 records that nothing else ran.
METHODS := baseline mink_0.8 threshold_0.8 random_0.8 random_scaled_0.8 importance_0.8 \
	quant_2bit quant_4bit quant_4bit_predictors quant_8bit mink_0.8_backbone mink_0.8_backbone_quant_4bit_heads \
	checkpoint_stages checkpoint_stages_quant_4bit baseline_torchvision_bn accumulate_2 \
	baseline_torchvision_forward quant_4bit_torchvision_forward
DRAWS ?= 4
REPEATS ?= 2
bench-methods: setup
	$(PY) tools/bench.py steps --settings $(METHODS) --draws $(DRAWS) --repeats $(REPEATS) \
		--json docs/results/cpu_methods/bench.json \
		--methods-json docs/results/cpu_methods/methods.json $(if $(QUIET),--quiet-machine)
	$(PY) tools/bench.py markdown docs/results/cpu_methods/methods.json --into docs/results/memory.md
	$(PY) tools/results_page.py

# The GPU table's setting on the CPU: 8 images of 800 px under bf16, the trained workload,
# memory only (tensors' bytes: exact on a busy machine; a step of 8 images takes minutes here).
PROXY_METHODS := baseline quant_4bit quant_2bit checkpoint_stages checkpoint_stages_quant_4bit \
	accumulate_2
bench-proxy8: setup
	$(PY) tools/bench.py steps --amp bf16 --image-size 800 --images 8 --settings $(PROXY_METHODS) \
		--draws 1 --repeats 0 --json docs/results/cpu_proxy8/bench.json \
		--methods-json docs/results/cpu_proxy8/methods.json
	$(PY) tools/bench.py markdown docs/results/cpu_proxy8/methods.json \
		--into docs/results/memory.md --block step-peak-bf16-trained
	$(PY) tools/results_page.py

# What autocast does to the baselines without a GPU: bf16 on the CPU, R50-FPN at 2 images of
# 384 px, torchvision's FrozenBatchNorm2d (fp32 activations) against the lean one. With these 8
# settings more than half an hour on 2 quiet cores (runs stopped unfinished at 31 min, 2026-11-27,
# and at 87 min, 2026-11-28: plan a longer quiet window). Memory alone (--repeats 0, which any
# load beside it leaves exact) gave 4 of the 8 rows in 53 min beside tests, 2026-11-28.
BF16_METHODS := baseline baseline_torchvision_bn baseline_torchvision_forward accumulate_2 quant_4bit \
	quant_2bit checkpoint_stages checkpoint_stages_quant_4bit
bench-bf16: setup
	mkdir -p docs/results/cpu_bf16_384
	$(PY) tools/bench.py steps --amp bf16 --image-size 384 --settings $(BF16_METHODS) --draws 2 \
		--repeats 2 --json docs/results/cpu_bf16_384/bench.json \
		--methods-json docs/results/cpu_bf16_384/methods.json $(if $(QUIET),--quiet-machine)
	$(PY) tools/bench.py markdown docs/results/cpu_bf16_384/methods.json \
		--into docs/results/memory.md --block methods-bench-bf16

# The forward's working set (issue 39's rows): the toolkit's lean forward against torchvision's,
# with and without 4-bit DropIT, and the combinations, on the COCO recipe at 2 images of 800 px
# (RSS that follows live memory: large blocks mmapped). 26 minutes on 2 quiet cores (2026-11-27).
FORWARD_METHODS := baseline baseline_torchvision_forward quant_4bit quant_4bit_torchvision_forward \
	quant_2bit checkpoint_stages checkpoint_stages_quant_4bit
bench-forward: setup
	mkdir -p docs/results/cpu_forward_800
	$(PY) tools/bench.py steps --image-size 800 --settings $(FORWARD_METHODS) \
		--draws 1 --repeats 3 --json docs/results/cpu_forward_800/bench.json \
		--methods-json docs/results/cpu_forward_800/methods.json $(if $(QUIET),--quiet-machine)
	$(PY) tools/bench.py markdown docs/results/cpu_forward_800/methods.json \
		--into docs/results/memory.md --block methods-bench-forward

# From scratch (R50-FPN, BatchNorm, every stage trainable): the conv-only 4-bit setting against
# every saved activation at 4 bits (norm inputs, one-byte max-pool, no layer excluded), and the
# same through saved-tensor hooks alone (no layer converted).
SCRATCH_METHODS := baseline quant_4bit quant_4bit_all saved_hooks_4bit checkpoint_stages
bench-scratch: setup
	mkdir -p docs/results/cpu_scratch_512
	$(PY) tools/bench.py steps --scratch --settings $(SCRATCH_METHODS) --draws 2 --repeats 3 \
		--json docs/results/cpu_scratch_512/bench.json \
		--methods-json docs/results/cpu_scratch_512/methods.json $(if $(QUIET),--quiet-machine)
	$(PY) tools/bench.py markdown docs/results/cpu_scratch_512/methods.json \
		--into docs/results/memory.md --block methods-bench-scratch

# The COCO recipe's body (frozen BatchNorm, 3 trainable stages) with torchvision's v2 heads (a
# BatchNorm after every FPN and head conv): the same rows as bench-scratch.
bench-v2: setup
	mkdir -p docs/results/cpu_v2_512
	$(PY) tools/bench.py steps --heads v2 --settings $(SCRATCH_METHODS) --draws 2 --repeats 3 \
		--json docs/results/cpu_v2_512/bench.json \
		--methods-json docs/results/cpu_v2_512/methods.json $(if $(QUIET),--quiet-machine)
	$(PY) tools/bench.py markdown docs/results/cpu_v2_512/methods.json \
		--into docs/results/memory.md --block methods-bench-v2

# The CPU step time of the recommended setting and the paper's, against the baseline, on the COCO
# recipe (issue target: quant 4-bit at most 1.10x); five timed steps per side.
bench-speed: setup
	mkdir -p docs/results/cpu_speed_512
	$(PY) tools/bench.py steps --settings baseline quant_4bit mink_0.8 --draws 1 --repeats 5 \
		--json docs/results/cpu_speed_512/bench.json \
		--methods-json docs/results/cpu_speed_512/methods.json $(if $(QUIET),--quiet-machine)
	$(PY) tools/bench.py markdown docs/results/cpu_speed_512/methods.json \
		--into docs/results/memory.md --block methods-bench-speed

# make demo's step with its DropIT section against the same model without DropIT, side by side
# on one batch of its data, and the DropIT model again with eager packs instead of the C loops,
# 20 rounds (about two minutes): docs/results/cpu_demo/bench.json.
bench-demo: setup
	$(PY) tools/bench.py demo --repeats 20 --json docs/results/cpu_demo/bench.json \
		$(if $(QUIET),--quiet-machine)

# Host time per DropIT layer on the GPU path, with the Triton launches stubbed (any machine; run
# it on a quiet one): docs/results/cpu_host/bench.json and its table in docs/results/memory.md.
bench-host: setup
	$(PY) tools/bench.py host --repeats 31 --json docs/results/cpu_host/bench.json
	$(PY) tools/bench.py markdown docs/results/cpu_host/bench.json --into docs/results/memory.md \
		--block bench-host

# train.compile's backbone (lean R18-FPN, 4-bit DropIT) with its packs and ReLU masks opaque, then
# fused into Inductor's kernels (DROPIT_FUSE), each compiled from an empty cache: compile seconds,
# kernels built, step time. docs/results/cpu_fusion/bench.json and its table in memory.md.
bench-fusion: setup
	$(PY) tools/bench.py fusion --image-size 128 --repeats 10 \
		--json docs/results/cpu_fusion/bench.json $(if $(QUIET),--quiet-machine)
	$(PY) tools/bench.py markdown docs/results/cpu_fusion/bench.json \
		--into docs/results/memory.md --block bench-fusion

# On a machine with a GPU: one row per setting against the lean baseline (AMP fp16, 800 px;
# torchvision's norm, gradient accumulation and checkpointing as rows): step time and CUDA peak at
# 2 and 8 images, kernel launches and host syncs per step (torch.profiler), and the largest batch
# each trains in BUDGET_MB (default 16000), searched up to BATCH_LIMIT images (meant to be above
# what any setting reaches; a row at the limit says so). Writes LEASE/bench_gpu.json (default
# docs/results/gpu_<gpu>_<date>, e.g. gpu_h200_2026-11-28: one folder per GPU and day, with the
# GPU's name and the torch, CUDA and triton versions inside), then the results page from the
# newest such folder (docs/results/README.md, README.md's, docs/choosing.md's, docs/gpu.md's blocks).
BUDGET_MB ?= 16000
BATCH_LIMIT ?= 512
GPU_METHODS := baseline baseline_torchvision_forward quant_4bit quant_2bit checkpoint_stages \
	checkpoint_stages_quant_4bit quant_4bit_torchvision_forward baseline_torchvision_bn \
	baseline_torchvision_fpn mink_0.8 threshold_0.8 accumulate_2 accumulate_4
bench-gpu: setup
	$(eval LEASE := $(or $(LEASE),$(shell $(PY) tools/results_page.py --lease-dir)))
	mkdir -p $(LEASE)
	$(PY) tools/bench.py gpu-table --device cuda --amp fp16 --image-size 800 --images 2 8 \
		--settings $(GPU_METHODS) --repeats 2 --rounds 5 --draws 2 --max-batch $(BUDGET_MB) \
		--batch-limit $(BATCH_LIMIT) --json $(LEASE)/bench_gpu.json
	$(PY) tools/results_page.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The accuracy study (configs/study/plan.yaml: a pretraining run and five regimes, about 120 CPU
# runs, two at a time; tens of hours here, docs/results/shapes.md's time account) in the
# background; resumable: run it again to continue where it stopped.
study: setup
	mkdir -p outputs/study
	nohup $(PY) tools/study.py --plan configs/study/plan.yaml --jobs 2 >> outputs/study/study.log 2>&1 &
	@echo "study running in the background: tail -f outputs/study/study.log"

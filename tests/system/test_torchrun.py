"""Real torchrun jobs on CPU (gloo): a 2-process Mask R-CNN + DropIT run, distributed evaluation
equal to single-process evaluation, two "nodes" on loopback, one DDP step equal to a
single-process step, and an elastic restart after a worker is killed.

Every job is `python -m torch.distributed.run` in a subprocess with OMP_NUM_THREADS=1, on a free
port, with 64 px images, ResNet-18 and num_workers=0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from rcnn_dropit.checkpoint.files import find_last_checkpoint, load_checkpoint
from rcnn_dropit.config import load_config
from rcnn_dropit.engine import runner
from rcnn_dropit.metrics_file import read_metrics
from rcnn_dropit.models import build_model
from rcnn_dropit.rng import seed_all
from tests.helpers import (
    FASTER_CFG,
    MASK_DROPIT_CFG,
    REPO,
    TEST_PY,
    TRAIN_PY,
    free_port,
    job_env,
    single_node,
    sorted_results,
    torchrun,
    train_records,
)
from tests.helpers import tiny_opts as shared_tiny_opts

JOB_TIMEOUT_S = 300
pytestmark = [pytest.mark.slow, pytest.mark.dist]


def run_job(cmd: list[str]) -> str:
    """Run a job to the end; its output (all ranks and the launcher) if it succeeded."""
    proc = subprocess.run(
        cmd,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-4000:]}"
    return proc.stdout


def shapes_opts(root: Path, *extra: str) -> list[str]:
    """A seconds-long CPU run on the shapes set: 8 train / 3 val images of 64 px (an odd count:
    2 ranks evaluate 2 + 1 images, where padding would evaluate one twice)."""
    return shared_tiny_opts(root, "solver.warmup_iters=0", *extra, num_val=3, batch_size=1)


def twin_opts(root: Path, batch_size: int, *extra: str) -> list[str]:
    """Faster R-CNN on the twin set (see twin_root) where one SGD step is batch-split exact:
    frozen BatchNorm, no flip, no warmup, no clipping, and sampler sizes above the anchor and
    proposal counts of a 64 px image, so every anchor and proposal is taken."""
    return [
        "data.dataset=coco",
        f"data.root={root}",
        "data.train_images=train",
        "data.train_ann=annotations/instances_train.json",
        "data.val_images=val",
        "data.val_ann=annotations/instances_val.json",
        "data.num_workers=0",
        "data.hflip_prob=0",
        "model.num_classes=4",
        "model.norm=frozen_bn",
        "model.min_size=64",
        "model.max_size=64",
        "model.rpn_batch_size_per_image=4096",
        "model.box_batch_size_per_image=4096",
        "model.box_detections_per_img=20",
        f"solver.batch_size={batch_size}",
        "solver.warmup_iters=0",
        "solver.clip_grad_norm=null",
        "train.device=cpu",
        "train.log_every=1",
        "train.eval_every=0",
        "train.measure_memory=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def shapes_root(shapes_set) -> Path:
    """The tiny set with 3 validation images: two ranks evaluate an unequal share."""
    return shapes_set(num_val=3)


@pytest.fixture(scope="module")
def twin_root(tmp_path_factory, shapes_root) -> Path:
    """Two training images with the same pixels and boxes but different classes.

    Same pixels and boxes: each image has the same anchors, labels and proposals, hence the same
    counts that R-CNN losses are normalised by. Different classes: the two ranks' box-head
    gradients differ, so a rank that did not contribute would change the averaged step.
    """
    root = tmp_path_factory.mktemp("data") / "twin"
    (root / "annotations").mkdir(parents=True)
    doc = json.loads((shapes_root / "annotations/instances_train2017.json").read_text())
    image = next(
        im for im in doc["images"] if any(a["image_id"] == im["id"] for a in doc["annotations"])
    )
    anns = [a for a in doc["annotations"] if a["image_id"] == image["id"]]
    (root / "train").mkdir()
    images, annotations = [], []
    for twin in (1, 2):
        shutil.copy(shapes_root / "train2017" / image["file_name"], root / "train" / f"{twin}.png")
        images.append({**image, "id": twin, "file_name": f"{twin}.png"})
        for ann in anns:
            category = ann["category_id"] if twin == 1 else ann["category_id"] % 3 + 1
            annotations.append(
                {**ann, "id": len(annotations) + 1, "image_id": twin, "category_id": category}
            )
    doc.update(images=images, annotations=annotations)
    (root / "annotations/instances_train.json").write_text(json.dumps(doc))
    # One validation image (the first twin) keeps the evaluation at the end short.
    (root / "val").mkdir()
    shutil.copy(root / "train/1.png", root / "val/1.png")
    doc.update(images=images[:1], annotations=[a for a in annotations if a["image_id"] == 1])
    (root / "annotations/instances_val.json").write_text(json.dumps(doc))
    return root


# ---- 2 processes, one node ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mask_run(tmp_path_factory, shapes_root) -> tuple[Path, str]:
    """Mask R-CNN + DropIT gamma=0.8, 2 processes x 1 image, 2 iterations, then evaluation."""
    run = tmp_path_factory.mktemp("mask") / "run"
    opts = shapes_opts(shapes_root, "solver.max_iters=2")
    args = ["--config", str(MASK_DROPIT_CFG), "--output-dir", str(run), "--opts", *opts]
    return run, run_job(torchrun(single_node(), TRAIN_PY, args))


def test_two_process_maskrcnn_dropit_run(mask_run, shapes_root) -> None:
    run, output = mask_run
    # Rank 0 alone writes and prints: exactly the run files, each line once.
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == [
        "checkpoints",
        "checkpoints/last_checkpoint",
        "checkpoints/model_0000002.pth",
        "coco_results_bbox.json",
        "coco_results_segm.json",
        "config.yaml",
        "eval.json",
        "log.txt",
        "metrics.jsonl",
    ]
    assert (
        output.count("training maskrcnn for 2 iterations (4 per epoch, 2 process(es) on cpu)") == 1
    )
    assert output.count("final evaluation (3 images)") == 1
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["type"], r["iter"]) for r in records] == [("train", 1), ("train", 2), ("eval", 2)]
    assert records[0]["images_per_sec"] > 0 and records[0]["loss_mask"] > 0
    # Every validation image evaluated exactly once over the two ranks.
    val_doc = json.loads((shapes_root / "annotations/instances_val2017.json").read_text())
    val_ids = {im["id"] for im in val_doc["images"]}
    final = json.loads((run / "eval.json").read_text())
    assert final["num_images"] == len(val_ids) == 3 and final["iter"] == 2
    assert {
        r["image_id"] for r in json.loads((run / "coco_results_bbox.json").read_text())
    } <= val_ids
    assert "dropit:\n  enabled: true" in (run / "config.yaml").read_text()
    state = load_checkpoint(run / "checkpoints/model_0000002.pth")
    assert state["iteration"] == 2 and not any(k.startswith("module.") for k in state["model"])
    # Each rank's random streams are kept, so a resumed rank continues its own.
    first, second = (r["torch"] for r in state["rng_per_rank"])
    assert torch.equal(state["rng"]["torch"], first) and not torch.equal(first, second)


def test_distributed_eval_matches_single_process(mask_run, shapes_root, tmp_path) -> None:
    run, _ = mask_run
    ckpt = run / "checkpoints/model_0000002.pth"
    opts = shapes_opts(shapes_root)
    dist_out, single_out = tmp_path / "dist", tmp_path / "single"
    args = ["--config", str(MASK_DROPIT_CFG), "--checkpoint", str(ckpt)]
    run_job(
        torchrun(single_node(), TEST_PY, [*args, "--output-dir", str(dist_out), "--opts", *opts])
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels as the OMP_NUM_THREADS=1 workers
    try:
        single = runner.test(MASK_DROPIT_CFG, ckpt, output_dir=single_out, overrides=opts)
    finally:
        torch.set_num_threads(threads)
    distributed = json.loads((dist_out / "eval.json").read_text())
    assert distributed["num_images"] == single["num_images"] == 3
    for iou_type in ("bbox", "segm"):
        assert distributed[iou_type] == single[iou_type]
        assert sorted_results(dist_out / f"coco_results_{iou_type}.json") == sorted_results(
            single_out / f"coco_results_{iou_type}.json"
        )
    # The evaluation inside the 2-process training run saw the same weights.
    trained = json.loads((run / "eval.json").read_text())
    assert trained["bbox"] == single["bbox"] and trained["segm"] == single["segm"]
    assert json.loads((single_out / "coco_results_segm.json").read_text())  # detections compared


def test_every_rank_probes_a_memory_budget_and_they_train_one_choice(shapes_root, tmp_path):
    run = tmp_path / "run"
    opts = shapes_opts(
        shapes_root,
        "solver.max_iters=1",
        "train.memory_budget=64GB",
        "train.memory_candidates=[quant_4bit, baseline]",
    )
    args = ["--config", str(FASTER_CFG), "--output-dir", str(run), "--opts", *opts]
    output = run_job(torchrun(single_node(), TRAIN_PY, args))
    record = json.loads((run / "budget.json").read_text())
    assert record["world_size"] == 2 and record["device"] == "cpu"
    assert [m["method"] for m in record["methods"]] == ["quant_4bit", "baseline"]
    assert all(m["fits"] and m["peak_mb"] > 0 for m in record["methods"])
    assert output.count(f"training with {record['method']}: ") == 1  # rank 0 prints it
    dropit = load_config(run / "config.yaml").dropit
    assert dropit.enabled is (record["method"] == "quant_4bit")


def test_overwrite_over_the_last_run_five_times_leaves_one_whole_run(twin_root, tmp_path):
    """--overwrite over the run the previous job left, 5 jobs in a row: one process (rank 0)
    sets the old run aside and drops it at the end while the group lives, so every rank exits 0
    (every rank removing .replaced/ after the group was gone made rank 1 fail on files rank 0 had
    just removed) and the folder holds the new run alone, whole."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # a finished run's files, as the first old run
    for name in ("config.yaml", "metrics.jsonl", "eval.json", "log.txt"):
        (run / name).write_text("{}\n")
    for iteration in range(1, 9):
        (run / f"checkpoints/model_{iteration:07d}.pth").write_bytes(b"old")
    (run / "checkpoints/last_checkpoint").write_text("model_0000008.pth")
    opts = twin_opts(twin_root, 1, "solver.max_iters=1")
    args = ["--config", str(FASTER_CFG), "--output-dir", str(run), "--overwrite", "--opts", *opts]
    for job in range(5):
        run_job(torchrun(single_node(), TRAIN_PY, args))  # exit 0: every rank exited 0
        assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == [
            "checkpoints",
            "checkpoints/last_checkpoint",
            "checkpoints/model_0000001.pth",
            "coco_results_bbox.json",
            "config.yaml",
            "eval.json",
            "log.txt",
            "metrics.jsonl",
        ], f"job {job}"
        records = read_metrics(run / "metrics.jsonl")
        assert [(r["type"], r["iter"]) for r in records] == [("train", 1), ("eval", 1)]
        assert json.loads((run / "eval.json").read_text())["iter"] == 1
        assert load_config(run / "config.yaml").solver.max_iters == 1
        last = find_last_checkpoint(run / "checkpoints")
        assert last == run / "checkpoints/model_0000001.pth"
        assert load_checkpoint(last)["iteration"] == 1


# ---- two nodes, and one step equal to a single-process step ----------------------------------


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, twin_root) -> tuple[Path, list[str]]:
    """Two torchrun invocations as two nodes of one process each, c10d rendezvous on loopback;
    Faster R-CNN on the twin set, 1 image per rank, 2 iterations, a checkpoint after each."""
    run = tmp_path_factory.mktemp("nodes") / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    opts = twin_opts(twin_root, 1, "solver.max_iters=2", "train.checkpoint_every_iters=1")
    args = ["--config", str(FASTER_CFG), "--output-dir", str(run), "--opts", *opts]
    jobs = []
    for node_rank in (0, 1):
        launch = [
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}",
            "--rdzv_id=two-nodes",
        ]
        cmd = torchrun(launch, TRAIN_PY, args)
        jobs.append(
            subprocess.Popen(
                cmd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for job in jobs:
            outputs.append(job.communicate(timeout=JOB_TIMEOUT_S)[0])
    finally:
        for job in jobs:
            job.kill()
    for job, output in zip(jobs, outputs, strict=True):
        assert job.returncode == 0, output[-4000:]
    return run, outputs


def test_two_nodes_on_loopback(two_node_run) -> None:
    run, outputs = two_node_run
    both = "".join(outputs)
    assert (
        both.count("training fasterrcnn for 2 iterations (1 per epoch, 2 process(es) on cpu)") == 1
    )
    assert [r["iter"] for r in train_records(run)] == [1, 2]
    final = json.loads((run / "eval.json").read_text())
    assert final["num_images"] == 1 and final["iter"] == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last_checkpoint",
        "model_0000001.pth",
        "model_0000002.pth",
    ]


def test_one_ddp_step_matches_single_process(two_node_run, twin_root, tmp_path) -> None:
    """2 ranks x 1 image and 1 process x 2 images make the same SGD step.

    Why it is exact up to float summation order: DDP averages the ranks' gradients, which equals
    the gradient of the single process's loss when every loss term is a per-image sum divided by
    a count that is the same on every image. R-CNN losses are means over sampled anchors and
    proposals of the whole batch; here the sampler batch sizes exceed the counts, so all of them
    are taken (no random subsampling), and the twin images share pixels and boxes, so each
    image has the same count. Frozen BatchNorm has no batch statistics, flips are off, and both
    runs start from the same seeded weights with the same lr (no warmup, no auto scaling).
    """
    run, _ = two_node_run
    single_run = tmp_path / "single"
    opts = twin_opts(twin_root, 2, "solver.max_iters=1")
    runner.train(FASTER_CFG, opts, output_dir=single_run)
    # The loss logged under DDP is the mean over ranks: the single process's batch loss.
    ddp_loss = next(r["loss"] for r in train_records(run) if r["iter"] == 1)
    assert ddp_loss == pytest.approx(train_records(single_run)[0]["loss"], rel=1e-5)
    single = load_checkpoint(single_run / "checkpoints/model_0000001.pth")["model"]
    ddp = load_checkpoint(run / "checkpoints/model_0000001.pth")["model"]
    assert_same_step(ddp, single, opts)


def assert_same_step(got: dict, want: dict, opts: list[str]) -> None:
    """The weights ``got`` after one step are ``want``'s: each tensor within float rounding, and
    the difference ~1e-6 of the step from the seeded initial weights (a real step: the update
    has norm ~0.4)."""
    cfg = load_config(FASTER_CFG, opts)
    seed_all(cfg.train.seed)  # the initial weights, as the runner makes them
    start = build_model(cfg)[0].state_dict()
    step_sq = diff_sq = 0.0
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
        if value.is_floating_point():
            step_sq += (value - start[name]).double().square().sum().item()
            diff_sq += (got[name] - value).double().square().sum().item()
    assert step_sq**0.5 > 0.1 and (diff_sq / step_sq) ** 0.5 < 1e-4


def test_a_compiled_backbone_makes_the_same_ddp_step(two_node_run, twin_root, tmp_path) -> None:
    """train.compile=backbone under DDP (2 ranks x 1 image): the compiled backbone's gradients
    reach DDP's all-reduce, and the step is the eager DDP step's (aot_eager: Dynamo and
    AOTAutograd trace as for Inductor, without its code generation; its decompositions may
    round differently, hence a tolerance)."""
    eager_run, _ = two_node_run
    run = tmp_path / "compiled"
    opts = twin_opts(
        twin_root,
        1,
        "solver.max_iters=1",
        "train.compile=backbone",
        "train.compile_backend=aot_eager",
    )
    args = ["--config", str(FASTER_CFG), "--output-dir", str(run), "--opts", *opts]
    output = run_job(torchrun(single_node(), TRAIN_PY, args))
    assert output.count("train.compile=backbone (aot_eager): first forward") == 1  # rank 0 logs
    compiled = load_checkpoint(run / "checkpoints/model_0000001.pth")["model"]
    eager = load_checkpoint(eager_run / "checkpoints/model_0000001.pth")["model"]
    assert compiled.keys() == eager.keys()  # no compiler prefix in the checkpoint
    assert_same_step(compiled, eager, opts)


# ---- elastic restart --------------------------------------------------------------------------

# tools/train.py with a hook: rank 1 of the first attempt stops at iteration 2 (after the
# checkpoint at 1) and waits there to be killed.
PARKED_TRAIN = """
import os, runpy, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from rcnn_dropit.engine.trainer import Trainer

if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    real_step = Trainer.step

    def parked_step(self, images, targets, iteration):
        if iteration == 2:
            Path({pid_file!r}).write_text(str(os.getpid()))
            time.sleep(600)
        return real_step(self, images, targets, iteration)

    Trainer.step = parked_step
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


def test_killed_worker_resumes_from_newest_checkpoint(two_node_run, twin_root, tmp_path) -> None:
    """torchrun --max-restarts=1 with --resume auto: SIGKILL of a worker mid-run restarts the
    group, which continues from the newest checkpoint and ends as the uninterrupted run."""
    straight, _ = two_node_run
    run, pid_file, script = tmp_path / "run", tmp_path / "parked.pid", tmp_path / "parked.py"
    script.write_text(
        PARKED_TRAIN.format(repo=str(REPO), pid_file=str(pid_file), train=str(TRAIN_PY))
    )
    opts = twin_opts(twin_root, 1, "solver.max_iters=2", "train.checkpoint_every_iters=1")
    args = [
        "--config",
        str(FASTER_CFG),
        "--output-dir",
        str(run),
        "--resume",
        "auto",
        "--opts",
        *opts,
    ]
    launch = [
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
    ]
    job = subprocess.Popen(
        torchrun(launch, script, args),
        # A fresh rendezvous store per restart (README, Elastic restarts): with torch's shared
        # store a restarted rank can read the dead attempt's gloo address and fail to connect.
        env={**job_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not pid_file.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), "rank 1 never reached iteration 2"
        time.sleep(0.2)  # the pid is written before sleeping starts
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        output = job.communicate(timeout=JOB_TIMEOUT_S)[0]
    finally:
        job.kill()
    assert job.returncode == 0, output[-4000:]
    assert output.count("note: no checkpoint in") == 1  # the first attempt started fresh
    assert f"resumed from '{run / 'checkpoints/model_0000001.pth'}' at iteration 1" in output
    records, reference = train_records(run), train_records(straight)
    assert [r["iter"] for r in records] == [1, 2]
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]
    resumed = load_checkpoint(run / "checkpoints/model_0000002.pth")["model"]
    uninterrupted = load_checkpoint(straight / "checkpoints/model_0000002.pth")["model"]
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
    assert (
        json.loads((run / "eval.json").read_text())["bbox"]
        == json.loads((straight / "eval.json").read_text())["bbox"]
    )

"""Launcher environment parsing, single-process helpers, and a real 2-process gloo run."""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rcnn_dropit import distributed
from rcnn_dropit.distributed import LaunchEnv, init_distributed, read_launch_env, resolve_device
from rcnn_dropit.evaluation import COCOEvaluator
from tests.helpers import CAT_OF_LABEL, evaluate_into, free_port, make_coco_gt, predictions

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_NODELIST",
    "SLURM_JOB_NODELIST",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_torchrun_env(clean_env):
    for name, value in {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "29555",
    }.items():
        clean_env.setenv(name, value)
    clean_env.setenv("SLURM_PROCID", "3")  # torchrun inside a SLURM job: torchrun's view wins
    assert read_launch_env() == LaunchEnv(5, 8, 1, "10.0.0.2", 29555, "torchrun")


def test_slurm_env(clean_env):
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2"}
    with_ip = {**env, "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}
    assert read_launch_env(with_ip) == LaunchEnv(6, 8, 2, "10.1.2.3", 29500, "slurm")
    explicit = {**with_ip, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    assert read_launch_env(explicit) == LaunchEnv(6, 8, 2, "head", 1234, "slurm")
    # Without scontrol on PATH the first host is expanded by hand.
    clean_env.setenv("PATH", "")
    assert read_launch_env({**env, "SLURM_NODELIST": "gpu[07-09,12],cpu1"}).master_addr == "gpu07"
    assert read_launch_env({**env, "SLURM_NODELIST": "node3,node4"}).master_addr == "node3"
    with pytest.raises(ValueError, match="SLURM_NODELIST.*MASTER_ADDR"):
        read_launch_env({**env, "SLURM_NODELIST": "r[1-2]-n[01-02]"})
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        read_launch_env(env)
    # The environment of os.environ is read when no mapping is given.
    for name, value in with_ip.items():
        clean_env.setenv(name, value)
    assert read_launch_env().rank == 6


def test_single_process_and_bad_values(clean_env):
    assert read_launch_env() == LaunchEnv(0, 1, 0, None, None, "none")
    assert read_launch_env({"WORLD_SIZE": "1", "RANK": "0"}).world_size == 1
    assert read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).source == "none"
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        read_launch_env({"WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="LOCAL_RANK is not set"):
        read_launch_env({"WORLD_SIZE": "2", "RANK": "0"})
    clean_env.setenv("WORLD_SIZE", "1")
    info = init_distributed("cpu")
    assert (info.rank, info.world_size, info.distributed) == (0, 1, False)
    assert info.device == torch.device("cpu")
    assert not dist.is_initialized()
    assert distributed.get_rank() == 0 and distributed.get_world_size() == 1
    assert distributed.is_main_process() and info.is_main
    assert distributed.main_only(lambda: 5) == 5
    distributed.barrier()
    assert distributed.all_gather_object({"a": 1}) == [{"a": 1}]
    assert distributed.gather_object(3) == [3]
    assert distributed.broadcast_object("x") == "x"
    losses = {"loss": torch.tensor(2.0)}
    assert distributed.reduce_dict(losses) == losses
    distributed.cleanup()


def test_a_multi_process_job_has_no_rank_outside_its_process_group(clean_env):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        clean_env.setenv(name, value)
    asks = {
        "get_rank": distributed.get_rank,
        "get_world_size": distributed.get_world_size,
        "is_main_process": distributed.is_main_process,
        "main_only": lambda: distributed.main_only(lambda: 5),
        "run_on_main": lambda: distributed.run_on_main(lambda: 5),
        "barrier": distributed.barrier,
        "broadcast_object": lambda: distributed.broadcast_object("x"),
    }
    for name, ask in asks.items():
        with pytest.raises(RuntimeError, match="outside the process group's life"):
            ask()
            pytest.fail(f"{name} answered before init_distributed")
    distributed.cleanup()  # nothing to leave: not an error
    clean_env.setenv("SLURM_PROCID", "0")  # srun's variables alone say the same
    clean_env.delenv("WORLD_SIZE")
    clean_env.setenv("SLURM_NTASKS", "4")
    with pytest.raises(RuntimeError, match="outside the process group's life"):
        distributed.get_rank()


def test_device_choice():
    assert resolve_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="'tpu' is not one of auto, cpu, cuda"):
        resolve_device("tpu", 0)
    if not torch.cuda.is_available():
        assert resolve_device("auto", 0) == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda", 0)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    info = init_distributed("cpu", timeout_s=60)
    record = {"rank": info.rank, "world": info.world_size, "distributed": info.distributed}
    record["is_main"] = distributed.is_main_process()
    record["info_is_main"] = info.is_main
    record["main_only"] = distributed.main_only(lambda: rank)  # no collective: none to wait for
    record["gathered"] = distributed.all_gather_object(rank * 10)
    record["gather_to_0"] = distributed.gather_object(rank + 1)
    record["broadcast"] = distributed.broadcast_object(f"from {rank}")
    losses = {"b": torch.tensor(float(rank)), "a": torch.tensor(2.0 + rank)}
    record["mean"] = {k: v.item() for k, v in distributed.reduce_dict(losses).items()}
    record["sum"] = {k: v.item() for k, v in distributed.reduce_dict(losses, False).items()}

    # Each rank evaluates its own image; shifted predictions make the AP non-trivial.
    evaluator = COCOEvaluator(make_coco_gt(), ("bbox", "segm"), CAT_OF_LABEL.__getitem__)
    image_id = rank + 1
    evaluator.update([predictions(image_id, shift=0.2 if rank else 0.0)], [image_id])
    record["metrics"] = evaluate_into(evaluator, os.path.join(out_dir, "eval"))

    # Both ranks claiming image 1 must fail on every rank, not hang the others.
    twice = COCOEvaluator(make_coco_gt(), ("bbox",), CAT_OF_LABEL.__getitem__)
    twice.update([predictions(1)], [1])
    try:
        twice.evaluate_with_results()
        record["duplicate_error"] = None
    except RuntimeError as err:
        record["duplicate_error"] = str(err)
    distributed.barrier()
    distributed.cleanup()
    try:  # the group is gone: every rank would say rank 0
        record["after_cleanup"] = distributed.is_main_process()
    except RuntimeError as err:
        record["after_cleanup"] = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


@pytest.mark.dist
@pytest.mark.slow  # two processes
def test_two_process_gloo_matches_single_process(tmp_path):
    context = mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("2-process gloo run did not finish within 120 s")
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    single = COCOEvaluator(make_coco_gt(), ("bbox", "segm"), CAT_OF_LABEL.__getitem__)
    single.update([predictions(1), predictions(2, shift=0.2)], [1, 2])
    expected = evaluate_into(single, tmp_path / "single")
    assert expected["num_images"] == 2
    assert 0.0 < expected["bbox"]["AP"] < 1.0

    for rank, rec in enumerate(records):
        assert (rec["rank"], rec["world"], rec["distributed"]) == (rank, 2, True)
        assert rec["is_main"] == rec["info_is_main"] == (rank == 0)
        assert rec["main_only"] == (0 if rank == 0 else None)
        assert rec["gathered"] == [0, 10]
        assert rec["gather_to_0"] == ([1, 2] if rank == 0 else None)
        assert rec["broadcast"] == "from 0"
        assert rec["mean"] == {"a": 2.5, "b": 0.5}
        assert rec["sum"] == {"a": 5.0, "b": 1.0}
        assert rec["metrics"] == expected  # exactly, on both ranks
        assert "repeat images" in rec["duplicate_error"]
        assert "outside the process group's life" in rec["after_cleanup"]
    for iou_type in ("bbox", "segm"):
        name = f"coco_results_{iou_type}.json"
        assert (tmp_path / "eval" / name).read_text() == (tmp_path / "single" / name).read_text()

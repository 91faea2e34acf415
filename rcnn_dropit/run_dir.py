"""A run directory: its paths and every file a run writes (atomically, rcnn_dropit.atomic).

`outputs/<run>/`: config.yaml, metrics.jsonl, checkpoints/, eval.json, memory.json,
budget.json (with train.memory_budget), coco_results_{bbox,segm}.json, log.txt (log.rank<N>.txt
for other ranks' warnings and errors), TensorBoard event files with train.tensorboard; during a
run started with --overwrite, the run it replaces, in .replaced/.
Its writing methods are called on every rank: rank 0 writes, and an error it meets there is
raised on every rank (distributed.run_on_main).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from rcnn_dropit.atomic import write_atomic, write_json_atomic
from rcnn_dropit.distributed import get_rank, is_main_process, run_on_main
from rcnn_dropit.errors import UsageError, cannot_write, make_folder
from rcnn_dropit.metrics_file import MetricsWriter, NullWriter, read_metrics
from rcnn_dropit.tensorboard import TensorBoardWriter

LOGGER_NAME = "rcnn_dropit"
# What a run writes; --overwrite removes exactly these, never anything else in the folder.
RUN_ARTIFACTS = (
    "config.yaml",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "checkpoints",
    "coco_results_bbox.json",
    "coco_results_segm.json",
    "eval.json",
    "memory.json",
    "budget.json",
    "log.txt",
)
BUDGET_FILE = "budget.json"  # the method train.memory_budget chose, and what it measured
_OTHER_ARTIFACTS = ("log.rank*.txt", "events.out.tfevents.*")  # other ranks' logs, TensorBoard
_ELSEWHERE = "; choose another with --output-dir"
REPLACED = ".replaced"  # the run --overwrite replaces, until the new one can stand alone
log = logging.getLogger(LOGGER_NAME)


def truncate_metrics(path: Path | str, max_iter: int) -> int:
    """Drop records with iter > max_iter (on resume), rewriting atomically; returns kept count."""
    path = Path(path)
    if not path.exists():
        return 0
    kept = [r for r in read_metrics(path) if int(r.get("iter", 0)) <= max_iter]
    write_atomic(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in kept).encode()))
    return len(kept)


class RecordWriters:
    """metrics.jsonl first, then TensorBoard when enabled, behind one write() that every rank
    calls: rank 0 writes, and an error it meets (a full disk) ends every rank, not rank 0 alone
    while the others wait in the next step's all-reduce."""

    def __init__(self, jsonl, tensorboard: TensorBoardWriter | None = None) -> None:
        self.jsonl = jsonl
        self.tensorboard = tensorboard

    def write(self, record: dict[str, Any], tensorboard_only: bool = False) -> None:
        """Append the record to metrics.jsonl (unless tensorboard_only) and to TensorBoard."""

        def write() -> None:
            if not tensorboard_only:
                self.jsonl.write(record)
            if self.tensorboard is not None:
                self.tensorboard.write(record)

        run_on_main(write, share=False)

    def close(self) -> None:
        """Close both (on the rank that has them)."""
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


class _RunLog(logging.Handler):
    """log.txt: records wait in memory until the run directory exists (checks come first)."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.pending: list[str] = []
        self.path: Path | None = None
        self.stream: IO[str] | None = None

    def attach(self, path: Path) -> None:
        """Write to path from now on, starting with what waited."""
        self.path = path
        if self.pending:
            self._write("".join(self.pending))
            self.pending = []

    def _write(self, text: str) -> None:
        if self.stream is None:
            self.stream = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self.stream.write(text)
        self.stream.flush()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            if self.path is None:
                self.pending.append(line)
            else:
                self._write(line)
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        super().close()


class _Console(logging.Handler):
    """Rank 0's console: plain messages through tqdm, so progress bars stay intact."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.addFilter(lambda record: not getattr(record, "file_only", False))

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(record.getMessage())


class RunDir:
    """The folder of one run and everything written into it."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._log_file: _RunLog | None = None
        self._handlers: list[tuple[logging.Logger, logging.Handler]] = []

    # ---- paths ------------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        """The resolved config.yaml."""
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        """metrics.jsonl, one record per logged step and per evaluation."""
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        """The checkpoints/ folder (with its last_checkpoint pointer)."""
        return self.root / "checkpoints"

    @property
    def log_file(self) -> Path:
        """This rank's log: log.txt on rank 0, log.rank<N>.txt (warnings and errors) elsewhere."""
        return self.root / ("log.txt" if is_main_process() else f"log.rank{get_rank()}.txt")

    def coco_results(self, iou_type: str) -> Path:
        """coco_results_<iou_type>.json, the detections in COCO results format."""
        return self.root / f"coco_results_{iou_type}.json"

    # ---- the folder -------------------------------------------------------------------------
    @property
    def replaced(self) -> Path:
        """Where --overwrite keeps the run it replaces until the new one can stand alone."""
        return self.root / REPLACED

    def check(self, resume: str | None, overwrite: bool, clear: bool = True) -> None:
        """Refuse to mix a new run into a used folder; --overwrite sets our own files aside first
        (unless clear=False: check only, so nothing is touched if a later check fails).

        ``resume`` is what the run resumes from, None for a fresh start."""
        out = self.root
        if out.exists() and not out.is_dir():
            raise UsageError(f"output dir '{out}' exists and is not a folder")
        if resume is not None or not out.is_dir() or not any(out.iterdir()):
            return
        if not overwrite:
            raise UsageError(
                f"output dir '{out}' is not empty; pass --resume auto to continue that run, "
                "--overwrite to replace it, or --output-dir to choose another folder"
            )
        if clear:
            self.set_aside()

    def holds_a_run(self) -> bool:
        """Whether the folder holds a finished run (eval.json) or checkpoint files: what a fresh
        start must not replace unasked."""
        ckpts = self.checkpoints
        return (self.root / "eval.json").exists() or (ckpts.is_dir() and any(ckpts.iterdir()))

    def _artifacts(self) -> list[Path]:
        paths = [self.root / name for name in RUN_ARTIFACTS]
        paths += [path for pattern in _OTHER_ARTIFACTS for path in self.root.glob(pattern)]
        return [path for path in paths if path.exists()]

    def remove_artifacts(self) -> None:
        """Delete the files a run writes from the folder, nothing else."""
        for path in self._artifacts():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()

    def set_aside(self) -> None:
        """Move the run files into :attr:`replaced`, from where a new run that fails before it
        can stand alone puts them back (:meth:`restore_replaced`). A folder that already has one
        keeps it: it holds the run an earlier --overwrite set out to replace, and what is here
        now is that attempt's."""
        if self.replaced.exists():
            self.remove_artifacts()
            return
        paths = self._artifacts()
        if paths:
            self.replaced.mkdir()
            for path in paths:
                path.rename(self.replaced / path.name)

    def restore_replaced(self) -> bool:
        """Put the replaced run back in place of this one's files; whether there was one."""
        if not self.replaced.is_dir():
            return False
        self.remove_artifacts()
        for path in self.replaced.iterdir():
            path.rename(self.root / path.name)
        self.replaced.rmdir()
        return True

    def drop_replaced(self) -> None:
        """Delete the replaced run: the new one has a checkpoint or has finished."""
        if self.replaced.is_dir():
            shutil.rmtree(self.replaced)

    def create(self, config_yaml: str) -> None:
        """Make the folder and write config.yaml (rank 0; every rank calls it)."""

        def make() -> None:
            self.make_folder("output dir")
            try:
                write_atomic(self.config, lambda f: f.write(config_yaml.encode()))
            except OSError as err:  # no permission, say
                raise cannot_write("output dir", self.root, err, _ELSEWHERE) from None

        run_on_main(make)
        self.attach_log()

    def make_folder(self, label: str) -> None:
        """Make the folder; a path that cannot be one is one message naming ``label``."""
        make_folder(self.root, label, _ELSEWHERE)

    def attach_log(self) -> None:
        """Start writing this rank's log file in the folder (which must exist by now)."""
        if self._log_file is not None:
            self._log_file.attach(self.log_file)

    # ---- records and results ----------------------------------------------------------------
    def open_metrics(self, keep_until: int | None = None, tensorboard: bool = False):
        """The record writer: metrics.jsonl (and TensorBoard scalars next to it) on rank 0, a
        no-op elsewhere; with keep_until, records past that iteration are dropped first (a
        resumed run redoes them)."""

        def open_writers() -> RecordWriters:
            if keep_until is not None:
                truncate_metrics(self.metrics, keep_until)
            board = TensorBoardWriter(self.root) if tensorboard else None
            return RecordWriters(MetricsWriter(self.metrics), board)

        return run_on_main(open_writers, share=False) or RecordWriters(NullWriter())

    def eval_record(self, iteration: int) -> dict | None:
        """The metrics of the evaluation of `iteration` in metrics.jsonl, or None (rank 0 reads,
        all ranks get it)."""

        def find() -> dict | None:
            for record in read_metrics(self.metrics):
                if record.get("type") == "eval" and record.get("iter") == iteration:
                    return {k: v for k, v in record.items() if k not in ("type", "iter", "epoch")}
            return None

        return run_on_main(find)

    def write_json(self, name: str, obj: dict) -> None:
        """<name> in the folder, atomically (rank 0; every rank calls it)."""
        run_on_main(lambda: write_json_atomic(self.root / name, obj))

    def write_coco_results(self, results: dict[str, list] | None) -> None:
        """coco_results_<iou type>.json of an evaluation (rank 0 holds them all)."""

        def write() -> None:
            for iou_type, detections in results.items():
                write_json_atomic(self.coco_results(iou_type), detections, indent=None)

        run_on_main(write)

    def write_eval(self, metrics: dict, **extra: Any) -> None:
        """eval.json: the final metrics and where they come from."""
        self.write_json("eval.json", {**metrics, **extra})

    def write_memory(self, report: dict) -> None:
        """memory.json: the memory and throughput report."""
        self.write_json("memory.json", report)

    # ---- logging ----------------------------------------------------------------------------
    def start_logging(self) -> None:
        """Route the package's messages and Python warnings: rank 0 to the console and log.txt,
        other ranks' warnings and errors to log.rank<N>.txt. Undone by stop_logging()."""
        main = is_main_process()
        # attached to its file by create(), once the folder is known to be ours
        self._log_file = _RunLog(logging.INFO if main else logging.WARNING)
        warn_console = logging.StreamHandler(sys.stderr)  # where Python prints warnings anyway
        warn_console.setFormatter(logging.Formatter("%(message)s"))
        routes: list[tuple[logging.Logger, logging.Handler]] = [
            (log, self._log_file),
            (logging.getLogger("py.warnings"), self._log_file),
            (logging.getLogger("py.warnings"), warn_console),
        ]
        if main:
            routes.append((log, _Console()))
        warn_log = logging.getLogger("py.warnings")
        self._saved = (log.level, log.propagate, warn_log.propagate)
        for logger, handler in routes:
            logger.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = warn_log.propagate = False  # these handlers say it all, once
        logging.captureWarnings(True)
        self._handlers = routes

    def stop_logging(self) -> None:
        """Detach this run's handlers and close log.txt."""
        logging.captureWarnings(False)
        for logger, handler in self._handlers:
            logger.removeHandler(handler)
        if self._handlers:
            level, log.propagate, logging.getLogger("py.warnings").propagate = self._saved
            log.setLevel(level)
        if self._log_file is not None:
            self._log_file.close()
        self._handlers = []

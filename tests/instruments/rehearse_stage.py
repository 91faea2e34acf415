"""Run one of tools/gpu_session.sh's commands as its CPU rehearsal does (``--rehearse``):
``python tests/instruments/rehearse_stage.py tools/bench.py ARGS...`` (or ``-m MODULE ARGS...``).

The command runs unchanged, except that every bench model is made small: the recipe
(instruments.measure.workload.recipe_config, read by every instrument that builds the bench's
model) becomes ResNet-18 with tiny FPN and heads (WIDTHS: a step costs half the tests' narrow
model's) and 16 sampled RoIs per image, and the pooler bench pools 16 and 4 RoIs per image at
16 channels. Sizes only: the settings, flags, files and writers are the lease's own.

Where the session serves (``--serve SOCKET``, which gpu_session.sh --rehearse starts, naming its
socket in ``REHEARSE_SOCKET``), a command is not a new interpreter importing torch: this process
hands it (its arguments, working directory, environment and standard streams) to the server,
which has imported torch and torchvision once, forks, and runs the command's script in the fork
as ``python`` would (``__main__``, ``sys.argv``, ``sys.orig_argv``, its exit status, SIGINT
forwarded: a time limit stops it as it stops a process). The project's own modules are imported
afresh in each fork, after its environment is set (``DROPIT_*`` is read at import). A command
whose environment differs from the server's in what torch reads when imported (``TORCH_*`` but
its logs, ``OMP_*``, ...) runs in a new interpreter instead. In a fork, ``sys.executable`` is a
shim that comes back here, so the interpreters a stage starts (tools/bench.py restarting itself,
the deterministic pair's training runs, the fusion bench's measurements) are served too.
Without a server the command runs in this process.
"""

from __future__ import annotations

import array
import atexit
import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()
SOCKET_VAR = "REHEARSE_SOCKET"
CPU_LOG_VAR = "REHEARSE_CPU_LOG"  # a file: each command's CPU seconds, appended as it ends
# What torch reads from the environment as it is imported: a command that differs from the
# server there needs its own interpreter (TORCH_LOGS* is read again in the fork; the inductor's
# cache folder when it is used).
IMPORT_TIME = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "CUBLAS", "NCCL", "TRITON")
READ_AGAIN = ("TORCH_LOGS", "TORCHINDUCTOR_CACHE_DIR")
WIDTHS = ("model.fpn_channels=16", "model.box_head_width=32", "model.mask_head_channels=16")
PRELOAD = ("torch", "torchvision.models.detection", "yaml", "pytest", "pycocotools.cocoeval")


def narrow_sizes() -> None:
    """Every bench model small (the module's docstring), before the command imports anything
    that reads the recipe by name."""
    sys.path.insert(0, str(REPO))
    from instruments.measure import workload
    from rcnn_dropit.config import with_overrides

    recipe = workload.recipe_config

    def narrow(scratch, image_size, rois_per_image=512, backbone="resnet50", heads="v1"):
        """The bench's recipe at the rehearsal's size."""
        small = recipe(scratch, image_size, min(rois_per_image, 16), "resnet18", heads)
        return with_overrides(small, WIDTHS, source="rehearsal")

    workload.recipe_config = narrow


def run(argv: list[str]) -> None:
    """``python ARGV`` in this process: a script (its sizes narrowed) or ``-m MODULE``."""
    sys.path[:] = [p for p in sys.path if p != str(HERE.parent)]  # as python would have it
    if argv[:1] == ["-m"]:
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(script).resolve().parent))
    narrow_sizes()
    runpy.run_path(script, run_name="__main__")


def exit_code(err: SystemExit) -> int:
    """The status ``python`` gives a SystemExit (a message: printed, status 1)."""
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


# ---- the server -------------------------------------------------------------------------------


def _shim(folder: Path) -> Path:
    """An executable that runs ``python ARGS`` through this server (the forks' sys.executable)."""
    shim = folder / "python-rehearsal"
    shim.write_text(f"#!/bin/sh\nexec '{sys.executable}' '{HERE}' \"$@\"\n")
    shim.chmod(0o755)
    return shim


def _differs(env: dict[str, str]) -> list[str]:
    """The import-time variables where ``env`` and this process's environment differ."""
    names = {n for n in (*env, *os.environ) if n.startswith(IMPORT_TIME)}
    return sorted(
        n for n in names if env.get(n) != os.environ.get(n) and not n.startswith(READ_AGAIN)
    )


def _work(request: dict, shim: Path) -> None:
    """In the fork: become the command (its streams, folder, environment) and run it."""
    os.chdir(request["cwd"])
    logs_changed = any(
        request["env"].get(n) != os.environ.get(n)
        for n in {*request["env"], *os.environ}
        if n.startswith("TORCH_LOGS")
    )
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    if logs_changed:
        import torch._logging._internal

        torch._logging._internal._init_logs()
    sys.executable = str(shim)
    sys.orig_argv = [str(shim), *request["argv"]]
    code = 0
    try:
        run(request["argv"])
    except SystemExit as err:
        code = exit_code(err)
    except KeyboardInterrupt as err:
        _report(err)
        code = 130
    except BaseException as err:  # noqa: BLE001  (as python reports it)
        _report(err)
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _report(err: BaseException) -> None:
    """The traceback python would print: from the command's own frames (this runner's and
    runpy's left out)."""
    tb = err.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == str(HERE) or "runpy" in tb.tb_frame.f_code.co_filename
    ):
        tb = tb.tb_next
    traceback.print_exception(type(err), err, tb)


def _handle(conn: socket.socket, shim: Path) -> None:
    """One command: run it in a fork (or a new interpreter, where its environment needs one),
    tell the client its process id, kill it if the client goes, then send its status."""
    request, fds = _receive(conn)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if _differs(request["env"]):
        child = subprocess.Popen(
            [sys.executable, str(HERE), *request["argv"]],
            cwd=request["cwd"],
            env={**request["env"], SOCKET_VAR: ""},  # itself, not back here
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
        )
        pid = child.pid
    else:
        pid = os.fork()
        if pid == 0:
            conn.close()
            _work(request, shim)
    conn.sendall(f"pid {pid}\n".encode())
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        readable, _, _ = select.select([conn], [], [], 0.01)
        if readable and not conn.recv(1):  # the client is gone (killed): so is its command
            os.kill(pid, signal.SIGKILL)
    code = os.waitstatus_to_exitcode(status)
    if os.environ.get(CPU_LOG_VAR):  # what each command cost (the command's own children too)
        cpu = usage.ru_utime + usage.ru_stime
        with open(os.environ[CPU_LOG_VAR], "a") as log:
            log.write(f"{cpu:.1f} s CPU: {' '.join(request['argv'])[:150]}\n")
    conn.sendall(f"exit {128 - code if code < 0 else code}\n".encode())


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    size, _, data = data.partition(b"\n")
    while len(data) < int(size):
        more = conn.recv(65536)
        if not more:
            raise ConnectionError("the client went before its request")
        data += more
    return json.loads(data), list(fds)


def serve(path: Path) -> None:
    """Listen on ``path``, import torch and the rest of PRELOAD, then run each command sent in a
    fork of this process, until SIGTERM or the end of the process that started this one."""
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(64)  # commands queue while torch imports
    shim = _shim(path.parent)
    for module in PRELOAD:
        try:
            __import__(module)
        except ImportError:  # the command that needs it says so
            pass
    # What is imported stays: gc.collect (the benches' memory figures call it) then neither walks
    # it nor, in a fork, copies every page it touches.
    gc.freeze()
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda sig, _frame: stop.append(sig))
    server.settimeout(0.5)
    handlers: set[int] = set()
    while os.getppid() == parent and not stop:
        for pid in list(handlers):  # reaped here, so their CPU time is this process's children's
            if os.waitpid(pid, os.WNOHANG)[0]:
                handlers.discard(pid)
        try:
            conn, _ = server.accept()
        except (TimeoutError, InterruptedError):
            continue
        conn.settimeout(None)
        pid = os.fork()
        if pid == 0:
            server.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                _handle(conn, shim)
            finally:
                os._exit(0)
        handlers.add(pid)
        conn.close()
    path.unlink(missing_ok=True)
    for pid in handlers:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)


# ---- the client -------------------------------------------------------------------------------


def _connect(path: str) -> socket.socket | None:
    """A connection to the server at ``path`` (waiting a little for it to bind), or None."""
    deadline = time.monotonic() + 30
    while True:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(path)
            return client
        except (FileNotFoundError, ConnectionRefusedError):
            client.close()
            if time.monotonic() > deadline:
                print(f"rehearse_stage: no server at {path}; running here", file=sys.stderr)
                return None
            time.sleep(0.05)


def send(client: socket.socket, argv: list[str]) -> int:
    """Have the server run ``python ARGV`` with this process's folder, environment and
    streams; forward SIGINT, SIGTERM and SIGHUP to it; its exit status."""
    body = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(client, [str(len(body)).encode() + b"\n" + body], [0, 1, 2])
    reader = client.makefile("rb")
    line = reader.readline().split()
    if line[:1] != [b"pid"]:
        print("rehearse_stage: the server did not start the command", file=sys.stderr)
        return 1
    pid = int(line[1])

    sent: dict[int, float] = {}

    def forward(sig, _frame) -> None:
        # timeout(1) signals its command and then its process group: a process of the group
        # gets the signal once (pending signals merge), so the command does too
        now = time.monotonic()
        if now - sent.get(sig, -1.0) < 1.0:
            return
        sent[sig] = now
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            line = reader.readline().split()
            break
        except InterruptedError:
            continue
    if line[:1] != [b"exit"]:
        print("rehearse_stage: the server ended before the command", file=sys.stderr)
        return 1
    return int(line[1])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        serve(Path(argv[1]))
        return 0
    path = os.environ.get(SOCKET_VAR)
    client = _connect(path) if path else None
    if client is not None:
        return send(client, argv)
    try:
        run(argv)
    except SystemExit as err:
        return exit_code(err)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A fork server for the test house: ranks and CLI runs start with torch already imported.

Why: the default suite starts about 370 Python interpreters (ranks of ``mpiexec`` jobs,
``hyfi-train`` and ``hyfi-verify`` runs, workers), and each spends about 2.5 s of CPU
importing torch, DTensor, FSDP2, pipelining and dynamo before its first line of work: about
900 of the suite's 1,700 core-seconds on CI's two cores. This server imports those once and
forks a process per launch instead; what the launch runs (``hyfi_imaging`` included) is
imported fresh in the child, so the package's own import-time behaviour is a fresh
process's.

The protocol (``_forkclient.py`` is the other end). The client, which ``mpiexec`` (or a
test) started in place of ``python``, connects to this server's socket and sends its
``argv``, working directory, environment and every file descriptor it holds (stdio, MPICH's
PMI socket, ...). A *supervisor* forked for the connection forks the *child*, which puts
those descriptors at their numbers, takes the environment and runs the script or module
as ``__main__``. The supervisor forwards the signals the client receives, kills the child
if the client dies (MPICH's proxy kills a job's ranks with SIGKILL; a test kills the
launcher's process group on timeout), and answers with the child's wait status and peak
resident set, which the client then exits with (a death by a signal is repeated on the
client).

Not preloaded, so that they start fresh: ``hyfi_imaging``, ``mpi4py`` (``MPI_Init`` belongs to
the rank), ``torchvision`` and ``timm`` (their import order with ``hyfi_imaging`` is a tested
behaviour). Each server has its own ``PYTHONHASHSEED``; ranks alternate between servers, so
neighbouring ranks hash strings differently, as separate interpreters do.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import importlib
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback
import types
from typing import Any, NoReturn

PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch._dynamo",
)
_MAX_FDS = 250  # SCM_RIGHTS carries at most 253 descriptors per message
_PR_SET_PDEATHSIG = 1


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The client's length-prefixed JSON request and the descriptors sent with it."""
    data, fds = b"", array.array("i")
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        msg, anc, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
        if not msg:
            raise EOFError("the client left before its request was complete")
        data += msg
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data[4:]), list(fds)


def _place_fds(received: list[int], targets: list[int]) -> None:
    """Put each received descriptor at the number it had in the client; close every other."""
    base = max([*received, *targets, 2]) + 1
    moved = [os.dup2(fd, base + i) for i, fd in enumerate(received)]
    keep = set(moved)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target, inheritable=True)
    for fd in moved:
        if fd not in targets:
            os.close(fd)


def _stdio(env: dict[str, str]) -> None:
    """Fresh ``sys.stdin/stdout/stderr`` on descriptors 0-2, buffered as the request's
    environment says (``PYTHONUNBUFFERED``), as a new interpreter would make them."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = env.get("PYTHONIOENCODING", "utf-8").split(":")[0] or "utf-8"

    def writer(fd: int, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        interactive = raw.isatty()
        return io.TextIOWrapper(
            io.BufferedWriter(raw), encoding=encoding, errors=errors,
            line_buffering=interactive or fd == 2, write_through=unbuffered,
        )  # fmt: skip

    with contextlib.suppress(OSError, ValueError):
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = writer(1, "strict")
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace")


def _child(request: dict[str, Any], received: list[int]) -> NoReturn:
    """Become the process the client stands for: its descriptors, directory, environment,
    ``argv``; run it as ``__main__`` and leave as the interpreter would."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _place_fds(received, request["fds"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _stdio(request["env"])
    random.seed()  # a new interpreter seeds from the system; the server's state is shared
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed()
    argv = request["argv"]
    code: int = 0
    try:
        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException as err:  # printed as the interpreter would, without this frame
        tb = err.__traceback__
        sys.excepthook(type(err), err, tb.tb_next if tb is not None else None)
        code = 1
    _finish()
    os._exit(code & 0xFF)


def _finish() -> None:
    """What a new interpreter does on leaving: join its threads, run ``atexit``, flush."""
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _supervise(conn: socket.socket) -> NoReturn:
    """Fork the child for this connection, forward the client's signals to it, kill it if
    the client goes, and answer with its wait status and peak resident set (``end STATUS
    KIB``)."""
    try:
        request, received = _recv_request(conn)
    except (OSError, EOFError, ValueError):
        os._exit(1)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(request, received)
    for fd in received:
        os.close(fd)
    try:  # readable when the child ends (Linux 5.3); else look every 20 ms
        watch, every = [conn, os.pidfd_open(pid)], None
    except (AttributeError, OSError):
        watch, every = [conn], 0.02
    while True:
        ready, _, _ = select.select(watch, [], [], every)
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            with contextlib.suppress(OSError):
                conn.sendall(f"end {status} {usage.ru_maxrss}\n".encode())
            os._exit(0)
        if conn not in ready:
            continue
        data = conn.recv(64)
        if not data:  # the client is gone (killed): its process goes with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.wait4(pid, 0)
            os._exit(0)
        for sig in data:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def main() -> None:
    path = sys.argv[1]
    started = dict(os.environ)  # before the imports (inductor sets its cache directory)
    for name in PRELOAD:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(128)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    with open(path + ".env", "w") as f:  # what the clients compare their environment with
        json.dump(started, f)
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return  # the test session is over
        if server in ready:
            conn, _ = server.accept()
            if os.fork() == 0:
                server.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _supervise(conn)
            conn.close()


if __name__ == "__main__":
    main()

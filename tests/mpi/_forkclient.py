"""The fork server's client: started as ``python -I -S _forkclient.py ARGS`` where a test
launch would start ``python ARGS`` (see ``_forkserver.py`` for why and how).

Standard library only, and no ``site``: it starts in milliseconds. Where the server cannot
stand for ``python ARGS`` faithfully -- another interpreter option than ``-m`` or ``-c``, or an
environment that differs from the server's in a variable read while torch or Python start
(``PYTHON*``, ``OMP_*``, ``MALLOC_*``, ...) -- it becomes that interpreter (``exec``) instead.
"""

import array
import json
import os
import signal
import socket
import struct
import sys

#: Variables read when an interpreter, glibc, OpenMP or torch start: the server's must match.
#: (Not ``KMP_*``: that is Intel's OpenMP, which torch's build does not load -- it links GNU
#: libgomp, which reads ``OMP_*`` -- and scikit-learn and joblib set two at import.)
_STARTUP_PREFIXES = (
    "PYTHON", "OMP_", "MKL_", "OPENBLAS", "GOTO", "MALLOC_", "LD_", "GLIBC", "TORCH",
    "PYTORCH", "CUDA", "NCCL", "GLOO", "CUBLAS",
)  # fmt: skip
#: The child sets up stdio itself; the servers differ in seed; torch gives MKL as many
#: threads as OpenMP (OMP_NUM_THREADS must match).
_FREE = ("PYTHONUNBUFFERED", "PYTHONHASHSEED", "MKL_NUM_THREADS")
_FORWARDED = (
    signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT,
)  # fmt: skip


def _startup(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k not in _FREE}


def _real(python: str, argv: list, why: str) -> None:
    if os.environ.get("HYFI_FORK_DEBUG"):  # a file to append the reason to
        with open(os.environ["HYFI_FORK_DEBUG"], "a") as f:
            f.write(f"{argv[:2]}: a new interpreter: {why}\n")
    os.execv(python, [python, *argv])


def main() -> None:
    argv = sys.argv[1:]
    python = os.environ["HYFI_FORK_PYTHON"]
    sockets = os.environ.get("HYFI_FORK_SERVER", "").split(os.pathsep)
    runnable = argv and ((argv[0] in ("-m", "-c") and len(argv) > 1) or not argv[0].startswith("-"))
    if not sockets[0] or not runnable or "PYTHONHASHSEED" in os.environ:
        _real(python, argv, "no server, interpreter options, or a hash seed of its own")
    rank = int(os.environ.get("PMI_RANK") or os.environ.get("RANK") or 0)
    path = sockets[rank % len(sockets)]
    try:
        with open(path + ".env") as f:
            server_env = json.load(f)
    except OSError:
        _real(python, argv, f"{path}.env unreadable")
    mine = _startup(dict(os.environ))
    if _startup(server_env) != mine:
        differ = sorted(set(_startup(server_env).items()) ^ set(mine.items()))
        _real(python, argv, f"start-up variables differ: {differ}")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as err:
        conn.close()
        _real(python, argv, f"{path}: {err}")
    fds = sorted(int(n) for n in os.listdir("/proc/self/fd") if int(n) != conn.fileno())
    fds = [fd for fd in fds if _is_open(fd)]  # the listing's own descriptor is gone
    body = json.dumps(
        {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "fds": fds}
    ).encode()
    conn.sendmsg(
        [struct.pack("!I", len(body)) + body],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
    )
    for sig in _FORWARDED:
        signal.signal(sig, lambda s, _frame: conn.send(bytes([s])))
    answer = b""
    while b"\n" not in answer:
        data = conn.recv(4096)
        if not data:
            os._exit(70)  # the server went away without an answer
        answer += data
    _, status, kib = answer.split(b"\n")[0].split()  # b"end STATUS KIB"
    peaks = os.environ.get("HYFI_TEST_RANK_PEAKS")
    if peaks:
        with open(peaks, "a") as f:
            f.write(f"{int(kib)}\n")
    status = int(status)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught anyway
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    main()

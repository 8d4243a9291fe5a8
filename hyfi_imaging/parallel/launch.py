"""One bootstrap for ``mpirun``, ``torchrun``, SLURM's ``srun`` and a plain process.

Why MPI only for the bootstrap: PyTorch's MPI backend needs a source build,
while NCCL and Gloo come with every wheel. Under ``mpirun`` we read rank, size
and local rank from mpi4py, let rank 0 start the rendezvous store on a port the
kernel picks as it binds, broadcast the address, and then start an ordinary
NCCL (CUDA) or Gloo (CPU) process group on that store.
Under ``torchrun`` the environment already says everything. Under ``srun`` the
step's variables give rank, size and local rank, and rank 0 serves the store on
the step's first node at a port derived from the job id (see :mod:`.launcher_env`,
which also says which launcher wins when several left their variables). A plain
process gets a world of one with an in-memory store, so the same code runs everywhere.

Every collective gets a timeout: a dead rank must end the job with a clear
message, never a hang. :func:`fail_fast` turns an exception on any rank into a
one-line message and a non-zero exit without waiting for the others: an error
every rank raises alike (a configuration error, an agreed checkpoint failure)
is printed once, by rank 0; a file-system error is one line naming the file;
and when a peer vanished (killed, out of memory), the survivors name the lost
rank, found from the (host, pid) table the ranks exchange at start-up.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import datetime
import errno
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hyfi_imaging.errors import ConfigError, HyfiError
from hyfi_imaging.parallel.halo import Neighbours
from hyfi_imaging.parallel.launcher_env import (
    Launcher,
    launch_env,
    slurm_rendezvous,
    threads_per_rank,
)
from hyfi_imaging.parallel.layout import Layout
from hyfi_imaging.parallel.memory import configure_allocator

__all__ = [
    "ParallelContext",
    "detect_launcher",
    "error_chain",
    "build_meshes",
    "exit_now",
    "fail_fast",
    "fake_rank",
    "failure_line",
    "init_parallel",
    "launch_env",
    "launch_rank",
    "lost_ranks",
    "shutdown",
    "threads_per_rank",
]

T = TypeVar("T")
#: (host, pid) of every rank of the job, filled by :func:`init_parallel`.
_PEERS: list[tuple[str, int]] = []
#: What a transport says when the process at the other end is gone.
_PEER_GONE = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "socket closed",
)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: What a transport says when a collective waited past its timeout.
_TIMED_OUT = ("timed out", "timeout")
#: The collectives' timeout of this process (set by :func:`init_parallel`), for messages.
_TIMEOUT_S = [60.0]


def detect_launcher() -> Launcher:
    """Which launcher started this process, judged from its environment (see
    :func:`.launcher_env.launch_env` for the precedence when several are present)."""
    return launch_env().launcher


@dataclass
class ParallelContext:
    """The process groups of one rank, taken from a named mesh."""

    layout: Layout
    rank: int
    world_size: int
    local_rank: int
    launcher: Launcher
    backend: str
    device: torch.device
    mesh: DeviceMesh
    groups: dict[str, Any] = field(default_factory=dict)
    #: 1-D mesh of the ranks that share this rank's parameters (``dp`` x ``sy`` x ``sx``
    #: at its ``pp`` coordinate): FSDP2 shards over it. None when it has one rank.
    shard_mesh: DeviceMesh | None = None
    #: The global rank of every rank of :attr:`layout` (None: the same numbers). Two mirrored
    #: replicas on per-stage grids (:class:`~.mirrored.MirroredPlacement`) place each replica's
    #: layout on other global ranks; a rank's view of one replica maps through this.
    ranks: tuple[int, ...] | None = None
    #: This rank's view of each replica it holds a stage of (0: A, 1: B), when two mirrored
    #: replicas run on per-stage grids; empty otherwise. This context is then the view of the
    #: replica whose first stage it holds (it takes the input), else of A.
    slots: dict[int, ParallelContext] = field(default_factory=dict)

    @property
    def layout_rank(self) -> int:
        """This rank's number in :attr:`layout` (its global rank unless :attr:`ranks` maps)."""
        return self.rank if self.ranks is None else self.ranks.index(self.rank)

    def global_rank(self, layout_rank: int) -> int:
        """The global rank of rank ``layout_rank`` of :attr:`layout`."""
        return layout_rank if self.ranks is None else self.ranks[layout_rank]

    @property
    def coords(self) -> tuple[int, ...]:
        """(dp, pp, sy, sx) of this rank; (dp, pp, sz, sy, sx) on a 3-D grid, (dp, pp, sx) on
        a 1-D one."""
        return self.layout.coords(self.layout_rank)

    @property
    def branch(self) -> int:
        """This rank's coordinate in its branch group (:mod:`.branches`); 0 without one."""
        return self.layout.branch(self.layout_rank)

    @property
    def tile(self) -> tuple[int, ...]:
        """(row, column) of this rank's tile in the spatial grid; (slab, row, column) in 3-D."""
        return tuple(self.coords[2:])

    @property
    def grid(self) -> tuple[int, ...]:
        """The tile grid of this rank's pipeline stage (``layout.sp`` unless grids differ per stage)."""
        return self.layout.grid_of(self.coords[1])

    def group(self, name: str) -> Any:
        """Process group of a mesh axis (``dp``, ``pp``, ``br``, ``sz``, ``sy``, ``sx``) or ``sp``
        (all tile axes); with per-stage grids ``dp``, ``sp`` and ``replica`` (see
        :mod:`.junction`)."""
        if name not in self.groups:
            raise KeyError(f"no process group {name!r} in {self.layout.describe()}")
        return self.groups[name]

    def peer(self, *, dz: int = 0, dy: int = 0, dx: int = 0) -> int | None:
        """Global rank of the tile ``(dz, dy, dx)`` away in this rank's stage grid (``dz`` on
        3-D grids only), or None past the edge."""
        grid = self.grid
        step = (dz, dy, dx)[-len(grid) :]
        if any((dz, dy)[: 3 - len(grid)]):
            return None  # an axis this grid does not have (depth of a 2-D grid, rows of a 1-D)
        at = [c + d for c, d in zip(self.tile, step, strict=True)]
        if not all(0 <= a < g for a, g in zip(at, grid, strict=True)):
            return None
        return self.global_rank(self.layout.rank_of(*self.coords[:2], *at, br=self.branch))

    def neighbours(self) -> Neighbours:
        """The ranks of this tile's face neighbours, for the halo exchange."""
        return Neighbours(
            front=self.peer(dz=-1),
            back=self.peer(dz=1),
            up=self.peer(dy=-1),
            down=self.peer(dy=1),
            left=self.peer(dx=-1),
            right=self.peer(dx=1),
        )


def _mpi_environment(timeout: datetime.timedelta) -> tuple[int, int, int, int, Any]:
    """Rank, size, local rank and local size from MPI, and the rendezvous store (None:
    ``env://``).

    Without ``MASTER_ADDR``/``MASTER_PORT``, rank 0 starts the store on a port the
    kernel picks *while binding* (port 0) and broadcasts it: choosing a free port,
    closing it and binding it again later would let another job on the host (two
    trainings, a test's concurrent launches) take it in between and join the wrong
    job.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return rank, size, local_rank, local_size, None
    store = None
    addr_port = None
    if rank == 0:
        host = socket.gethostname()
        try:
            addr = socket.gethostbyname(host) if size > 1 else "127.0.0.1"
        except OSError:
            addr = "127.0.0.1"
        store = dist.TCPStore(addr, 0, size, True, timeout, wait_for_workers=False)
        addr_port = (addr, store.port)
    addr, port = comm.bcast(addr_port, root=0)
    if store is None:
        store = dist.TCPStore(addr, port, size, False, timeout)
    comm.Barrier()  # rank 0 keeps its store until every rank has connected to it
    # A later init in this process (after shutdown) finds RANK/WORLD_SIZE set and
    # rendezvouses with env://, on this address.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    return rank, size, local_rank, local_size, store


def _one_process_of_a_job(layout: Layout) -> None:
    """ConfigError for a multi-rank layout run by a bare ``python`` in an sbatch script.

    The batch script of a job sees ``SLURM_NTASKS=4`` but is one process: without
    ``srun`` the layout check would only say "needs 4 ranks but the job has 1".
    """
    job = os.environ.get("SLURM_JOB_ID")
    if job and layout.world_size > 1:
        raise ConfigError(
            "layout",
            f"{layout.describe()} needs {layout.world_size} ranks but this is one process of "
            f"SLURM job {job} (no srun step)",
            f"start it with srun inside the job script (srun -n {layout.world_size} <command>)",
        )


def init_parallel(
    layout: Layout,
    *,
    schedule: str | None = None,
    backend: str | None = None,
    timeout_s: float = 60.0,
) -> ParallelContext:
    """Start (or join) the process group for ``layout`` and build its mesh.

    ``schedule`` says where ranks are placed where the schedule decides it: ``bidirectional``
    on per-stage grids places two mirrored replicas (:class:`~.mirrored.MirroredPlacement`,
    more ranks than ``layout``); other schedules place ``layout``'s ranks as they are.
    The layout is checked against the world size before any group exists.
    The allocator is set first (:func:`.memory.configure_allocator`): per-rank peaks that do
    not depend on allocation order, and large buffers in huge pages.
    """
    configure_allocator()
    env = launch_env()
    launcher = env.launcher
    rank, world, local_rank, local_size = (
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
    )
    store = None
    chosen_port = "MASTER_PORT" in os.environ  # for the message if the port is taken
    if launcher == "mpi":
        rank, world, local_rank, local_size, store = _mpi_environment(
            datetime.timedelta(seconds=timeout_s)
        )
    elif launcher == "slurm" and world > 1:
        addr, port = slurm_rendezvous()
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    elif launcher == "single":
        _one_process_of_a_job(layout)
    if launcher == "mpi" or (launcher == "slurm" and world > 1):
        # torchrun's names, for code that reads them (and threads_per_rank); a later init in
        # this process (after shutdown) then rendezvouses with env:// at the same address.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_size),
            HYFI_LAUNCHED_BY=launcher,  # what started the ranks, for messages (launch_with)
        )
    from hyfi_imaging.parallel.mirrored import check_placed_world, mirrored, mirrored_context

    check_placed_world(layout, schedule, world)
    placement = mirrored(layout, schedule)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    # SLURM's --gpus-per-task or --gpu-bind can leave each rank a single visible device.
    device = (
        torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        if backend == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    _TIMEOUT_S[0] = timeout_s
    if not dist.is_initialized():
        if launcher == "single" or (launcher == "slurm" and world == 1):
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            unmet = HyfiError(
                f"rendezvous {where}",
                f"not every one of the job's {world} ranks reached it within "
                f"{timeout_s:g} s (parallel.timeout_s; no step ran)",
                "start every rank the layout takes, each able to reach rank 0 at that "
                "address, and relaunch",
            )
            watchdog = _rendezvous_watchdog(timeout_s, unmet)
            try:
                dist.init_process_group(
                    backend,
                    init_method=None if store is not None else "env://",
                    store=store,
                    rank=rank,
                    world_size=world,
                    timeout=timeout,
                    device_id=device if device.type == "cuda" else None,
                )
            except RuntimeError as err:
                if launcher == "slurm" and "address already in use" in str(err).lower():
                    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                    which = "MASTER_PORT" if chosen_port else "the port derived from the job id"
                    raise HyfiError(
                        f"rendezvous {where}",
                        f"{which} is in use on rank 0's node (another job?)",
                        "export MASTER_PORT=<a free port> in the job script and relaunch",
                    ) from err
                text = " ".join(str(e) for e in error_chain(err)).lower()
                if any(k in text for k in (*_TIMED_OUT, *_PEER_GONE)):  # never all met
                    raise unmet from err
                raise
            finally:
                watchdog.cancel()
    table: list[Any] = [None] * world

    context = partial(ParallelContext, layout, rank, world, local_rank, launcher, backend, device)
    if placement is not None:
        pc = mirrored_context(context, placement, device)
    else:
        pc = context(*build_meshes(layout, device, rank))
    dist.all_gather_object(table, (socket.gethostname(), os.getpid()))
    _PEERS[:] = table
    return pc


def _rendezvous_watchdog(timeout_s: float, unmet: HyfiError) -> threading.Timer:
    """A timer that ends this process with ``unmet``'s line if the rendezvous outlasts its
    timeout: PyTorch's first connection to the store waits without a limit where the port
    is held by something that accepts and never answers (a foreign server on the SLURM
    job's derived port: ranks 1 and up hung for good, rank 0 said why). No Python code can
    interrupt that call; the process exits with status 2, as a refused launch does."""

    def fire() -> None:
        print(f"error: {unmet}", file=sys.stderr, flush=True)
        os._exit(2)

    timer = threading.Timer(timeout_s * 1.25 + 10.0, fire)
    timer.daemon = True
    timer.start()
    return timer


def build_meshes(
    layout: Layout, device: torch.device, rank: int
) -> tuple[DeviceMesh, dict[str, Any], DeviceMesh | None]:
    """``layout``'s mesh, its named process groups (each mesh dimension, ``sp`` for the whole
    grid, ``shard`` for FSDP2) and FSDP2's shard mesh (None: one rank shares the parameters),
    for ``rank``, once the default process group exists. The one place they are built: the
    engine's groups (:func:`init_parallel`) and the tests' one-process snapshot of every
    rank (``tests/rank_facts.py``, on torch's fake backend) are the same."""
    if layout.junction:
        from hyfi_imaging.parallel.junction import junction_meshes

        return junction_meshes(layout, device, rank)
    mesh = init_device_mesh(device.type, layout.shape, mesh_dim_names=layout.mesh_dims)
    groups: dict[str, Any] = {name: mesh.get_group(name) for name in layout.mesh_dims}
    spatial = layout.spatial_axes
    groups["sp"] = mesh[spatial]._flatten("sp").get_group() if layout.sp_size > 1 else groups["sx"]
    shard_mesh = None
    if layout.dp * layout.sp_size > 1:
        shard_mesh = mesh[("dp", *spatial)]._flatten("shard")
        groups["shard"] = shard_mesh.get_group()
    return mesh, groups, shard_mesh


@contextlib.contextmanager
def fake_rank(layout: Layout, rank: int) -> Iterator[ParallelContext]:
    """``rank``'s context of ``layout`` in this process alone, on the CPU and torch's
    ``fake`` backend: every collective and message returns at once and moves nothing
    (received buffers keep whatever they held). The groups are :func:`build_meshes`', as :func:`init_parallel`
    builds them. For what one process can say about any rank without the others: the tests'
    snapshot of every rank's derived facts (``tests/rank_facts.py``), and what a rank's own
    work costs without its messages (``benchmarks/bench_spatial.py``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        device = torch.device("cpu")
        mesh, groups, shard_mesh = build_meshes(layout, device, rank)
        yield ParallelContext(
            layout, rank, layout.world_size, rank, "single", "gloo", device, mesh, groups,
            shard_mesh,
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def shutdown() -> None:
    """Destroy the process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """Flush and leave at once with ``code``, skipping interpreter teardown.

    After a distributed run, destructors of communicator threads can abort the
    process at exit ("terminate called without an active exception") although
    all work finished; the result must not depend on that.

    MPI is finalized first, and the process then leaves through the C library's ``exit``
    rather than ``os._exit``: MPICH tells its process manager that the rank finished
    (PMI ``finalize``) only in a C exit handler. A rank that skips it looks, to
    MPICH's proxy, like one that died, and when the proxy sees its socket close
    before it reaps the rank, it kills the ranks still running (SIGKILL, exit
    status 9) although every rank succeeded -- about 1 run in 8 of a 4-rank job here.
    The C library's ``exit`` also runs C++ static destructors (not Python's teardown):
    the commands destroy their process groups first (:func:`shutdown`), so no
    communicator thread is left for them to abort on.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        os._exit(code)
    if not mpi.Is_finalized():
        mpi.Finalize()  # mpiexec forwards a rank's output reliably only for ranks that finalize
    ctypes.PyDLL(None).exit(code)  # holding the GIL: exit handlers of extensions call Python
    os._exit(code)  # not reached


def launch_rank() -> int | None:
    """This process's rank: the process group's, else the launcher's environment; None alone."""
    if dist.is_initialized():
        return dist.get_rank()
    env = launch_env()
    return None if env.launcher == "single" else env.rank


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process on this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def lost_ranks() -> list[int]:
    """Ranks of this host's part of the job whose process is gone (from the start-up table)."""
    host = socket.gethostname()
    return [r for r, (h, pid) in enumerate(_PEERS) if h == host and not _alive(pid)]


def stopped_ranks() -> list[int]:
    """Ranks of this host's part of the job whose process is stopped (SIGSTOP, a debugger)."""
    host = socket.gethostname()
    found = []
    for r, (h, pid) in enumerate(_PEERS):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if h == host and state in ("T", "t"):
            found.append(r)
    return found


def _notes_dir() -> Path | None:
    """Where this job's ranks leave a note that they reported their own error (rank 0's
    host and pid name the job); None before the ranks know each other."""
    if not _PEERS:
        return None
    host, pid = _PEERS[0]
    return Path(tempfile.gettempdir()) / f"hyfi-job-{host}-{pid}"


def _note_reported(rank: int | None) -> None:
    """Tell this host's other ranks that this rank's failure is already said (one line)."""
    where = _notes_dir()
    if where is None or rank is None:
        return
    try:
        where.mkdir(exist_ok=True)
        (where / f"rank{rank}").touch()
    except OSError:
        pass


def _note_interrupted(rank: int | None) -> None:
    """Tell this host's other ranks that this rank ended on Ctrl-C (SIGINT), not a failure."""
    where = _notes_dir()
    if where is None or rank is None:
        return
    with contextlib.suppress(OSError):
        where.mkdir(exist_ok=True)
        (where / f"interrupted{rank}").touch()


def _peer_interrupted(err: BaseException, rank: int | None) -> bool:
    """Whether ``err`` is a peer gone because a Ctrl-C ended it first: a lost rank of this
    host left the note of :func:`_note_interrupted`, or the SIGINT reaches this rank too
    while it waits (up to 3 s) for the peers' exits to show.

    Why: mpiexec forwards SIGINT to the ranks one by one; a rank that exits on it first
    closes its sockets, and a peer still inside a collective saw "lost rank 1 ... out of
    memory?" instead of the one "interrupted" the user should read.
    """
    text = " ".join(str(e) for e in error_chain(err)).lower()
    if not any(k in text for k in _PEER_GONE):
        return False
    where = _notes_dir()
    deadline = time.monotonic() + 3.0
    try:
        while True:
            gone = [r for r in lost_ranks() if r != rank]
            if where is not None and any((where / f"interrupted{r}").exists() for r in gone):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except KeyboardInterrupt:
        return True


def _interrupted_exit(prog: str, rank: int | None) -> NoReturn:
    """Ctrl-C reaches every rank: said once (rank 0), exit status 130.

    The other ranks leave only once rank 0 has said it (its note ``said-interrupted``,
    or its process gone; up to 10 s, 3 s where rank 0 runs on another host). Why: a
    rank that leaves without MPI's finalize can make MPICH's proxy kill the ranks still
    running (see :func:`exit_now`). Rank 0 says it within a second even while it waits
    in a collective (:func:`_watch_interrupts`). Called by the main thread or the
    watcher, whichever comes first; the other waits for the exit.
    """
    if not _LEAVING.acquire(blocking=False):  # the other thread of this rank is leaving
        while True:
            time.sleep(3600)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut this short
    _note_interrupted(rank)
    where = _notes_dir()
    if rank in (None, 0):
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        if where is not None:
            with contextlib.suppress(OSError):
                (where / "said-interrupted").touch()
            time.sleep(0.2)  # the others leave first: their exit cannot take this rank's line
    elif where is not None:
        same_host = _PEERS[0][0] == socket.gethostname()
        deadline = time.monotonic() + (10.0 if same_host else 3.0)
        while time.monotonic() < deadline:
            if (where / "said-interrupted").exists() or (same_host and not _alive(_PEERS[0][1])):
                break
            time.sleep(0.05)
    os._exit(130)


#: Taken by the first thread of a rank that leaves on Ctrl-C (:func:`_interrupted_exit`).
_LEAVING = threading.Lock()


def _watch_interrupts(prog: str) -> None:
    """Take Ctrl-C (SIGINT) on a thread of its own in a multi-rank job, so that a rank says
    it and leaves even while its main thread waits inside a collective.

    Why: Python runs a signal's handler only when the main thread returns to the
    interpreter; a rank blocked in a gloo collective for a peer that was interrupted first
    never does, and was killed silent (MPICH's proxy, see :func:`exit_now`) -- rank 0's
    "interrupted" was lost about 1 run in 8. SIGINT is blocked in every thread (threads
    started later inherit that) and a daemon thread waits for it: it interrupts the main
    thread (KeyboardInterrupt, the usual path) and, if that has not left within a second,
    leaves itself (:func:`_interrupted_exit`). One process alone keeps Python's own handling.
    """
    if launch_env().launcher == "single" or not hasattr(signal, "pthread_sigmask"):
        return
    if threading.current_thread() is not threading.main_thread():
        return

    def watch() -> None:
        signal.sigwait({signal.SIGINT})
        _thread.interrupt_main()  # KeyboardInterrupt in the main thread at its next bytecode
        time.sleep(1.0)  # still inside C++ (a collective waiting for a peer): leave from here
        _interrupted_exit(prog, launch_rank())

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    threading.Thread(target=watch, name="hyfi-sigint", daemon=True).start()


def _reported(ranks: Sequence[int]) -> bool:
    """Whether every rank of ``ranks`` left the note of :func:`_note_reported`."""
    where = _notes_dir()
    return where is not None and bool(ranks) and all((where / f"rank{r}").exists() for r in ranks)


def error_chain(err: BaseException) -> list[BaseException]:
    """``err`` and the errors it was raised from (causes, then contexts), each once."""
    seen: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _first_line(err: BaseException) -> str:
    for e in error_chain(err):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        if lines:
            return lines[0]
    return type(err).__name__


def failure_line(err: BaseException, rank: int | None) -> tuple[str | None, bool]:
    """The one line to print for ``err`` on ``rank`` (None: stay quiet) and whether a trace helps."""
    who = "" if rank is None else f"rank {rank}: "
    err = next((e for e in error_chain(err) if isinstance(e, HyfiError)), err)
    if isinstance(err, HyfiError):
        if err.collective and rank not in (None, 0):
            return None, False
        return (f"error: {err}" if err.collective else f"{who}error: {err}"), False
    text = " ".join(str(e) for e in error_chain(err)).lower()
    if any(k in text for k in _TIMED_OUT):
        stopped = [r for r in stopped_ranks() if r != rank]
        what = (
            f"rank {', '.join(map(str, stopped))} (pid "
            f"{', '.join(str(_PEERS[r][1]) for r in stopped)} on {socket.gethostname()}) "
            "stopped answering: its process is stopped (SIGSTOP or a debugger)"
            if stopped
            else "another rank stopped answering (none of this host's ranks is stopped: one "
            "on another host, or one stuck far longer than the others)"
        )
        return (
            f"{who}error: {what}; a collective waited {_TIMEOUT_S[0]:g} s for it "
            "(parallel.timeout_s); find why it stalled, or raise parallel.timeout_s if a step "
            "legitimately takes longer, then relaunch the same command to resume from the last "
            "checkpoint.",
            False,
        )
    for e in error_chain(err):
        if isinstance(e, OSError) and e.strerror:
            where = f"{e.filename}: " if e.filename else ""
            fix = (
                "free space on that disk (or set train.out_dir to another one), then relaunch "
                "the same command to resume from the last checkpoint"
                if e.errno in _DISK_FULL
                else "check that path and its permissions"
            )
            return f"{who}error: {where}{e.strerror}; {fix}.", False
    if any(k in text for k in _PEER_GONE):
        # The peer's sockets close while it is still exiting: give the kernel a moment.
        deadline = time.monotonic() + 3.0
        gone = [r for r in lost_ranks() if r != rank]
        while not gone and _PEERS and time.monotonic() < deadline:
            time.sleep(0.05)
            gone = [r for r in lost_ranks() if r != rank]
        # Those that said why in their own line are not named again ("lost rank 1, 2, 3 ...
        # which exited or was killed" named a rank that had printed its own error).
        silent = [r for r in gone if not _reported([r])]
        if gone and not silent:  # one line in all
            return None, False
        what = (
            f"lost rank {', '.join(map(str, silent))} (pid "
            f"{', '.join(str(_PEERS[r][1]) for r in silent)} on {socket.gethostname()}), "
            "which exited or was killed"
            if silent
            else "lost contact with a rank on another host, which exited or was killed"
        )
        return (
            f"{who}error: {what}; see its output and the system log (out of memory?), then "
            "relaunch the same command to resume from the last checkpoint.",
            False,
        )
    return f"{who}error: {_first_line(err)}", True


def fail_fast(fn: Callable[[], T], *, prog: str) -> T:
    """Run ``fn``; on any exception print one line (see :func:`failure_line`) and exit at once.

    Exit status 2 for a :class:`HyfiError` (the user can fix it), 1 otherwise.
    ``os._exit`` skips interpreter teardown, which could otherwise block in a
    collective or in MPI_Finalize waiting for a rank that is already gone.
    """
    _watch_interrupts(prog)
    try:
        return fn()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _interrupted_exit(prog, launch_rank())
    except BaseException as err:
        rank = launch_rank()
        if _peer_interrupted(err, rank):  # the Ctrl-C ended a peer first
            _interrupted_exit(prog, rank)
        line, trace = failure_line(err, rank)
        if trace:
            traceback.print_exc(file=sys.stderr)
        if line is not None:
            print(f"{prog}: {line}", file=sys.stderr, flush=True)
            _note_reported(rank)
        elif isinstance(err, HyfiError):
            _await_rank0_line()
        sys.stdout.flush()
        os._exit(2 if isinstance(err, HyfiError) or _disk_full(err) else 1)


def _await_rank0_line() -> None:
    """A rank that leaves a collective error to rank 0 waits (up to 5 s on one host, 1 s
    across hosts) until rank 0 has said it (its note) or is gone. Why: this rank's exit
    without MPI's finalize can make MPICH's proxy kill rank 0 before it prints the one line
    (see :func:`exit_now`): the job would end with exit status 9 and no message. It looks
    every 2 ms: the proxy kills the ranks still waiting once rank 0's teardown (12-25 ms) ends,
    and the job then ends "Killed (signal 9)" although every rank exited 2."""
    if not _PEERS:
        return
    same_host = _PEERS[0][0] == socket.gethostname()
    deadline = time.monotonic() + (5.0 if same_host else 1.0)
    while time.monotonic() < deadline and not _reported([0]):
        if same_host and not _alive(_PEERS[0][1]):
            return
        time.sleep(0.002)


def _disk_full(err: BaseException) -> bool:
    """A full disk (or quota): the user can fix it, so it exits 2 like a HyfiError."""
    return any(isinstance(e, OSError) and e.errno in _DISK_FULL for e in error_chain(err))

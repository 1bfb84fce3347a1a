"""Every process a kvlease command starts stops with it, and leaves nothing behind.

`kvlease serve` and `kvlease dashboard` do their work in one child, and `supervise`
waits for it. The child runs in a new session (its own process group: a terminal's
Ctrl-C reaches the command only, which passes it on once) with the command's *run
folder*, `$TMPDIR/kvlease-run-<command>-<random>/`, as its `TMPDIR` and in
`KVLEASE_RUN_DIR`. Every process of its tree inherits that environment: the tree is
found by it (`members`), whatever parent or process group its processes end up with
(vLLM's resource tracker, data-parallel coordinator and API processes; Streamlit and
its What if replays), and by the child's process group (vLLM's engine cores and
workers rename themselves, which hides their environment); every temporary file the
tree makes (vLLM's ZMQ sockets, kvlease's channel sockets, What if folders) lands in
the folder.
`kvlease demo` and `kvlease replay` work in their own process: `interrupt_on_signals`
gives SIGTERM the orderly way out Ctrl-C takes, and each process they start gets
`die_with_parent`.

How a command stops (`supervise`):
1. SIGTERM and SIGINT to it are passed to the child.
2. The child has `deadline` seconds from the first signal to exit (its own drain and
   teardown), then the whole tree is killed. A child that has not called `mark_ready`
   yet (vLLM still starting its engine) has STARTING_STOP seconds: it has nothing to
   drain, and vLLM does not always let a signal interrupt its start.
3. Once the child has exited, the rest of its tree has LINGER seconds to follow (vLLM's
   resource tracker ends when its last user has), then it is killed, and the command
   returns once the killed have died (LINGER more at most).
4. The shared memory the tree had mapped (/dev/shm: vLLM's ring buffers and
   semaphores, which only an orderly exit unlinks), as noted at `mark_ready` and before
   any kill, is unlinked, and the run folder removed. The status is 128 + N when signal
   N stopped the command (the child ended as asked, or was asked while starting,
   however it ended) or ended the child, else the child's own (a failure).
If the command itself is killed (SIGKILL, OOM), the kernel sends its child SIGTERM
(Linux's parent-death signal), so the child stops as in 1 (vLLM's engine cores ask for
the same signal, and end their process group if their teardown outlasts ORPHAN_GRACE:
`stop_with_parent`); the run folder it leaves, any process still marked with it or in
its child's process group, and the shared memory it noted are removed by `sweep` at the
next start of any of these commands. Costs: `members` reads every /proc/<pid>/environ
it may read, O(the machine's processes), only while stopping, sweeping and once at
`mark_ready`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "KVLEASE_RUN_DIR"  # the run folder of a process's supervising command
SUPERVISED_ENV = "KVLEASE_SUPERVISED"  # set for the child only: the command it works for
OWNER_FILE = "owner.pid"  # the supervising command's pid
CHILD_FILE = "child.pid"  # its child's, which leads the child's process group
FOLDER_PREFIX = "kvlease-run-"
LINGER = 10.0  # seconds the rest of a tree has to end after the child has
STARTING_STOP = 10.0  # seconds a child not ready yet has to end once asked to
ORPHAN_GRACE = 30.0  # seconds an engine core whose parent died has for vLLM's teardown
READY_FILE = "ready"  # written by `mark_ready`
SHARED_MEMORY_FILE = "shared-memory"  # /dev/shm paths the tree mapped, one a line
_PR_SET_PDEATHSIG = 1
_STOPS = (signal.SIGTERM, signal.SIGINT)


def run_folder(command: str) -> Path:
    """A new run folder for `command`, owned by this process."""
    folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{command}-"))
    (folder / OWNER_FILE).write_text(str(os.getpid()))
    return folder


def child_environment(env: dict[str, str], folder: Path, command: str) -> dict[str, str]:
    """`env` for `command`'s child, whose tree is `folder`'s."""
    return {**env, RUN_DIR_ENV: str(folder), "TMPDIR": str(folder), SUPERVISED_ENV: command}


def supervised(command: str) -> bool:
    """Whether this process is `command`'s supervised child (the command's own process
    is not); the mark is taken out, so no process this one starts inherits it."""
    return os.environ.pop(SUPERVISED_ENV, None) == command


def members(folder: Path) -> list[int]:
    """Pids of the live processes marked with `folder` (this process excluded)."""
    mark = f"{RUN_DIR_ENV}={folder}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if mark in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def mark_ready() -> None:
    """Called in a supervised tree once its work is up (`kvlease serve`: vLLM's engine
    has started): a stop now gets the whole deadline, and the shared memory the tree
    maps is noted in the run folder, to be unlinked if the tree is killed. Nothing
    outside a supervised tree."""
    folder = os.environ.get(RUN_DIR_ENV)
    if folder and Path(folder).is_dir():
        tree = {os.getpid(), *members(Path(folder)), *_group(os.getpgid(0))}
        _note_shared_memory(Path(folder), sorted(tree))
        (Path(folder) / READY_FILE).touch()


def kill_tree(folder: Path, leader: int | None = None) -> None:
    """SIGKILL every process marked with `folder`, and `leader`'s process group; then
    unlink the shared memory noted for the tree (a killed process unlinks nothing)."""
    tree = members(folder) + (_group(leader) if leader is not None else [])
    _note_shared_memory(folder, tree)
    if leader is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(leader, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    _unlink_shared_memory(folder)


def _group(pgid: int) -> list[int]:
    """Pids in process group `pgid` (this process excluded): vLLM's engine processes,
    which `members` misses once vLLM renames them (setproctitle overwrites what /proc
    shows of their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[2]) == pgid:
                found.append(int(entry.name))
    return found


def _note_shared_memory(folder: Path, pids: Sequence[int]) -> None:
    """Add the /dev/shm files `pids` map to the folder's list. O(their mappings)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
                    found.add(path)
    if found:
        with contextlib.suppress(OSError), (folder / SHARED_MEMORY_FILE).open("a") as f:
            f.writelines(f"{path}\n" for path in sorted(found))


def _unlink_shared_memory(folder: Path) -> None:
    with contextlib.suppress(OSError):
        for path in set((folder / SHARED_MEMORY_FILE).read_text().split()):
            with contextlib.suppress(OSError):
                os.unlink(path)


def sweep(root: str | None = None) -> list[Path]:
    """Remove the run folders whose command is gone (it was killed: nothing cleaned up),
    killing what is left of their trees first; the folders removed. A folder without an
    owner file is left alone (nothing says whose it is)."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*"):
        owner = _pid(folder / OWNER_FILE)
        if owner is None or _alive(owner):
            continue
        # Its child's process group holds vLLM's renamed engine processes. The id cannot
        # be reused while any member lives; a live leader without the mark is another's.
        leader = _pid(folder / CHILD_FILE)
        if leader is not None and _alive(leader) and leader not in members(folder):
            leader = None
        kill_tree(folder, leader)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def supervise(argv: Sequence[str], env: dict[str, str], command: str, deadline: float) -> int:
    """Remove what killed commands left (`sweep`, said on standard output), then run
    `argv` as `command`'s child and wait for it and its whole tree (the module's
    docstring says how it stops); its exit status."""
    for stale in sweep():
        print(f"kvlease {command}: removed {stale}, left by a killed kvlease", flush=True)
    folder = run_folder(command)
    child = _Child(folder, deadline)
    previous = {sig: signal.signal(sig, child.stop) for sig in _STOPS}  # before it starts
    try:
        code = child.run(argv, child_environment(env, folder, command))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _unlink_shared_memory(folder)
        shutil.rmtree(folder, ignore_errors=True)
    return child.status(code)


class _Child:
    """The supervised child: the signals the command received, the deadline's timer."""

    def __init__(self, folder: Path, deadline: float) -> None:
        self.folder, self.deadline = folder, deadline
        self.proc: subprocess.Popen[bytes] | None = None
        self.received: list[int] = []
        self.timer: threading.Timer | None = None
        self.asked_while_starting = False  # the first signal came before it was ready

    def stop(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if self.proc is not None:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)
        if self.timer is None:  # the deadline runs from the first signal
            starting = self.asked_while_starting = not (self.folder / READY_FILE).exists()
            deadline = min(self.deadline, STARTING_STOP) if starting else self.deadline
            self.timer = threading.Timer(deadline, kill_tree, (self.folder, self.proc.pid))
            self.timer.daemon = True
            self.timer.start()

    def run(self, argv: Sequence[str], env: dict[str, str]) -> int:
        self.proc = start_child(argv, env)
        (self.folder / CHILD_FILE).write_text(str(self.proc.pid))
        if self.received:  # a signal came while it was starting
            self._forward(self.received[0])
        code = self.proc.wait()
        if self.timer is not None:
            self.timer.cancel()
        self._linger(self.proc.pid)
        return code

    def status(self, code: int) -> int:
        if self.asked_while_starting:  # it stopped as asked, however its start unwound
            return 128 + self.received[0]  # (vLLM may raise anything on the way out)
        if code < 0:  # a signal ended it (sent to it, or the deadline's SIGKILL)
            return 128 - code
        if self.received and code in (0, 128 + self.received[0]):
            return 128 + self.received[0]  # it stopped as asked
        return code

    def _linger(self, leader: int) -> None:
        """Give the rest of the tree (marked, or in the child's process group: vLLM's
        renamed engine cores) LINGER seconds to end, then kill it, and wait LINGER more
        at most for the killed to be gone: a process takes a moment to die of SIGKILL
        (an engine core frees gigabytes), and the command must not return before its
        tree has ended (a test saw a killed engine process still running after it had)."""
        left = _wait(LINGER, lambda: self._left(leader))
        kill_tree(self.folder, leader)
        _wait(LINGER, lambda: [p for p in left if _alive(p)])

    def _left(self, leader: int) -> list[int]:
        """The tree's processes still running: marked ones, and the child's group."""
        return [p for p in {*members(self.folder), *_group(leader)} if _alive(p)]


def _wait(seconds: float, pending: Callable[[], list[int]]) -> list[int]:
    """Until `pending()` is empty, at most `seconds`, collecting orphans meanwhile; what
    was still pending at the last look."""
    end = time.monotonic() + seconds
    left = pending()
    while left and time.monotonic() < end:
        _reap_orphans()
        time.sleep(0.05)
        left = pending()
    _reap_orphans()
    return left


@contextlib.contextmanager
def interrupt_on_signals(raise_interrupt: bool = True) -> Iterator[list[int]]:
    """Inside the block SIGTERM and SIGINT both raise KeyboardInterrupt, so a command that
    works in its own process takes its orderly way out on either (Python's default for
    SIGTERM is to die at once, skipping `finally` and pools' exits; a shell may have
    ignored SIGINT for a background job). Without `raise_interrupt` they are only
    recorded, for code that polls (an exception raised inside multiprocessing's pool
    machinery can deadlock it). Yields the signals received, for the exit status; the
    previous handlers are back after the block."""
    received: list[int] = []

    def interrupt(signum: int, _frame: object) -> None:
        received.append(signum)
        if raise_interrupt:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in _STOPS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_child(argv: Sequence[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[bytes]:
    """`argv` in a session of its own (a terminal's Ctrl-C reaches only this process,
    which passes it on), told to stop by the kernel if this process dies first."""
    parent = os.getpid()
    return subprocess.Popen(
        list(argv),
        env=env,
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(parent),
        **popen,
    )


def die_with_parent(parent: int) -> None:
    """In a child before exec: SIGTERM when `parent` dies (Linux's parent-death signal),
    and exit now if it already has (it died between fork and here)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def stop_with_parent(grace: float = ORPHAN_GRACE) -> None:
    """In a process vLLM starts in a supervised tree (its engine core): SIGTERM when its
    parent dies, and SIGKILL to its process group if it still runs `grace` seconds later.
    Without the signal an engine core outlives a killed API server for good (vLLM
    watches only the other way: its workers follow the engine core by a death pipe), and
    once vLLM renames it, its run-folder mark may no longer show in /proc; without the
    kill, a teardown that hangs does the same (make test saw an orphaned tree outlive
    180 s once). Nothing outside a supervised tree (plain `vllm serve` keeps vLLM's
    behaviour)."""
    if not os.environ.get(RUN_DIR_ENV):
        return
    parent = os.getppid()
    die_with_parent(parent)
    threading.Thread(
        target=_end_group_after, args=(parent, grace), name="kvlease-orphan", daemon=True
    ).start()


def _end_group_after(parent: int, grace: float) -> None:
    """Sleeps until `parent` exits (the kernel wakes it), then gives this process `grace`
    seconds to end by its SIGTERM; if it has not, ends its process group: the supervised
    child's, so the engine core, its workers and vLLM's resource tracker, whose API
    server is gone. No cost while the parent lives: one thread waiting on a pidfd."""
    try:
        pidfd = os.pidfd_open(parent)
    except OSError:  # a kernel before 5.3: the signal alone
        return
    waiting = select.poll()  # not select(): an engine core may hold fds past 1,024
    waiting.register(pidfd, select.POLLIN)
    waiting.poll()  # readable once the parent has exited
    time.sleep(grace)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _reap_orphans() -> None:
    """As a container's first process, orphans are re-parented to this one: collect
    them, or they stay zombies. (Anywhere else they go to init.)"""
    if os.getpid() != 1:
        return
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stat(pid: int) -> list[str] | None:
    """`pid`'s /proc fields after its command name (state, parent, process group, ...);
    None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet collected by its parent, does not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"

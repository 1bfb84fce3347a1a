"""A supervised command's tree stops with it and leaves nothing behind
(kvlease.engine.processes), through real processes: a child that starts a grandchild in
a session of its own (as vLLM's resource tracker and engines escape a process group) and
writes to its temporary folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import procs
import pytest
from waiting import until

from kvlease.engine import processes

HANG = 120  # seconds: a hang, not a slow machine

# The child: a grandchild in its own session (in `group` mode one in its process group
# instead), a file in TMPDIR, a shared memory file it maps, then it waits for a signal;
# `stubborn` ones ignore SIGTERM and SIGINT, and all but `starting` say they are ready
# (vLLM's engine is up).
CHILD = textwrap.dedent(
    """
    import mmap, os, signal, subprocess, sys, tempfile, time
    from kvlease.engine import processes
    stubborn = sys.argv[1].startswith("stubborn")
    fd = os.open(f"/dev/shm/kvlease-test-{os.getpid()}", os.O_CREAT | os.O_RDWR)
    os.ftruncate(fd, 4096)
    shared = mmap.mmap(fd, 4096)
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.argv[1] == "group":  # as vLLM's engine core: in the child's process group,
        # its mark hidden (vLLM renames it), and slow to end once told to
        slow = (
            "import os, signal, sys, time\\n"
            "def end(*_):\\n"
            "    time.sleep(0.5)\\n"
            "    open(os.environ['ENDED'], 'w').close()\\n"
            "    sys.exit(0)\\n"
            "signal.signal(signal.SIGTERM, end)\\n"
            "print('listening', flush=True)\\n"
            "time.sleep(600)\\n"
        )
        env = {k: v for k, v in os.environ.items() if k != processes.RUN_DIR_ENV}
        engine = subprocess.Popen([sys.executable, "-c", slow], env=env, stdout=subprocess.PIPE)
        engine.stdout.readline()  # its handler is in place: a SIGTERM now is its to handle
        # told to stop, it tells the engine and does not wait for it
        signal.signal(signal.SIGTERM, lambda *_: (engine.terminate(), os._exit(0)))
    else:
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    open(os.path.join(tempfile.gettempdir(), "socket"), "w").close()
    if sys.argv[1] != "stubborn-starting":
        processes.mark_ready()
    if not stubborn and sys.argv[1] != "group":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    while True:
        time.sleep(1)
    """
)
SUPERVISOR = textwrap.dedent(
    """
    import os, sys
    from kvlease.engine import processes
    child = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
    sys.exit(processes.supervise(child, dict(os.environ), "test", float(sys.argv[3])))
    """
)


def _supervisor(tmp_path: Path, mode: str = "polite", deadline: float = 60) -> subprocess.Popen:
    """A supervising command whose run folder goes under `tmp_path`; returns once its
    child is ready."""
    log = tmp_path / "supervisor.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, CHILD, mode, str(deadline)],
        env={**os.environ, "TMPDIR": str(tmp_path), "ENDED": str(tmp_path / "ended")},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    until(lambda: "ready" in log.read_text(), "the supervised child to start", HANG)
    return proc


def _folder(tmp_path: Path) -> Path:
    [folder] = tmp_path.glob(f"{processes.FOLDER_PREFIX}test-*")
    return folder


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_whole_tree_and_removes_its_folder(sig, tmp_path):
    proc = _supervisor(tmp_path)
    folder = _folder(tmp_path)
    tree = processes.members(folder)
    assert len(tree) == 2 and (folder / "socket").exists()  # child, escaped grandchild
    proc.send_signal(sig)
    assert proc.wait(HANG) == 128 + sig
    assert not procs.running(tree), "a process of the tree outlived its command"
    assert not folder.exists()


def test_the_command_returns_once_its_childs_process_group_has_ended(tmp_path):
    """A process of the child's group that `members` cannot see (vLLM renames its engine
    cores) and that takes a while to end once told to: the command waits for it to end
    by itself, up to LINGER, before it kills what is left, and returns after."""
    proc = _supervisor(tmp_path, "group")
    child = min(processes.members(_folder(tmp_path)))
    group = procs.group(os.getpgid(child))
    assert len(group) == 2  # the child and its unmarked engine
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(HANG) == 128 + signal.SIGTERM
    assert (tmp_path / "ended").exists(), "the engine was killed, not left to end"
    assert not procs.running(group)


def _shared_memory(pid: int) -> Path:
    return Path(f"/dev/shm/kvlease-test-{pid}")


def test_a_child_that_ignores_the_signal_is_killed_at_the_deadline(tmp_path):
    """...and the shared memory it mapped, which a killed process cannot unlink, goes."""
    proc = _supervisor(tmp_path, "stubborn", deadline=1)
    folder = _folder(tmp_path)
    tree = processes.members(folder)
    child = min(tree)
    assert str(_shared_memory(child)) in (folder / processes.SHARED_MEMORY_FILE).read_text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(HANG) == 128 + signal.SIGKILL  # the deadline's kill ended it
    assert not procs.running(tree) and not folder.exists()
    assert not _shared_memory(child).exists()


def test_a_child_still_starting_gets_the_short_deadline_and_the_signals_status(tmp_path):
    """Not ready yet (vLLM starting its engine, which may swallow the signal): killed
    after STARTING_STOP, not the drain deadline, and the status says it stopped as asked
    (nothing had started); the shared memory it mapped is noted before the kill."""
    proc = _supervisor(tmp_path, "stubborn-starting", deadline=HANG * 10)
    folder = _folder(tmp_path)
    tree = processes.members(folder)
    assert not (folder / processes.READY_FILE).exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(HANG) == 128 + signal.SIGTERM
    assert not procs.running(tree) and not folder.exists()
    assert not _shared_memory(min(tree)).exists()


def test_a_killed_commands_child_is_told_to_stop_and_the_next_sweep_cleans_up(tmp_path):
    proc = _supervisor(tmp_path)
    folder = _folder(tmp_path)
    child, grandchild = sorted(processes.members(folder))
    proc.kill()  # SIGKILL: the command cleans nothing
    proc.wait()
    until(lambda: not procs.running([child]), "the parent-death signal to stop the child", HANG)
    assert procs.running([grandchild]) and folder.exists()  # what a crash leaves
    live = tmp_path / f"{processes.FOLDER_PREFIX}live"
    live.mkdir()
    (live / processes.OWNER_FILE).write_text(str(os.getpid()))  # its command still runs
    unowned = tmp_path / f"{processes.FOLDER_PREFIX}unowned"  # nothing says whose: kept
    unowned.mkdir()
    assert processes.sweep(str(tmp_path)) == [folder]
    until(lambda: not procs.running([grandchild]), "the sweep to end the leftover", HANG)
    assert live.exists() and unowned.exists()
    assert not _shared_memory(child).exists()  # noted when it was ready, unlinked now


def test_only_the_supervised_child_sees_its_mark(monkeypatch):
    env = processes.child_environment({}, Path("/tmp/kvlease-run-x"), "serve")
    monkeypatch.setenv(processes.SUPERVISED_ENV, env[processes.SUPERVISED_ENV])
    assert not processes.supervised("dashboard")
    monkeypatch.setenv(processes.SUPERVISED_ENV, env[processes.SUPERVISED_ENV])
    assert processes.supervised("serve")
    assert processes.SUPERVISED_ENV not in os.environ  # its own children do not inherit it


# An engine core whose teardown hangs: it ignores the SIGTERM its parent's death brings.
HUNG_ENGINE = textwrap.dedent(
    """
    import signal, sys, time
    from kvlease.engine import processes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    processes.stop_with_parent(grace=0.5)
    print("ready", flush=True)
    while True:
        time.sleep(1)
    """
)
# Its API server: it starts the engine and waits.
API_SERVER = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)"


def test_an_orphaned_engine_whose_teardown_hangs_is_killed_with_its_group(tmp_path):
    """The API server is killed; its engine core ignores the SIGTERM that brings and would
    run for good: its process group is killed once the grace is over."""
    log = tmp_path / "engine.log"
    api = subprocess.Popen(
        [sys.executable, "-c", API_SERVER, sys.executable, "-c", HUNG_ENGINE],
        env={**os.environ, processes.RUN_DIR_ENV: str(tmp_path)},
        start_new_session=True,  # a group of its own, as kvlease serve's child has
        stdout=log.open("w"),
    )
    until(lambda: "ready" in log.read_text(), "the engine to start", HANG)
    [engine] = procs.children(api.pid)
    api.kill()
    api.wait()
    until(lambda: not procs.running([engine]), "the hung engine to be killed", HANG)

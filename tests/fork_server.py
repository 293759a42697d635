"""A Python that imported torch, torchvision and Lightning once, and forks a ``main.py`` run for each test that asks.

Each ``python main.py`` spends about 3.5 CPU-seconds importing before it does anything, as much as a tiny training
run takes; a test worker launches dozens. ``helpers.run_cli`` sends its run here instead: the server forks a process
that takes the run's working folder, environment and arguments, and runs ``main.py`` as ``python main.py ARGS`` would,
in a process group of its own, its output in a file. The ranks Lightning's subprocess launcher starts (``python
main.py ARGS`` again, with their ``LOCAL_RANK``) are forked the same way, into the run's group (``RankOrPopen``);
torchrun, ``ddp_spawn`` and the loader workers start as they always do. Tests whose promise is the entry point or a
launcher pass ``fresh=True`` (``MULTIGPU_TEST_FRESH=1`` makes every run fresh).

The server runs one thread and computes nothing, so that a fork copies no lock another thread held and no thread pool:
each request is taken by a forked go-between, which forks the run, sends its pid, forks the ranks the run asks for,
waits for all of them and sends how the run ended. It ends with the test process that started it.
"""

import contextlib
import gc
import importlib
import os
import pickle
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

PRELOADED = ["multigpu.commands"]  # torch, torchvision, torchmetrics, Lightning, jsonargparse and the package


def send(connection: socket.socket, message: object) -> None:
    data = pickle.dumps(message)
    connection.sendall(struct.pack("!Q", len(data)) + data)


def receive(connection: socket.socket) -> object:
    """The next message; ``EOFError`` where the other end closed before sending it."""

    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            if not (chunk := connection.recv(size - len(data))):
                raise EOFError
            data += chunk
        return data

    return pickle.loads(exactly(struct.unpack("!Q", exactly(8))[0]))


def _pythonpath(env: dict[str, str]) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


class RankOrPopen(subprocess.Popen):
    """``subprocess.Popen`` in a forked run, where ``python main.py ARGS`` as Lightning's subprocess launcher starts a
    rank (``Popen(command, env=..., cwd=...)``) is forked by the run's go-between instead (``ForkedRank``). Every other
    command is a ``Popen``."""

    ranks: socket.socket  # to the go-between: a rank asked for, its pid back, and each rank's exit code as it ends
    ended: dict[int, int] = {}  # by pid (one run per process)
    lock = threading.Lock()  # the launcher's observer thread polls too

    def __new__(cls, command, *args, **kwargs):
        if list(command[:2]) != [sys.executable, os.path.abspath(sys.argv[0])] or args or set(kwargs) - {"env", "cwd"}:
            return super().__new__(cls)
        request = {"main": command[1], "args": list(command[2:]), "cwd": kwargs.get("cwd") or os.getcwd()}
        with cls.lock:
            send(cls.ranks, {**request, "env": dict(kwargs.get("env") or os.environ)})
            while not isinstance(message := receive(cls.ranks), int):
                cls.ended.update([message])
        return ForkedRank(message)


class ForkedRank:
    """A rank forked by the go-between, as ``RankOrPopen`` returns it: what Lightning's launcher and its observer use
    of a ``Popen`` (``pid``, ``poll``, ``returncode``, ``send_signal``)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        with RankOrPopen.lock:
            # The go-between sends each exit code whole, so a readable byte means a whole message to read.
            while select.select([RankOrPopen.ranks], [], [], 0)[0]:
                try:
                    RankOrPopen.ended.update([receive(RankOrPopen.ranks)])
                except EOFError:  # the go-between is gone: nothing more will come
                    break
        self.returncode = RankOrPopen.ended.get(self.pid)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def _become(request: dict, base_path: list[str]) -> None:
    """Turn this forked process into ``python MAIN ARGS`` run in ``cwd`` with ``env``, its output into ``output``:
    the run's first process (a group of its own, as ``start_new_session``: its ranks and loader workers one group,
    which a timeout dumps whole), or a rank (in that group)."""
    os.setpgid(0, request.get("group", 0))
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # the go-between's blocked signals
    if "ranks" in request:
        RankOrPopen.ranks = socket.socket(fileno=request["ranks"])
        subprocess.Popen = RankOrPopen
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    with open(request["output"], "ab") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    main = str(request["main"])
    sys.path[:] = [str(Path(main).parent), *_pythonpath(request["env"]), *base_path]
    sys.argv[:] = [main, *request["args"]]
    if "group" in request:  # a rank: Lightning read rank 0 as the server imported it, before the launcher's LOCAL_RANK
        from lightning.pytorch.utilities import rank_zero_only

        rank_zero_only.rank = int(request["env"]["LOCAL_RANK"])
    if "OMP_NUM_THREADS" in request["env"]:  # OpenMP read the server's value as torch loaded
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    runpy.run_path(main, run_name="__main__")


def _take(connection: socket.socket) -> dict:
    """In the go-between: fork the run asked for and send its pid; fork each rank it asks for, into its group, and
    tell it each one's exit code as it ends; once the run and its ranks have ended, send the run's exit code (``-N``:
    signal N) and end. Returns the request in the run's process, or a rank's, alone. It holds the signals a test sends
    the run's group (Ctrl-C, a timeout's SIGABRT), which are not for it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGABRT})
    try:
        request = receive(connection)
        ranks, theirs = socket.socketpair()
        run = os.fork()
        if run == 0:
            connection.close()
            ranks.close()
            return {**request, "ranks": theirs.detach()}
        theirs.close()
        with contextlib.suppress(OSError):  # as the run does, whichever comes first
            os.setpgid(run, run)
        send(connection, run)
        children, exit_code, asking = {run}, None, [ranks]
        while children:
            if select.select(asking, [], [], 0.1)[0]:
                try:
                    asked = receive(ranks)
                except (EOFError, OSError):  # the run ended
                    asking = []
                    continue
                rank = os.fork()
                if rank == 0:
                    connection.close()
                    ranks.close()
                    return {**asked, "output": request["output"], "group": run}
                with contextlib.suppress(OSError):
                    os.setpgid(rank, run)
                children.add(rank)
                send(ranks, rank)
            while children and (ended := os.waitpid(-1, os.WNOHANG))[0]:
                children.discard(ended[0])
                code = os.waitstatus_to_exitcode(ended[1])
                if ended[0] == run:
                    exit_code = code
                else:
                    with contextlib.suppress(OSError):
                        send(ranks, (ended[0], code))
        send(connection, exit_code)
    except BaseException:  # the test process gone: nobody to tell
        pass
    os._exit(0)


def serve(address: str, alive: int) -> None:
    """Import ``PRELOADED``, then fork a run for each connection to ``address``, until ``alive`` (the read end of a
    pipe whose write end the test process holds) closes."""
    gc.disable()  # while the imports run, as in main.py
    for name in PRELOADED:
        importlib.import_module(name)
    gc.freeze()
    gc.enable()
    assert threading.active_count() == 1, threading.enumerate()
    base_path = sys.path[1 + len(_pythonpath(os.environ)) :]  # after the script's folder and PYTHONPATH
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the go-betweens are reaped as they end
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener, alive], [], [])
        if alive in ready:
            listener.close()
            os.unlink(address)
            os.rmdir(Path(address).parent)  # made for it
            return
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            os.close(alive)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # to wait for the run
            request = _take(connection)
            break
        connection.close()
    _become(request, base_path)  # the run's process alone gets here


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
    sys.exit(0)  # the server, or the run as the interpreter ends after the script: atexit handlers, output flushed

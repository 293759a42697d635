"""A Python that imported torch, torchvision and Lightning once, and forks a ``main.py`` run for each test that asks.

Each ``python main.py`` spends about 3.5 CPU-seconds importing before it does anything, as much as a tiny training
run takes; a test worker launches dozens. ``helpers.run_cli`` sends its run here instead: the server forks a process
that takes the run's working folder, environment and arguments, and runs ``main.py`` as ``python main.py ARGS`` would,
in a session of its own, its output in a file. Only the run's first process starts this way; the ranks Lightning
launches, torchrun and the loader workers start as they always do. Tests whose promise is the entry point or a launcher
pass ``fresh=True`` (``MULTIGPU_TEST_FRESH=1`` makes every run fresh).

The server runs one thread and computes nothing, so that a fork copies no lock another thread held and no thread pool:
each request is taken by a forked go-between, which forks the run, sends its pid, waits for it and sends how it ended.
It ends with the test process that started it.
"""

import gc
import importlib
import os
import pickle
import runpy
import select
import signal
import socket
import struct
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


def _become(request: dict, base_path: list[str]) -> None:
    """Turn this forked process into ``python MAIN ARGS`` run in ``cwd`` with ``env``, its output into ``output``."""
    os.setsid()  # as ``start_new_session``: its ranks and loader workers one group, which a timeout dumps whole
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
    if "OMP_NUM_THREADS" in request["env"]:  # OpenMP read the server's value as torch loaded
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    runpy.run_path(main, run_name="__main__")


def _take(connection: socket.socket) -> dict:
    """In the go-between: fork the run asked for, send its pid, wait for it, send its exit code (``-N``: signal N),
    and end. Returns the request in the run's process alone."""
    try:
        request = receive(connection)
        run = os.fork()
        if run == 0:
            connection.close()
            return request
        send(connection, run)
        _, status = os.waitpid(run, 0)
        send(connection, os.waitstatus_to_exitcode(status))
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

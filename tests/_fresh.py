"""A fresh Python process per measurement, started by forking one that has imported the frameworks.

NOTE [ forked children ]
The suite measures each memory figure in a process of its own (TensorFlow's
allocator peak, a resident set, a run of the README), and importing Keras and
its backend was most of such a child's time: TensorFlow and Keras take 6 s on
an idle 2-core machine and 11 s while the suite's other backend runs beside
it; a test of four children spent about half its time importing. `run` starts
the child as `subprocess.run([sys.executable, *argv])` would, but by forking
a *zygote*: a Python process that has imported Keras (its backend with it),
keras-hub and tf_keras where installed, and done nothing else. No op has run
there: TensorFlow's eager context, thread pools and allocator are made in the
child, at its first op (TF_CPU_ALLOCATOR_USE_BFC is read then, not at import;
the threading settings a child sets still apply), and JAX's and PyTorch's
devices likewise. So what a child measures it made itself, as in a process
started from nothing. The child gets the command's environment, working
folder, `sys.argv` and `sys.path[0]`; it exits with the command's status and
its stdout and stderr are captured. What a process reads only at start or
import (the Keras backend, the import path, glibc's malloc settings, XLA's
flags, whether tf.keras is tf_keras: `AT_START`) the zygote has read: each
distinct environment gets a zygote of its own (but for what is read later:
`LAZY`), and a child that sets an `AT_START` variable itself fails, saying
so (pass it in its environment instead). Where forking is not the same as
starting (not Linux; a GPU build of PyTorch, whose CUDA a forked child
cannot use once Keras has asked for its devices; KERAS_RECOMPUTE_TESTS_NO_FORK=1
to compare), it is `subprocess.run`; a child that must not have the frameworks imported
(`tests/test_config.py`), or children that run side by side (a zygote forks
one at a time: the multi-worker test's two workers), are started by
`subprocess`. A child of the same
zygote starts with the same NumPy global random state (Python's `random` is
reseeded at a fork); the suite's children seed what they draw.

Measured (2-core CPU, nothing else running, `KERAS_RECOMPUTE_TESTS_NO_FORK=1`
against the default): test_memory.py and test_policy_memory[tf_keras], 251 s
against 132 s; JAX's test_memory_falls, 50.7 s against 32.9 s.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Environment the frameworks read when a process starts or imports them (a child that sets one itself fails: its
# zygote read it before). A zygote per distinct environment, but for what is read later, in the child (`LAZY`).
AT_START = (
    "KERAS_BACKEND", "PYTHONPATH", "PYTHONHASHSEED", "MALLOC_MMAP_THRESHOLD_", "TF_ENABLE_ONEDNN_OPTS", "XLA_FLAGS",
    "TF_XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "KERAS_HOME", "TF_USE_LEGACY_KERAS", "JAX_PLATFORMS",
    "JAX_ENABLE_X64", "JAX_DEFAULT_MATMUL_PRECISION",
)
LAZY = ("PYTEST_CURRENT_TEST", "TF_CPU_ALLOCATOR_USE_BFC", "RECOMPUTE", "TF_KERAS", "INTER_OP_THREADS")
PRELOAD = ("keras", "keras_hub", "tf_keras")
# Where tf.keras is tf_keras (bert4keras, standalone-Keras code): Keras 3 stays out, as it would in such a process
# (bert4keras puts tf.keras in `sys.modules["keras"]`, and what had imported Keras 3 before keeps it).
PRELOAD_LEGACY = ("tensorflow", "tf_keras")

_ZYGOTE = r"""
import atexit, json, os, runpy, sys, threading, traceback, types

requests, replies = os.fdopen(int(sys.argv[1]), "r"), int(sys.argv[2])
at_start = json.loads(sys.argv[3])
for name in sys.argv[4:]:
    try:
        __import__(name)
    except ImportError:  # not installed, or hidden (KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW)
        pass
zygote_path = list(sys.path)


def child(request):
    code = 1
    try:
        os.setpgrp()
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                                (2, request["stderr"], os.O_WRONLY)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        os.close(replies)
        requests.close()
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        argv = request["argv"]
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *zygote_path[1:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *zygote_path[1:]]
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        changed = [name for name in at_start if os.environ.get(name) != request["env"].get(name)]
        if changed and not code:  # read by the zygote's imports, before this child's code set it
            print(f"_fresh: this child set {', '.join(changed)}, which the frameworks read at import, in the zygote: "
                  "pass it in the child's env instead (tests/_fresh.py)", file=sys.stderr)
            code = 1
        try:  # as an interpreter's exit: its threads joined, its exit functions run, its output flushed
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


os.write(replies, b'{"ready": true}\n')
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    os.write(replies, (json.dumps({"pid": pid}) + "\n").encode())
    _, status = os.waitpid(pid, 0)
    os.write(replies, (json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
"""


class _Zygote:
    def __init__(self, env):
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, str(requests_read), str(replies_write), json.dumps(AT_START),
             *(PRELOAD_LEGACY if env.get("TF_USE_LEGACY_KERAS") == "1" else PRELOAD)],
            env=env, pass_fds=(requests_read, replies_write), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(requests_read)
        os.close(replies_write)
        self._buffer = b""
        self._reply(None)  # ready

    def _reply(self, deadline):
        while b"\n" not in self._buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._replies], [], [], wait)[0]:
                return None
            chunk = os.read(self._replies, 4096)
            if not chunk:
                raise OSError("the zygote ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv, env, cwd, timeout):
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            for path in (out, err):
                open(path, "w").close()
            request = {"argv": list(argv), "env": env, "cwd": cwd, "stdout": out, "stderr": err}
            os.write(self._requests, (json.dumps(request) + "\n").encode())
            pid = self._reply(None)["pid"]
            reply = self._reply(None if timeout is None else time.monotonic() + timeout)
            if reply is None:
                os.killpg(pid, signal.SIGKILL)
                self._reply(None)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, _read(out), _read(err))
            return subprocess.CompletedProcess([sys.executable, *argv], reply["status"], _read(out), _read(err))

    def close(self):
        os.close(self._requests)
        self.process.wait(timeout=60)


KEPT = 3
_zygotes = {}
_lock = threading.Lock()


def run(argv, env=None, cwd=None, timeout=600, check=False):
    """`subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)`,
    by a fork of a zygote (NOTE [ forked children ]). `argv`: a script and its arguments, or `-c`, code, arguments."""
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd or os.getcwd())
    if not forks(env):
        done = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    else:
        key = tuple(sorted((name, value) for name, value in env.items() if name not in LAZY))
        with _lock:  # one child at a time per zygote: its replies come in order
            zygote = _zygotes.pop(key, None) or _Zygote(env)
            _zygotes[key] = zygote  # the most recent last
            while len(_zygotes) > KEPT:  # each holds its imports' memory (about 0.7 GB with TensorFlow)
                _zygotes.pop(next(iter(_zygotes))).close()
            done = zygote.run(argv, env, cwd, timeout)
    if check:
        done.check_returncode()
    return done


def forks(env=None):
    """Whether `run` forks for `env`: on Linux, unless KERAS_RECOMPUTE_TESTS_NO_FORK=1 or a GPU build of PyTorch
    would be imported (asking it for its devices initializes CUDA, which a forked child cannot use)."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or os.environ.get("KERAS_RECOMPUTE_TESTS_NO_FORK") == "1":
        return False
    if env.get("KERAS_BACKEND") == "torch":
        import torch

        return torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    return True


def _read(path):
    with open(path, errors="replace") as handle:
        return handle.read()


def _close_all():
    for zygote in _zygotes.values():
        try:
            zygote.close()
        except Exception:  # noqa: BLE001 - the session is ending
            zygote.process.kill()


atexit.register(_close_all)

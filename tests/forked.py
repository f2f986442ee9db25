"""`python ARGS` without paying for the imports: a fork of a server process that has imported torch
already.

Most tests start train.py, sample.py or torchrun, and most of such a process's CPU time is importing
torch and torch._dynamo (which building any torch.optim optimizer imports): about 3 CPU-s each, the
bulk of the suite on 2 cores. Here a run is a fork of tests/fork_server.py, started once per test
process, which has imported them; the child takes its own argv, sys.path, cwd, environment, stdout
and stderr and runs the script as __main__ at the server script's top level, so that it exits as the
interpreter exits after any script (fork_server.py says how). It is a real process: signals, exit
codes and DataLoader workers behave as in a fresh interpreter, and test_train checks that a forked
run and a fresh `python train.py` write the same losses and weights bit for bit. torchrun runs
forked too, and its workers are forks of the same server (tests/forked_torchrun.py asks the server
for them over its socket).

What the server fixed at its start stays: environment variables read at import (IMPORT_TIME_ENV: a
run, or a torchrun, that sets them differently runs in a fresh interpreter, as one without a number
in OMP_NUM_THREADS does; torch's thread count is set in the child from that number), warnings
printed while importing, the string hash seed.
So the tests of exact stderr and of signals start fresh interpreters in every session (pytest's
`fresh` marker sets FRESH for a test, see conftest.py), and HONESTGPT_TEST_FRESH=1 starts every run
fresh, to check the whole suite either way (docs/benchmarks.md has both times).
"""
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(REPO, 'tests', 'fork_server.py')
IMPORT_TIME_ENV = ('OMP_', 'MKL_', 'KMP_', 'PYTHON', 'TORCH', 'LC_', 'LANG', 'TMP', 'TEMP', 'ATEN_',
                   'ONEDNN_', 'DNNL_')
# read after the imports, not during them: what torchrun gives its workers, the folder that inductor
# writes into the environment when it first compiles (its default, which a fork would compute
# alike), and the thread count, which the child gives torch as a fresh interpreter would take it
# (fork_server.fresh_thread_count)
READ_LATER_ENV = ('TORCHELASTIC_', 'TORCH_NCCL_ASYNC_ERROR_HANDLING', 'TORCHINDUCTOR_CACHE_DIR',
                  'OMP_NUM_THREADS')
# in a run: the server's socket, where it may ask for runs of its own
SOCKET_ENV = 'HONESTGPT_FORK_SERVER'
FRESH = os.environ.get('HONESTGPT_TEST_FRESH') == '1'  # read when a run starts: a test may set it
_server = _socket = None  # the fork server, started with the first run, and its socket's path
_server_env = None  # the import-time variables it started with
_running = set()  # started and not yet waited for: stop_all() ends them


def server_socket():
    """The path of the fork server's socket (a run that has it in SOCKET_ENV asks the server from
    there); starts the server from this process's environment, as _server_env holds, if it is not
    running."""
    global _server, _server_env, _socket
    if _server is None:
        _server_env = import_time_env(os.environ)
        folder = tempfile.mkdtemp(prefix='fork-server-')
        _socket = os.path.join(folder, 'socket')
        _server = subprocess.Popen([sys.executable, SERVER, _socket], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        # after the server ends: atexit runs the last first
        atexit.register(shutil.rmtree, folder, True)
        atexit.register(_server.communicate)  # at the session's end: stdin closed, the server ends
    return _socket


def import_time_env(env):
    """The variables of env that a process reads as it imports torch."""
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_ENV) and not k.startswith(READ_LATER_ENV)}


def forks(env):
    """Whether a run with the environment env is a fork of the server, not a fresh interpreter: the
    import-time variables the server has (before it starts: this process's, which it will have)
    and a thread count that is a number, unless FRESH. A test's env may differ, or a library the
    test process imported may have set some in os.environ (scikit-learn, which transformers imports
    where it is installed, sets KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK; conftest.py undoes
    that after each test)."""
    server_env = import_time_env(os.environ) if _server_env is None else _server_env
    return (not FRESH and import_time_env(env) == server_env
            and env.get('OMP_NUM_THREADS', '').isdigit())


def _fork(request):
    """The pid of a new child of the fork server, which runs the request."""
    # a run of the server's, asking for one of its own
    if _server is None and SOCKET_ENV in os.environ:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(os.environ[SOCKET_ENV])
            connection.sendall(json.dumps(request).encode() + b'\n')
            with connection.makefile('rb') as f:
                return int(f.readline())
    server_socket()
    _server.stdin.write(json.dumps(request) + '\n')
    _server.stdin.flush()
    pid = _server.stdout.readline()
    if not pid:  # its stdout closed: it has exited
        _server.wait()
    _check_server()
    return int(pid)


def _check_server():
    """A run waited for would otherwise wait forever: nothing reaps it."""
    if _server is not None and _server.poll() is not None:
        raise RuntimeError(f'tests/fork_server.py exited with {_server.returncode}: its stderr '
                           f'says why')


class Process:
    """A started `python ARGS` with the parts of subprocess.Popen that tests use; its output
    captured, or appended to the files output names."""

    def __init__(self, *args, cwd=REPO, env=None, new_session=False, output=None):
        env = dict(os.environ if env is None else env)
        self.fresh = not forks(env)  # this run's way, also when a test changes FRESH later
        self.args, self.new_session = [sys.executable, *args], new_session
        self.stdout, self.stderr, self._returncode = None, None, None
        self.folder, self.captured = tempfile.mkdtemp(prefix='forked-'), output is None
        self.paths = output or [os.path.join(self.folder, name) for name in ('stdout', 'stderr')]
        for path in self.paths * self.captured:  # there even if the child dies before it opens them
            open(path, 'w').close()
        if self.fresh:
            with open(self.paths[0], 'a') as stdout, open(self.paths[1], 'a') as stderr:
                self.process = subprocess.Popen(self.args, cwd=cwd, env=env, stdout=stdout,
                                                stderr=stderr, start_new_session=new_session)
            self.pid = self.process.pid
        else:
            self.pid = _fork({'args': list(args), 'cwd': cwd, 'env': env,
                              'new_session': new_session, 'folder': self.folder, 'output': output})
        _running.add(self)

    @property
    def returncode(self):
        return self.poll()

    def poll(self):
        """The exit code, None while running: the server writes it into the run's folder as it reaps
        it."""
        if self._returncode is None and self.fresh:
            self._returncode = self.process.poll()
        elif self._returncode is None:
            try:
                with open(os.path.join(self.folder, 'returncode')) as f:
                    self._returncode = int(f.read())
            except FileNotFoundError:
                _check_server()
        return self._returncode

    def send_signal(self, signum, group=False):
        """As Popen's: nothing once the process has exited (the server reaps it, so its pid may be
        reused)."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signum) if group else os.kill(self.pid, signum)
            # exited just now; or no group yet: the child is before its setsid
            except ProcessLookupError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL, group=self.new_session)

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        if os.path.isdir(self.folder):  # the first wait after the exit collects the output
            if self.captured:
                self.stdout, self.stderr = (open(path, errors='replace').read()
                                            for path in self.paths)
            shutil.rmtree(self.folder)
            _running.discard(self)
        return self._returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return self.stdout, self.stderr


def stop_all():
    """Kill the runs still going (with their process groups where they have their own), remove their
    files."""
    for proc in list(_running):
        proc.kill()
        proc.wait()


def run(*args, cwd=REPO, env=None, timeout=300):
    """subprocess.run([sys.executable, *ARGS], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), except that a process still running after timeout seconds is killed before
    TimeoutExpired is raised."""
    proc = Process(*args, cwd=cwd, env=env)
    try:
        stdout, stderr = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

"""`python ARGS` without paying for the imports: a fork of a server process that has imported torch already.

Most tests start train.py, sample.py or torchrun, and most of such a process's CPU time is importing torch and
torch._dynamo (which building any torch.optim optimizer imports): about 3 CPU-s each, the bulk of the suite on 2 cores.
Here a run is a fork of multiprocessing's forkserver, which has imported them, and the child then does what the
interpreter does for `python SCRIPT ARGS` or `python -m MODULE ARGS` after start-up: its own argv, sys.path, cwd,
environment, stdout and stderr; the script run as __main__; the exit code of SystemExit, sys.excepthook and 1 on an
error, death by SIGINT on KeyboardInterrupt; non-daemon threads joined, atexit handlers run, stdio flushed. It is a
real process: signals, exit codes and DataLoader workers behave as in a fresh interpreter, and test_train checks
that a forked run and a fresh `python train.py` write the same losses and weights bit for bit. torchrun's workers
are fresh interpreters: torchrun starts them.

What the server fixed at its start stays: environment variables read at import (IMPORT_TIME_ENV: a run that sets
them differently is refused), warnings printed while importing, the string hash seed. So the tests of exact stderr
and of signals start fresh interpreters in every session (pytest's `fresh` marker sets FRESH for a test, see
conftest.py), and HONESTGPT_TEST_FRESH=1 starts every run fresh, to check the whole suite either way
(docs/benchmarks.md has both times).
"""
import atexit
import contextlib
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repo's own modules are not preloaded: each run imports them fresh, as it would; 'forked' holds the child's code
PRELOAD = ['numpy', 'torch', 'torch._dynamo', 'torch.distributed', 'torch.utils.data', 'tiktoken', 'forked']
IMPORT_TIME_ENV = ('OMP_', 'MKL_', 'KMP_', 'PYTHON', 'TORCH', 'LC_', 'LANG')
FRESH = os.environ.get('HONESTGPT_TEST_FRESH') == '1'  # read when a run starts: a test may set it
_context = multiprocessing.get_context('forkserver')
_context.set_forkserver_preload(PRELOAD)
_server_env = None  # the import-time variables the server started with
_running = set()  # started and not yet waited for: stop_all() ends them


def _main(args, cwd, env, new_session, stdout_path, stderr_path):
    """The child: `python ARGS` (a script and its arguments, or -m MODULE and its) from where the interpreter has started."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if new_session:  # as subprocess's start_new_session: a process group of its own, for killpg
        os.setsid()
    multiprocessing.set_start_method(None, force=True)  # the platform's default again (the child inherits 'forkserver')
    module = args[1] if args[0] == '-m' else None
    sys.argv = [None, *args[2:]] if module else list(args)  # run_module puts the module's file first
    # the script's folder (for -m, the working directory) first, and not the test session's own entries
    first = cwd if module else os.path.dirname(os.path.abspath(args[0]))
    sys.path[:] = [first] + [p for p in sys.path if p and p not in (first, REPO, os.path.join(REPO, 'tests'))]
    code, sigint = 0, False
    try:
        if module:
            runpy.run_module(module, run_name='__main__', alter_sys=True)
        else:
            runpy.run_path(args[0], run_name='__main__')
    except SystemExit as e:  # as the interpreter treats it: None is 0, a message goes to stderr with 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException as e:  # the script's own excepthook reports it, as the interpreter would call it
        sys.excepthook(type(e), e, e.__traceback__)
        code, sigint = 1, isinstance(e, KeyboardInterrupt)  # after a KeyboardInterrupt the interpreter dies of SIGINT
    threading._shutdown()  # what the interpreter does at exit, in its order
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if sigint:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class Process:
    """A started `python ARGS` with the parts of subprocess.Popen that tests use; stdout and stderr are captured."""

    def __init__(self, *args, cwd=REPO, env=None, new_session=False):
        global _server_env
        self.fresh = FRESH  # this run's way, also when a test changes FRESH later
        if _server_env is None:  # the server starts with the first run, from this process's environment
            _server_env = {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV)}
        env = dict(os.environ if env is None else env)
        import_time = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}
        if import_time != _server_env and not self.fresh:
            raise ValueError(f"the forkserver imported torch with {_server_env}, this run asks for {import_time}: "
                             "start it with subprocess")
        self.args, self.new_session, self.stdout, self.stderr = [sys.executable, *args], new_session, None, None
        self.folder = tempfile.mkdtemp(prefix='forked-')
        self.paths = [os.path.join(self.folder, name) for name in ('stdout', 'stderr')]
        for path in self.paths:  # there even if the child dies before it opens them
            open(path, 'w').close()
        if self.fresh:
            with open(self.paths[0], 'w') as stdout, open(self.paths[1], 'w') as stderr:
                self.process = subprocess.Popen(self.args, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                                                start_new_session=new_session)
        else:
            self.process = _context.Process(target=_main, args=(list(args), cwd, env, new_session, *self.paths))
            self.process.start()
            # not one of multiprocessing's children, which it joins at exit (a hung run would hang the session):
            # stop_all() ends what a failed test left running
            multiprocessing.process._children.discard(self.process)
        _running.add(self)
        self.pid = self.process.pid

    @property
    def returncode(self):
        return self.poll()

    def poll(self):
        return self.process.poll() if self.fresh else self.process.exitcode

    def send_signal(self, signum, group=False):
        """As Popen's: nothing once the process has exited (the forkserver reaps it, so its pid may be reused)."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signum) if group else os.kill(self.pid, signum)
            except ProcessLookupError:  # exited just now; or no group yet, the child has not reached its setsid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL, group=self.new_session)

    def wait(self, timeout=None):
        if self.fresh:
            self.process.wait(timeout)  # raises TimeoutExpired
        else:
            self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self.stdout is None:  # the first wait after the exit collects the output
            self.stdout, self.stderr = (open(path, errors='replace').read() for path in self.paths)
            shutil.rmtree(self.folder)
            _running.discard(self)
        return self.poll()

    def communicate(self, timeout=None):
        self.wait(timeout)
        return self.stdout, self.stderr


def stop_all():
    """Kill the runs still going (with their process groups where they have their own) and remove their files."""
    for proc in list(_running):
        proc.kill()
        proc.wait()


def run(*args, cwd=REPO, env=None, timeout=300):
    """subprocess.run([sys.executable, *ARGS], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout),
    except that a process still running after timeout seconds is killed before TimeoutExpired is raised."""
    proc = Process(*args, cwd=cwd, env=env)
    try:
        stdout, stderr = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

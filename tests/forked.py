"""`python ARGS` without paying for the imports: a fork of a server process that has imported torch already.

Most tests start train.py, sample.py or torchrun, and most of such a process's CPU time is importing torch and
torch._dynamo (which building any torch.optim optimizer imports): about 3 CPU-s each, the bulk of the suite on 2 cores.
Here a run is a fork of multiprocessing's forkserver, which has imported them, and the child then does what the
interpreter does for `python SCRIPT ARGS` or `python -m MODULE ARGS` after start-up: its own argv, sys.path, cwd,
environment, stdout and stderr; the script run as __main__; the exit code of SystemExit, a traceback and 1 on an error,
death by SIGINT on KeyboardInterrupt; atexit handlers; stdio flushed. It is a real process: signals, exit codes and
DataLoader workers behave as in a fresh interpreter, and test_train checks that a forked run and a fresh
`python train.py` write the same losses and weights bit for bit. torchrun's workers are fresh interpreters: torchrun
starts them.
"""
import atexit
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# third-party modules only: the repo's own are imported fresh by each run, as they would be
PRELOAD = ['numpy', 'torch', 'torch._dynamo', 'torch.distributed', 'torch.utils.data', 'tiktoken', 'forked']
_context = multiprocessing.get_context('forkserver')
_context.set_forkserver_preload(PRELOAD)


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
    # the script's folder (for -m, the working directory) first, and none of the test session's own entries
    first = cwd if module else os.path.dirname(os.path.abspath(args[0]))
    sys.path[:] = [first] + [p for p in sys.path if p and p != first and not p.startswith(REPO)]
    try:
        if module:
            runpy.run_module(module, run_name='__main__', alter_sys=True)
        else:
            runpy.run_path(args[0], run_name='__main__')
        code = 0
    except SystemExit as e:  # as the interpreter treats it: None is 0, a message goes to stderr with 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter prints it, then dies of SIGINT
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class Process:
    """A started `python ARGS` with the parts of subprocess.Popen that tests use; stdout and stderr are captured."""

    def __init__(self, *args, cwd=REPO, env=None, new_session=False):
        self.args, self.stdout, self.stderr = [sys.executable, *args], None, None
        self.folder = tempfile.mkdtemp(prefix='forked-')
        self.paths = [os.path.join(self.folder, name) for name in ('stdout', 'stderr')]
        for path in self.paths:  # there even if the child dies before it opens them
            open(path, 'w').close()
        env = dict(os.environ if env is None else env)
        self.process = _context.Process(target=_main, args=(list(args), cwd, env, new_session, *self.paths))
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def send_signal(self, signum):
        os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self.stdout is None:  # the first wait after the exit collects the output
            self.stdout, self.stderr = (open(path, errors='replace').read() for path in self.paths)
            shutil.rmtree(self.folder)
        return self.process.exitcode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return self.stdout, self.stderr


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

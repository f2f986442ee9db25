"""`python SCRIPT ARGS` without paying for the imports: a fork of a server process that has imported torch already.

Most tests start train.py or sample.py, and most of such a process's CPU time is importing torch and torch._dynamo
(which building any torch.optim optimizer imports): about 3 CPU-s each, the bulk of the suite on 2 cores. Here a run
is a fork of multiprocessing's forkserver, which has imported them, and the child then does what the interpreter does
for `python SCRIPT ARGS` after start-up: its own argv, cwd, environment, stdout and stderr; the script run as
__main__; the exit code of SystemExit, or a traceback and 1; atexit handlers; stdio flushed. It is a real process:
signals, exit codes and DataLoader workers behave as in a fresh interpreter, and test_train checks that a forked run
and a fresh `python train.py` write the same losses bit for bit. torchrun's workers and the signal tests start fresh
interpreters.
"""
import atexit
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# third-party modules only: the repo's own are imported fresh by each run, as they would be
PRELOAD = ['numpy', 'torch', 'torch._dynamo', 'torch.distributed', 'torch.utils.data', 'tiktoken', 'forked']
_context = multiprocessing.get_context('forkserver')
_context.set_forkserver_preload(PRELOAD)


def _main(script, args, cwd, env, stdout_path, stderr_path):
    """The child: `python SCRIPT ARGS` from the point where the interpreter has started."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    multiprocessing.set_start_method(None, force=True)  # the platform's default again (the child inherits 'forkserver')
    # as for a script: its folder first, and none of the test session's own entries
    folder = os.path.dirname(os.path.abspath(script))
    sys.path[:] = [folder] + [p for p in sys.path if p and p != folder and not p.startswith(REPO)]
    try:
        runpy.run_path(script, run_name='__main__')
        code = 0
    except SystemExit as e:  # as the interpreter treats it: None is 0, a message goes to stderr with 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start(script, *args, cwd=REPO, env=None):
    """Start `python SCRIPT ARGS` in cwd; the process has pid, join(), kill() and exitcode like any multiprocessing one."""
    folder = tempfile.mkdtemp(prefix='forked-')
    paths = [os.path.join(folder, name) for name in ('stdout', 'stderr')]
    for path in paths:  # there even if the child dies before it opens them
        open(path, 'w').close()
    proc = _context.Process(target=_main, args=(script, list(args), cwd, dict(os.environ if env is None else env), *paths))
    proc.start()
    proc.command, proc.folder = [sys.executable, script, *args], folder
    return proc


def finish(proc, timeout=300):
    """Wait for a started process, as subprocess.run(capture_output=True, text=True) does; killed after timeout seconds."""
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        shutil.rmtree(proc.folder)
        raise subprocess.TimeoutExpired(proc.command, timeout)
    stdout, stderr = (open(os.path.join(proc.folder, name), errors='replace').read() for name in ('stdout', 'stderr'))
    shutil.rmtree(proc.folder)
    return subprocess.CompletedProcess(proc.command, proc.exitcode, stdout, stderr)


def run(script, *args, cwd=REPO, env=None, timeout=300):
    """subprocess.run([sys.executable, SCRIPT, *ARGS], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)"""
    return finish(start(script, *args, cwd=cwd, env=env), timeout)

"""torchrun (python -m torch.distributed.run ARGS) whose workers are forks of tests/fork_server.py,
as the test's own runs are (tests/forked.py), instead of fresh interpreters that each import torch
anew (about 3 CPU-s a worker, most of a torchrun test's time on 2 cores). torchrun's
SubprocessHandler keeps its part (the environment, the process group, signals, exit codes,
restarts); only the subprocess.Popen it makes becomes a forked.Process, asked of the server over the
socket that HONESTGPT_FORK_SERVER names, with the worker's output going where the Popen's would:
this torchrun's stdout and stderr (files, as a forked run's are), or the files torchrun redirects
them to. Started by tests/conftest.py's torchrun_script as a forked run:
HONESTGPT_FORK_SERVER=SOCKET tests/forked_torchrun.py TORCHRUN_ARGS"""
import os
import runpy
import signal
import sys

from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler)

import forked

# the variables the server imported torch with: this process's now, as conftest.torchrun_script
# checked them (forked.forks), before torchrun adds its own
forked._server_env = forked.import_time_env(os.environ)


def popen(self, args, env):
    python, *args = args  # python -u SCRIPT ARGS
    assert python == sys.executable, f"torchrun starts {python}, not a Python script"
    output = [f.name if f else os.readlink(f'/proc/self/fd/{fd}') for fd, f in ((1, self._stdout),
                                                                                 (2, self._stderr))]
    return forked.Process(*args, cwd=os.getcwd(), env=env, new_session=True, output=output)


def close(self, death_sig=None):
    """As SubprocessHandler.close, by forked.Process: the server reaps a worker, so its group may be
    gone."""
    self.proc.send_signal(death_sig or signal.SIGTERM, group=True)
    for f in (self._stdout, self._stderr):
        if f:
            f.close()


SubprocessHandler._popen, SubprocessHandler.close = popen, close
runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)

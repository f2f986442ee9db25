"""tests/forked.py, the harness that forks test runs from a server that has imported torch, exits as the interpreter
does and leaves nothing behind. The same cases run in fresh interpreters too: what the harness must imitate."""
import os
import signal

import pytest

import forked


WAYS = pytest.mark.parametrize('way', ['forked', pytest.param('fresh', marks=pytest.mark.fresh)])


def script(tmp_path, text):
    path = tmp_path / 'script.py'
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize('text, code, stderr', [
    ("import sys\nsys.exit('error: one line')\n", 1, 'error: one line\n'),
    ("import sys\nsys.exit(2)\n", 2, ''),
    ("import sys\nsys.excepthook = lambda *e: print('hooked', e[0].__name__, file=sys.stderr)\nraise ValueError\n", 1,
     'hooked ValueError\n'),
    ("raise KeyboardInterrupt\n", -signal.SIGINT, None),
    ("import atexit, threading, time\natexit.register(print, 'atexit')\n"
     "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n", 0, ''),
])
@WAYS
def test_exits_as_the_interpreter_does(tmp_path, text, code, stderr, way):
    result = forked.run(script(tmp_path, text), cwd=str(tmp_path))
    assert result.returncode == code and (stderr is None or result.stderr == stderr), result
    if 'atexit' in text:  # the thread is joined before the atexit handlers run, as at interpreter exit
        assert result.stdout == 'thread\natexit\n'


@WAYS
def test_argv_path_and_cwd_are_the_scripts(tmp_path, way):
    path = script(tmp_path, "import os, sys\nprint(sys.argv, sys.path[0], os.getcwd(), __name__)\n")
    result = forked.run(path, 'a', '--b=1', cwd='/')
    assert result.stdout == f"{[path, 'a', '--b=1']} {tmp_path} / __main__\n"


def test_leftover_runs_are_stopped_and_import_time_settings_refused(tmp_path):
    proc = forked.Process(script(tmp_path, "import time\ntime.sleep(60)\n"), new_session=True)
    forked.stop_all()  # what the session does at its end for runs a failed test left going
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(proc.folder)
    if not forked.FRESH:  # a fresh interpreter reads them itself
        with pytest.raises(ValueError, match='start it with subprocess'):
            forked.Process('x.py', env={**os.environ, 'OMP_NUM_THREADS': '7'})

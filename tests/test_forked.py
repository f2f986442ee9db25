"""tests/forked.py, the harness that forks test runs from a server that has imported torch: a run
starts and exits as a fresh interpreter does, and nothing is left behind; torchrun's workers are
forks that torchrun supervises. The exit cases run in fresh interpreters too: what the harness must
imitate."""
import os
import signal
import socket
import subprocess
import sys

import pytest

import forked
from conftest import torchrun_script


WAYS = pytest.mark.parametrize('way', ['forked', pytest.param('fresh', marks=pytest.mark.fresh)])
# a hash seed other than the server's: a fresh interpreter's hashes show it, a fork's do not
OTHER_HASH_SEED = '124' if os.environ.get('PYTHONHASHSEED') == '123' else '123'


def script(tmp_path, text):
    path = tmp_path / 'script.py'
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize('text, code, stdout, stderr', [
    ("import sys\nsys.exit('error: one line')\n", 1, '', 'error: one line\n'),
    ("import sys\nsys.exit(2)\n", 2, '', ''),
    # stdout buffered (as without PYTHONUNBUFFERED) and a line left open on stderr: flushed after
    # atexit
    ("import atexit, sys\nsys.stdout.reconfigure(write_through=False)\n"
     "sys.stderr.reconfigure(write_through=False)\natexit.register(print, 'buffered')\n"
     "atexit.register(print, 'open line', end='', file=sys.stderr)\n", 0, 'buffered\n',
     'open line'),
    ("import sys\nsys.excepthook = lambda *e: print('hooked', e[0].__name__, file=sys.stderr)\n"
     "raise ValueError\n", 1, '', 'hooked ValueError\n'),
    ("raise KeyboardInterrupt\n", -signal.SIGINT, '', None),
    # the thread is joined before the atexit handlers run, as at interpreter exit
    ("import atexit, threading, time\natexit.register(print, 'atexit')\n"
     "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n", 0,
     'thread\natexit\n', ''),
    # a multiprocessing child (the platform's start method) is joined at exit: it prints after the
    # script
    ("import multiprocessing, time\n"
     "multiprocessing.Process(target=lambda: (time.sleep(0.3), print('child'))).start()\n"
     "print('main', flush=True)\n", 0, 'main\nchild\n', ''),
], ids=['message', 'code', 'flushed', 'excepthook', 'keyboard-interrupt', 'thread-atexit',
        'multiprocessing'])
@WAYS
def test_exits_as_the_interpreter_does(tmp_path, text, code, stdout, stderr, way):
    result = forked.run(script(tmp_path, text), cwd=str(tmp_path))
    assert result.returncode == code and result.stdout == stdout, result
    assert stderr is None or result.stderr == stderr, result


def test_a_run_starts_as_a_fresh_interpreter(tmp_path):
    # what the script sees of how it was started, and what the server must not pass on: its signal
    # handlers and wakeup fd, its request pipe (stdin) and any other open file
    path = script(tmp_path, "import os, signal, sys\n"
                            "print(sys.argv, sys.path, os.getcwd(), __name__, __file__, "
                            "sys.modules['__main__'].__file__)\n"
                            "print(signal.getsignal(signal.SIGINT), "
                            "signal.getsignal(signal.SIGCHLD), signal.set_wakeup_fd(-1), "
                            "os.readlink('/proc/self/fd/0'), os.listdir('/proc/self/fd'))\n")
    # relative to the working directory
    args = [os.path.join(tmp_path.name, 'script.py'), 'a', '--b=1']
    forked_run = forked.run(*args, cwd=str(tmp_path.parent))
    fresh = subprocess.run([sys.executable, *args], cwd=tmp_path.parent, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True)
    assert forked_run.returncode == fresh.returncode == 0, (forked_run, fresh)
    assert forked_run.stdout == fresh.stdout
    assert forked_run.stdout.startswith(f"{args} ['{tmp_path}', "), forked_run.stdout
    assert f" {tmp_path.parent} __main__ {path} {path}\n" in forked_run.stdout


def test_leftover_runs_are_stopped_and_other_import_time_settings_run_fresh(tmp_path, monkeypatch):
    proc = forked.Process(script(tmp_path, "import time\ntime.sleep(60)\n"), new_session=True)
    forked.stop_all()  # what the session does at its end for runs a failed test left going
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(proc.folder)
    if not forked.FRESH:  # else every run is fresh
        # settings read at the interpreter's start or torch's import, which the server has done: a
        # fresh interpreter reads them (the hash seed shows it)
        path = script(tmp_path, "print(hash('honestgpt'))\n")
        env = {**os.environ, 'PYTHONHASHSEED': OTHER_HASH_SEED}
        result = forked.run(path, env=env)
        fresh = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True)
        assert result.returncode == 0 and result.stdout == fresh.stdout, (result, fresh)
        # fresh too: no thread count to give torch; a fork with the server's own settings
        for env, runs_fresh in (({**os.environ, 'OMP_NUM_THREADS': '2,1'}, True),
                                ({k: v for k, v in os.environ.items() if k != 'OMP_NUM_THREADS'},
                                 True),
                                (None, False)):
            proc = forked.Process(path, env=env)
            assert proc.fresh == runs_fresh and proc.wait() == 0, proc
        # as a library the test process imports may do (scikit-learn: KMP_INIT_AT_FORK=FALSE)
        monkeypatch.setenv('KMP_INIT_AT_FORK', os.environ.get('KMP_INIT_AT_FORK', '') + 'x')
        proc = forked.Process(path)
        assert proc.fresh and proc.wait() == 0, proc
        # what is read after the imports may differ: inductor's cache folder, torchrun's worker
        # settings, and the thread count, which the run gets as a fresh interpreter does:
        # test_compile's 2, and more than this machine's cores (a fresh interpreter takes at most
        # those)
        path = script(tmp_path, "import os, torch\n"
                                "print(os.environ['TORCHINDUCTOR_CACHE_DIR'], "
                                "torch.get_num_threads())\n")
        for threads in ('2', str(os.cpu_count() + 1)):
            env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': str(tmp_path),
                   'TORCHELASTIC_RESTART_COUNT': '0', 'OMP_NUM_THREADS': threads}
            result = forked.run(path, env=env)
            fresh = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True)
            assert result.returncode == 0 and result.stdout == fresh.stdout, (result, fresh)
            assert result.stdout.startswith(f'{tmp_path} '), result


@pytest.mark.slow
def test_torchrun_workers_are_forks_that_torchrun_supervises(tmp_path):
    # rank 1 fails; rank 0, in the middle of a sleep, must be stopped by torchrun (SIGTERM to its
    # process group), with its line already out. One os.write a line: print() under python -u
    # writes each argument apart, and the two ranks' pieces interleaved on the shared stdout
    path = script(tmp_path, "import os, sys, time\n"
                            "rank = os.environ['RANK']\n"
                            "os.write(1, f\"rank {rank} parent {os.getppid()} own session \"\n"
                            "            f\"{os.getsid(0) == os.getpid()}\\n\".encode())\n"
                            "if rank == '1':\n"
                            "    time.sleep(1)\n"
                            "    sys.exit(3)\n"
                            "time.sleep(60)\n")
    result = torchrun_script(path, timeout=120)
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith('rank'))
    ranks = [line.split()[:2] for line in lines]
    assert result.returncode == 1 and ranks == [['rank', '0'], ['rank', '1']], result
    assert all(line.endswith('own session True') for line in lines), lines
    assert 'exitcode  : 3' in result.stderr and '(SIGTERM)' in result.stderr, result.stderr
    # forks of the server, which every other run of this test process comes from too
    if not forked.FRESH:
        assert {line.split()[3] for line in lines} == {str(forked._server.pid)}, lines


@pytest.mark.slow
def test_torchrun_with_other_import_time_settings_runs_fresh_workers(tmp_path):
    path = script(tmp_path, "import os\nos.write(1, f\"{hash('honestgpt')}\\n\".encode())\n")
    env_extra = {'PYTHONHASHSEED': OTHER_HASH_SEED}
    result = torchrun_script(path, nproc=1, env_extra=env_extra, timeout=120)
    fresh = subprocess.run([sys.executable, path], env={**os.environ, **env_extra},
                           capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == fresh.stdout, (result, fresh)


def test_a_client_that_dies_before_its_request_leaves_the_server_serving(tmp_path):
    if forked.FRESH:
        pytest.skip('no server: every run is a fresh interpreter')
    path = script(tmp_path, "print('served')\n")
    assert forked.run(path).stdout == 'served\n'  # the server is up: its socket is there
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as half_a_request:
        half_a_request.connect(forked.server_socket())
        half_a_request.sendall(b'{"args": [')
    result = forked.run(path)
    assert result.returncode == 0 and result.stdout == 'served\n', result

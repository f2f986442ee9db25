"""The server of tests/forked.py: imports what most test runs import, then forks a child per
request, and the child becomes `python ARGS` here, at this script's top level.

The child returns from serve() and runs the requested script or module as __main__; when that ends,
this script ends, and the interpreter exits as it does after any script: SystemExit's message or
sys.excepthook on stderr, non-daemon threads joined, atexit handlers run (which join
multiprocessing's children). The last of them, registered here first, flushes stdout and stderr and
ends the process with the interpreter's exit code (death by SIGINT after an uncaught
KeyboardInterrupt), but without the teardown of the modules that would follow: freeing the objects
of torch's imports costs a child, whose memory it shares with the server until it writes to it, 1.3
CPU-s. So objects still alive at exit are not finalized, as after os._exit: close files with `with`.

The server takes one request per line on stdin (JSON: args, cwd, env, new_session, folder, and
optionally output: the files stdout and stderr append to instead of the folder's), answers with the
child's pid on stdout, reaps its children and writes each one's exit status into its request's
folder. The same requests come over the Unix socket named by its argument, one per connection, from
its children (a forked torchrun asking for its workers: tests/forked_torchrun.py). It exits when
stdin closes. It never starts a thread: it forks.
"""
import atexit
import builtins
import glob
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import types

request = None  # in a child, what it runs (serve() returns it)
ended_by = None  # in a child, what ended its script: the exception, or None for its end


def exit_without_teardown():
    """In a child, after the other atexit handlers: what the interpreter does next, but the
    teardown."""
    if request is None:  # the server
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if isinstance(ended_by, KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    # as the interpreter reads it: None is 0, a message (printed) 1
    if isinstance(ended_by, SystemExit):
        os._exit(0 if ended_by.code is None else ended_by.code if isinstance(ended_by.code, int)
                 else 1)
    os._exit(0 if ended_by is None else 1)


# first, so that it runs last: after those the imports below register
atexit.register(exit_without_teardown)
# what most runs import and take about 3 CPU-s over (torch._dynamo: building any torch.optim
# optimizer imports it); the repo's own modules are left for each run to import, as it would
for name in ('numpy', 'torch', 'torch._dynamo', 'torch.distributed', 'torch.utils.data',
             'tiktoken'):
    importlib.import_module(name)


def serve(socket_path):
    """Fork a child per request, answer with its pid. Returns the request in a child, None at
    stdin's end."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen()
    wakeup, wakeup_write = os.pipe()  # SIGCHLD writes a byte to it, so that select wakes up to reap
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    # the handlers a fresh interpreter would have (SIGINT's is SIG_IGN where the test process
    # ignores it)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGCHLD, signal.SIGINT)}
    # only a handled signal writes to the wakeup fd
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    # Ctrl-C in a terminal ends the runs, not their reaper
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    folders, pending = {}, b''  # each running child's folder; stdin read past the last whole line
    while True:
        ready = select.select([0, wakeup, listener], [], [])[0]
        if wakeup in ready:
            os.read(wakeup, 4096)
            reap(folders)
        requests = []  # (request, where its answer goes)
        if 0 in ready:
            data = os.read(0, 65536)
            if not data:
                listener.close()
                return None
            *lines, pending = (pending + data).split(b'\n')
            requests += [(json.loads(line), None) for line in lines]
        if listener in ready:
            connection = listener.accept()[0]
            # the client writes one line at once, then waits for the answer
            connection.settimeout(10)
            try:
                with connection.makefile('rb') as f:
                    requests.append((json.loads(f.readline()), connection))
            # a client that stalled or died before its request was whole
            except (OSError, ValueError):
                connection.close()
        for request, connection in requests:
            pid = os.fork()
            # what the child must not inherit: the server's signal handling, pipes and socket
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (wakeup, wakeup_write):
                    os.close(fd)
                listener.close()
                for _, other in requests:
                    if other:
                        other.close()
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
                return request
            folders[pid] = request['folder']
            if connection:
                try:
                    connection.sendall(b'%d\n' % pid)
                except OSError:  # the client died waiting: nothing would watch or stop the run
                    os.kill(pid, signal.SIGKILL)
                connection.close()
            else:
                os.write(1, b'%d\n' % pid)


def reap(folders):
    """Write the exit status of each child that has ended, as Popen.returncode, into its folder,
    whole."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no children left
            return
        if pid == 0:  # none of them has ended
            return
        path = os.path.join(folders.pop(pid), 'returncode')
        with open(path + '.part', 'w') as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(path + '.part', path)


def fresh_thread_count(env):
    """torch's thread count in a fresh interpreter started with env. torch runs on OpenMP with MKL
    here, and takes MKL's count: MKL_NUM_THREADS, else OMP_NUM_THREADS, at most the physical cores
    (MKL_DYNAMIC's default). test_forked compares it with fresh interpreters."""
    cores = {(open(f'{cpu}/topology/physical_package_id').read(),
              open(f'{cpu}/topology/core_id').read())
             for cpu in glob.glob('/sys/devices/system/cpu/cpu[0-9]*')}
    return min(int(env.get('MKL_NUM_THREADS') or env['OMP_NUM_THREADS']),
               len(cores) or os.cpu_count())


def become(args, cwd, env, new_session, folder, output=None):
    """In the child: what the interpreter does to run `python [-u] SCRIPT ARGS` or `python [-u] -m
    MODULE ARGS`."""
    # stdin off the server's requests, stdout and stderr to the files the client reads; appended to,
    # as a file several processes write (torchrun's and its workers') must be
    output = output or [os.path.join(folder, name) for name in ('stdout', 'stderr')]
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, output[0], os.O_WRONLY | os.O_APPEND),
                            (2, output[1], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    # as the interpreter's: stdout and stderr unbuffered, each write passed on at once
    if args[0] == '-u':
        args = args[1:]
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, 'w', closefd=False),
                                                   write_through=True, encoding=stream.encoding,
                                                   errors=stream.errors)
                                  for fd, stream in ((1, sys.stdout), (2, sys.stderr)))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # torch took the server's at its import
    sys.modules['torch'].set_num_threads(fresh_thread_count(env))
    if new_session:  # as subprocess's start_new_session: a process group of its own, for killpg
        os.setsid()
    # sys.path[0] is the working directory; run_module puts the module's file in argv[0]
    if args[0] == '-m':
        sys.argv, sys.path[0] = args[1:], os.getcwd()
        runpy.run_module(args[1], run_name='__main__', alter_sys=True)
        return
    # sys.path[0] is the script's folder, __file__ its absolute path (sys.argv[0] stays as given),
    # and the script runs in a new __main__ module that stays in sys.modules, as the interpreter's
    # does
    path = os.path.abspath(args[0])
    sys.argv, sys.path[0] = args, os.path.dirname(os.path.realpath(path))
    main = types.ModuleType('__main__')
    main.__file__, main.__cached__, main.__builtins__ = path, None, builtins
    sys.modules['__main__'] = main
    with open(path, 'rb') as f:
        code = compile(f.read(), path, 'exec')
    exec(code, vars(main))


request = serve(sys.argv[1])
if request is not None:
    try:
        become(**request)
    # the interpreter reports it; exit_without_teardown takes the code from it
    except BaseException as e:
        ended_by = e
        raise

"""
nanoGPT-style configuration: start from the defaults that train.py (or bench.py, sample.py)
declares at module level, run each config file named on the command line (plain Python that
assigns some of those names), then apply --key=value overrides:

    python train.py config/tiny.py --batch_size=8 --compile=False

Every value is type-checked against its default, and unknown names fail with the closest known
ones, so a typo never trains the wrong model silently. No number may be negative, infinite or nan;
a script may also name each key's allowed values (choices) or a least value above 0 (minimums).
Returns the resolved config and where each value came from ('default', the config file's path, or
'command line').

fail() is how every script reports a user's mistake: one line naming the problem and the fix, exit
code 2.
"""
import ast
import difflib
import json
import math
import os
import sys
import time


class ConfigError(Exception):
    pass


def fail(message):
    """A user's mistake: one line on stderr, exit code 2 (the caller has written nothing yet)."""
    sys.stderr.write(f"error: {message}\n")  # one write: ranks failing at once keep their lines
    sys.stderr.flush()
    tell_torchrun(f"error: {message}")
    sys.exit(2)


def tell_torchrun(line):
    """Under torchrun, the line that ends this process also goes to the error file torchrun reads:
    its summary, printed last, below its own traceback, then names it as the failure's cause."""
    if 'TORCHELASTIC_ERROR_FILE' in os.environ:
        with open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w') as f:
            # the layout torchrun's own @record writes; its summary prints py_callstack
            json.dump({'message': {'message': line,
                                   'extraInfo': {'py_callstack': line,
                                                 'timestamp': str(int(time.time()))}}}, f)


def config_files(missing):
    """What config files a missing one may have meant: those in config/ (the scripts run from the
    repo's root) and in the folder it names, the closest name first."""
    folders = dict.fromkeys((os.path.dirname(missing), 'config'))  # in this order, once each
    found = {folder: sorted(f for f in os.listdir(folder) if f.endswith('.py'))
             for folder in folders if os.path.isdir(folder)}
    paths = {name: os.path.join(folder, name) for folder, names in found.items() for name in names}
    if not paths:
        return f"no config file is in {os.path.dirname(missing) or 'config'}/"
    close = difflib.get_close_matches(os.path.basename(missing), list(paths), n=1, cutoff=0.6)
    return (f"did you mean {paths[close[0]]}? " if close else '') + '; '.join(
        f"{folder}/ holds {', '.join(names)}" for folder, names in found.items())


def _unknown(key, defaults):
    close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(close)}?" if close
            else "see the defaults at the top of the script")
    return ConfigError(f"unknown config key '{key}': {hint}")


def _checked(key, value, default, origin):
    # ints are accepted where a float is expected (learning_rate=1 is fine); bools are not ints here
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(default):
        raise ConfigError(f"{origin}: {key}={value!r} has type {type(value).__name__}, "
                          f"expected {type(default).__name__} (like the default {default!r})")
    return value


def _parse(key, text, default):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if isinstance(default, str):
            return text  # --device=cpu: a bare word is a string
        expected = ('True or False' if isinstance(default, bool)  # not true, yes or 1
                    else f"{type(default).__name__} like the default {default!r}")
        raise ConfigError(f"command line: cannot parse --{key}={text}: write {expected}")
    if isinstance(default, str) and not isinstance(value, str):
        return text  # --out_dir=2024 stays the string '2024'
    return value


HELP = ('-h', '--help')


def print_help(settings=True):
    """-h or --help: the running script's docstring and, with settings, its settings as its source
    declares them (between its first two '# ---' lines: each default and what it means); exit
    code 0."""
    script = sys.modules['__main__']
    print((script.__doc__ or '').strip())
    if settings:
        with open(script.__file__) as f:
            parts = f.read().split('\n# ---')
        if len(parts) > 2:  # a script without the lines has no settings to show
            block = parts[1].partition('\n')[2]
            print(f"\nSettings, with their defaults (--key=value overrides one):\n\n{block}")
    sys.exit(0)


def configure(defaults, argv, choices=None, minimums=None):
    """defaults: {name: value} of int/float/bool/str; argv: sys.argv[1:]; choices: {name: allowed
    values}; minimums: {name: least value} where it is above 0. Returns (config, sources), both
    dicts over the same keys; with -h or --help among argv, prints them instead and exits."""
    if any(arg in HELP for arg in argv):
        print_help()
    config, sources = dict(defaults), {k: 'default' for k in defaults}
    for arg in argv:
        if not arg.startswith('--'):
            if not arg.endswith('.py'):
                hint = f": did you mean {arg}.py?" if os.path.isfile(arg + '.py') else ''
                # sample.py out/tiny: a run's folder, as report.py takes it
                if os.path.isfile(os.path.join(arg, 'metrics.jsonl')) and 'out_dir' in defaults:
                    hint = f": did you mean --out_dir={arg}?"
                raise ConfigError(f"'{arg}' is neither a config file (*.py) nor a --key=value "
                                  f"override{hint}")
            try:
                with open(arg) as f:
                    code = f.read()
            except OSError as e:
                raise ConfigError(f"cannot read config file {arg}: {e.strerror} "
                                  f"({config_files(arg)})")
            # as nanoGPT's, a file sees the settings so far: min_lr = learning_rate / 10
            namespace = dict(config)
            try:
                tree = ast.parse(code, arg)
                exec(compile(tree, arg, 'exec'), namespace)
            except (Exception, SystemExit) as e:  # exit() too: else the script ended, silently
                raise ConfigError(f"config file {arg} failed: {type(e).__name__}: {e}")
            # the names its code assigns, and the keys it changed otherwise (exec of another file,
            # import *): a key it leaves alone keeps its value and its source
            assigned = {node.id for node in ast.walk(tree)
                        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
            for key, value in namespace.items():
                if key.startswith('_') or (key in defaults and key not in assigned
                                           and value is config[key]):
                    continue
                if key not in defaults:
                    if callable(value) or type(value).__name__ == 'module':
                        continue  # imports and helpers a file may use: from math import sqrt
                    raise ConfigError(f"{arg}: " + str(_unknown(key, defaults)))
                config[key], sources[key] = _checked(key, value, defaults[key], arg), arg
        else:
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise ConfigError(f"'{arg}' has no value: write --{key}=VALUE")
            if key not in defaults:
                raise _unknown(key, defaults)
            value = _parse(key, text, defaults[key])
            config[key], sources[key] = (_checked(key, value, defaults[key], 'command line'),
                                         'command line')
    for key, allowed in (choices or {}).items():
        if config[key] not in allowed:
            *others, last = map(repr, allowed)
            listed = f"{', '.join(others)} or {last}" if others else last
            raise ConfigError(f"{key}={config[key]!r}: use {listed}")
    assert set(minimums or {}) <= set(config), (f"minimums names unknown keys: "
                                                f"{set(minimums) - set(config)}")
    # no setting is negative, infinite or nan (1e999 parses as inf; a config file may compute nan);
    # minimums name those that must be more
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not finite: use a finite number, like the default "
                              f"{defaults[key]!r}")
        if key in (minimums or {}) and value < minimums[key]:
            raise ConfigError(f"{key}={value} must be at least {minimums[key]}")
        if isinstance(value, (int, float)) and value < 0:
            raise ConfigError(f"{key}={value} must not be negative")
    return config, sources

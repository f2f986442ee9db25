"""report.py on real runs (finished, aborted, killed) and on made-up metrics for its diagnoses."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import matplotlib.image
import pytest
import torch

import forked
import report
from conftest import REPO, read_metrics, run_train


@pytest.fixture(scope='module')
def finished(tmp_path_factory, data_dir):
    out = str(tmp_path_factory.mktemp('report') / 'finished')
    run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10',
              '--test_eval=True', '--write_report=True')
    return out


def read_report(out_dir):
    with open(os.path.join(out_dir, 'report.md')) as f:
        return f.read()


def train_further(text):
    return next(line.strip()
                for line in text.splitlines() if line.startswith('    python train.py'))


def seconds_said(out_dir):
    """(report.md's wall time, train.log's last done line's time for every session), in s."""
    text = read_report(out_dir)
    with open(os.path.join(out_dir, 'train.log')) as f:
        done = [line for line in f if line.startswith('done:')][-1]
    return (re.search(r'- wall time [0-9.]+ h \(([0-9,]+) s\)', text)[1].replace(',', ''),
            re.findall(r' in ([0-9]+) s', done)[-1])


def test_finished_run(finished):
    # the folder as the other scripts take it (the refusals below: alone)
    result = subprocess.run([sys.executable, 'report.py', f'--out_dir={finished}'], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = read_report(finished)
    test = read_metrics(finished, 'test')[0]
    assert 'Status: **finished**: at iteration 20 of 20' in text
    assert (f"best val loss {test['best_val_loss']:.4f}" in text
            and f"at iteration {test['best_iter']}" in text)
    assert f"test loss {test['test_loss']:.4f}" in text
    # of how many windows: eval_iters batches' worth, a sample of the split's
    config = json.load(open(os.path.join(finished, 'config.json')))
    taken, split = test['test_windows']
    assert taken == config['eval_iters']['value'] * config['batch_size']['value'] < split
    assert f"on {taken} of its {split:,} windows with the best weights" in text
    report_seconds, done_seconds = seconds_said(finished)
    assert report_seconds == done_seconds
    eval_seconds = sum(e['seconds'] for e in read_metrics(finished, 'eval'))
    assert (f"- 2 evaluation(s): {eval_seconds:,.1f} s, "
            f"{eval_seconds / test['total_seconds']:.1%} of the wall time" in text)
    assert '| max_iters | **20** | command line |' in text and '| beta1 | 0.9 | default |' in text
    # a finished run has nothing left at its max_iters: the command raises it alone, and says that
    # the rate stays at min_lr (README's Resume)
    assert train_further(text).endswith('--init_from=resume --max_iters=40')
    assert 'reached min_lr at lr_decay_iters=20 and stays there' in text
    png = os.path.join(finished, 'curves.png')
    with open(png, 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    assert matplotlib.image.imread(png).ndim == 3


@pytest.mark.slow
def test_train_further_as_the_report_says_then_again(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10',
              '--write_report=True')
    # what the report tells the user to do: its command, as it stands
    result = forked.run(*shlex.split(train_further(read_report(out)))[1:])
    assert result.returncode == 0, result.stderr
    train = read_metrics(out, 'train')
    assert [r['step'] for r in train] == list(range(1, 41))
    # on at min_lr, as the report said: no second warm-up
    assert [r['lr'] for r in train[20:]] == [pytest.approx(3e-4)] * 20
    # the resumed run's own command holds --max_iters: the next one names it once, raised
    text = read_report(out)
    args = shlex.split(train_further(text))
    assert ([a for a in args if a.startswith(('--max_iters=', '--lr_decay_iters='))]
            == ['--lr_decay_iters=20', '--max_iters=80'])
    # the total over both sessions, as train.log's done line says it
    report_seconds, done_seconds = seconds_said(out)
    assert report_seconds == done_seconds


def test_aborted_run(finished, tmp_path, data_dir):
    out = str(tmp_path / 'aborted')
    result = run_train(out, data_dir, '--init_from=resume',
                       f"--resume_from={os.path.join(finished, 'last.pt')}",
                       '--max_iters=80', '--learning_rate=1e9', '--lr_decay_iters=1000',
                       check=False)
    assert result.returncode != 0
    abort = read_metrics(out, 'abort')[0]
    report.write_report(out)
    assert (f"Status: **aborted**: at iteration {abort['step']}: {abort['message']}"
            in read_report(out))


def test_killed_run(finished, tmp_path):
    out = str(tmp_path / 'killed')
    shutil.copytree(finished, out)
    records = [r for r in read_metrics(out) if r['kind'] != 'test']
    with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
        # killed mid-write
        f.write(''.join(json.dumps(r) + '\n' for r in records) + '{"kind": "train", "st')
    report.write_report(out)
    assert 'the run did not finish (killed or still running?) at iteration 20' in read_report(out)


# the least a report is written from
GOOD_RUN = {'metrics.jsonl': b'{"kind": "start", "step": 0, "time": 1.0}\n',
            'config.json': json.dumps({'max_iters': {'value': 10, 'source': 'default'},
                                       'log_interval': {'value': 1, 'source': 'default'},
                                       'resolved': {'device': 'cpu', 'dtype': 'float32'}}).encode(),
            'meta.json': b'{"command": ["train.py"], "world_size": 1}'}


@pytest.mark.parametrize('files, message', [
    ({'metrics.jsonl': None}, "run has no metrics.jsonl: pass the out_dir of a train.py run"),
    # a killed write that a later session appended to: the last line alone may lack its end
    ({'metrics.jsonl': b'{"kind": "start"}\n{"kind": "train", "st{"kind": "start"}\n'},
     "run/metrics.jsonl:2 is not a metrics record (Expecting ':' delimiter: line 1 column 24"),
    ({'metrics.jsonl': b'\xff\n'},
     "run/metrics.jsonl:1 is not a metrics record ('utf-8' codec can't decode byte 0xff"),
    ({'metrics.jsonl': b'[1, 2]\n'}, "run/metrics.jsonl:1 is not a metrics record ([1, 2]): the "
                                     "file is damaged; delete that line"),
    ({'config.json': b'{'}, "run/config.json is not JSON (Expecting property name"),
    ({'report.md/': b''}, "run/report.md: Is a directory: report.py reads the run's files"),
])
def test_mistakes_are_one_line_with_exit_2_and_write_nothing(tmp_path, files, message):
    (tmp_path / 'run').mkdir()
    for name, content in (GOOD_RUN | files).items():
        if name.endswith('/'):
            (tmp_path / 'run' / name).mkdir()
        elif content is not None:
            (tmp_path / 'run' / name).write_bytes(content)
    before = sorted(os.listdir(tmp_path / 'run'))
    result = subprocess.run([sys.executable, os.path.join(REPO, 'report.py'), 'run'],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == '', result.stderr
    assert (result.stderr.startswith(f"error: {message}")
            and result.stderr.count('\n') == 1), result.stderr
    assert sorted(os.listdir(tmp_path / 'run')) == before


def test_a_run_whose_metrics_are_damaged_ends_without_a_report_in_one_line(tmp_path, capsys,
                                                                            monkeypatch):
    # a session killed mid-write, then a resume from another folder's checkpoint appended to its
    # cut line: the run completed, then ended in a traceback and exit 1 at its report
    import runlog
    for name, content in GOOD_RUN.items():
        (tmp_path / name).write_bytes(content)
    with open(tmp_path / 'metrics.jsonl', 'ab') as f:
        f.write(b'{"kind": "train", "st{"kind": "start"}\n')
    monkeypatch.setattr(runlog, 'run_dir', str(tmp_path))
    monkeypatch.setattr(runlog, 'with_report', True)
    runlog.finish()
    assert capsys.readouterr().out == (
        f"no report: {tmp_path}/metrics.jsonl:2 is not a metrics record (Expecting ':' delimiter: "
        f"line 1 column 24 (char 23)): the file is damaged; delete that line, then run again "
        f"(python report.py {tmp_path})\n")
    assert not (tmp_path / 'report.md').exists()


@pytest.mark.parametrize('step, left, init_from', [
    (10, 'resume it', 'resume'),
    # after the last step: resume refuses a run at max_iters, auto does the end it left
    (20, 'its end (test split, sample) left', 'auto')])
def test_a_run_stopped_by_a_signal(finished, tmp_path, step, left, init_from):
    out = str(tmp_path / 'stopped')
    shutil.copytree(finished, out)
    records = ([r for r in read_metrics(out) if r['kind'] != 'test' and r.get('step', 0) <= step]
               + [{'kind': 'stop', 'step': step, 'time': 0.0, 'signal': 'SIGTERM'}])
    with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
        f.write(''.join(json.dumps(r) + '\n' for r in records))
    report.write_report(out)
    text = read_report(out)
    assert (f'Status: **stopped**: by SIGTERM at iteration {step} of 20: last.pt holds it, {left}'
            in text and text.rstrip().endswith(f' --init_from={init_from}'))


def test_a_run_whose_smoke_test_failed(finished, tmp_path):
    # smoke.py records its verdict, then ends the run in one line (exit 2): no step was taken
    out = str(tmp_path / 'failed')
    shutil.copytree(finished, out)
    records = [r for r in read_metrics(out) if r['kind'] not in ('train', 'eval', 'test')]
    records.append({'kind': 'smoke', 'step': 0, 'steps': 3, 'max_steps': 30, 'first_loss': 3.3,
                    'last_loss': float('nan'), 'seconds': 0.1, 'passed': False})
    with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
        f.write(''.join(json.dumps(r) + '\n' for r in records))
    report.write_report(out)
    text = read_report(out)
    assert 'Status: **failed**: its smoke test, before the first step' in text
    assert "Change what train.log's error line names, then redo the run:" in text


def train_record(step, time):
    # step 12 overflowed in float16 (skipped, its norm inf); step 25's gradient norm spiked
    return {'kind': 'train', 'step': step, 'loss': 2.0, 'lr': 1e-3,
            'grad_norm': {12: float('inf'), 25: 50.0}.get(step, 1.0),
            'tokens_per_sec': 1000.0, 'skipped': step == 12, 'skipped_total': int(step >= 12),
            'time': time, 'mfu': 0.25, 'utilization': 0.5 + 0.2 * (step % 2), 'peak_mem_mb': 123.0}


def made_up_config(max_iters, cost_per_hour):
    """config.json of a made-up run on a CPU in float32."""
    return {'max_iters': {'value': max_iters, 'source': 'command line'},
            'cost_per_hour': {'value': cost_per_hour, 'source': 'default'},
            'log_interval': {'value': 1, 'source': 'default'},
            'lr_decay_iters': {'value': max_iters, 'source': 'default'},
            'resolved': {'device': 'cpu', 'dtype': 'float32'}}


def made_up_report(out, config, meta, records):
    """report.md of a run folder written from these."""
    for name, content in (('config.json', json.dumps(config)), ('meta.json', json.dumps(meta)),
                          ('metrics.jsonl', ''.join(json.dumps(r) + '\n' for r in records))):
        with open(os.path.join(out, name), 'w') as f:
            f.write(content)
    report.write_report(out)
    return read_report(out)


def test_a_killed_run_s_report_resumes_from_the_iteration_last_pt_holds(tmp_path):
    out = tmp_path / 'run'
    out.mkdir()
    records = ([{'kind': 'start', 'step': 0, 'time': 1000.0}]
               + [train_record(s, 1000.0 + s) for s in range(1, 44)])
    text = made_up_report(str(out), made_up_config(100, 0.0), {'command': ['train.py']}, records)
    assert 'No last.pt yet: redo the run' in text
    # killed at 43, after last.pt was written at 40: the resume redoes 41-43
    torch.save({'iter_num': 40}, out / 'last.pt')
    text = made_up_report(str(out), made_up_config(100, 0.0), {'command': ['train.py']}, records)
    assert ('Status: **incomplete**: the run did not finish (killed or still running?) at '
            'iteration 43' in text)
    assert "Resume the run from last.pt's iteration 40 (from the directory it was" in text


def test_diagnoses_from_made_up_metrics(tmp_path):
    out = str(tmp_path / 'run')
    os.makedirs(out)
    config = made_up_config(100, 3.6)
    meta = {'command': ['train.py', 'config/tiny.py', '--init_from=auto', '--resume_from=x.pt'],
            'world_size': 2,
            'dataset': {'split_rule': 'contiguous: test [0, 0.05n), train [0.05n, 0.9n), val '
                                      '[0.9n, n) characters'}}
    # killed after iteration 30 and resumed 4000 s later: 30 s + 10 s of training, on 2 processes
    records = ([{'kind': 'start', 'step': 0, 'time': 1000.0}]
               + [train_record(s, 1000.0 + s) for s in range(1, 31)]
               + [{'kind': 'start', 'step': 30, 'time': 5000.0}]
               + [train_record(s, 4970.0 + s) for s in range(31, 41)])
    records += [{'kind': 'eval', 'step': s, 'train_loss': t, 'val_loss': v, 'ema_val_loss': v - 0.1,
                 'best_val_loss': 0, 'val_bits_per_token': 0}
                for s, t, v in ((10, 2.0, 2.05), (20, 1.4, 1.5), (30, 1.2, 1.6), (40, 1.0, 1.7))]
    # the loop's time includes the last evaluation, after the last timed record: 41 s
    records += [{'kind': 'test', 'step': 40, 'best_iter': 20, 'best_val_loss': 1.5,
                 'test_loss': 1.2, 'wall_seconds': 11.0, 'total_seconds': 41.0}]
    text = made_up_report(out, config, meta, records)
    assert 'Status: **early-stopped**: at iteration 40 of 100' in text
    assert 'overfitting from iteration 20' in text and 'leakage' not in text
    # ema_decay's val loss, beside the raw weights'
    assert ('the EMA of the weights: val 1.6000 (2.308 bits/token) at the last evaluation, '
            'best 1.4000' in text and 'best.pt holds the EMA of iteration 20, which' in text)
    assert ('median MFU 25.0%' in text and "mean utilization 60%: rank 0's CPU time over the wall "
            "time of torch's threads" in text
            and "peak memory 123 MB by the last training log line: rank 0's peak resident set"
            in text)
    assert 'test loss sits well below val loss: with a single text, test is its first 5%' in text
    assert ("(41 s), the training loop's in every session" in text
            and '0.02 compute hours (2 process(es))' in text and 'estimated cost 0.08' in text)
    assert ('float16 steps skipped: 1' in text
            and 'spikes (> 5x the running median): 1, at iterations 25' in text)
    # no last.pt: init_from=auto redoes the run from what it started from
    assert ('torchrun --standalone --nproc_per_node=2 train.py config/tiny.py --resume_from=x.pt '
            '--init_from=auto' in text)
    # with last.pt: a resume at this patience is refused, auto redoes the end: patience is raised
    config['patience'] = {'value': 3, 'source': 'command line'}
    open(os.path.join(out, 'last.pt'), 'w').close()
    text = made_up_report(out, config, meta, records)
    assert ('Train on past the early stop (from the directory it was started in), more '
            'patient:\n\n    torchrun --standalone --nproc_per_node=2 train.py config/tiny.py '
            '--init_from=resume --patience=6\n' in text), text


def test_tasks_added_on_resume_are_reported_from_the_evaluations_that_scored_them(tmp_path):
    # eval_tasks may change on resume: the evaluations before it hold no task's fields, and the
    # report's best acc_norm and curves raised KeyError at the run's end
    out = str(tmp_path / 'run')
    os.makedirs(out)
    config = made_up_config(30, 0.0)
    records = [{'kind': 'start', 'step': 0, 'time': 1000.0}]
    records += [train_record(s, 1000.0 + s) for s in range(1, 31)]
    for step, scored in ((10, {}), (20, {'qa/acc': 0.5, 'qa/acc_norm': 0.6, 'qa/chance': 0.25}),
                         (30, {'qa/acc': 0.5, 'qa/acc_norm': 0.4, 'qa/chance': 0.25,
                               'qa/examples': 100})):
        records.append({'kind': 'eval', 'step': step, 'train_loss': 2.0, 'val_loss': 2.1,
                        'best_val_loss': 2.1, 'val_bits_per_token': 3.0, **scored})
    text = made_up_report(out, config, {'command': ['train.py']}, records)
    assert ('- qa: acc 0.5000, acc_norm 0.4000 at the last evaluation, best acc_norm 0.6000 at '
            'iteration 20 (chance 0.2500; 100 examples)' in text)
    assert os.path.exists(os.path.join(out, 'curves.png'))


# (max_iters, lr_decay_iters, lr_schedule, decay_lr, float16's skipped steps, the sentence's words,
# the command's end)
FURTHER = [
    # resumed to 80 of config/tiny.py's 1500-iteration schedule: far from min_lr, so max_iters alone
    (80, 1500, 'cosine', True, 0, 'goes on along its schedule, which reaches min_lr at '
     'lr_decay_iters=1500 optimizer steps (80 taken)', '--init_from=resume --max_iters=160'),
    (80, 100, 'wsd', True, 0, 'goes on along its schedule', '--init_from=resume --max_iters=100'),
    # decayed: on at min_lr, since a longer cosine would be a second warm-up
    (80, 80, 'cosine', True, 0, 'reached min_lr at lr_decay_iters=80 and stays there (raising '
     'lr_decay_iters too would put it back up', '--init_from=resume --max_iters=160'),
    # float16 skipped 20 steps, which the schedule does not count: 20 more reach min_lr
    (80, 80, 'cosine', True, 20, 'goes on along its schedule, which reaches min_lr at '
     'lr_decay_iters=80 optimizer steps (60 taken)', '--init_from=resume --max_iters=100'),
    # README's way for wsd: from stable.pt, with a longer schedule
    (80, 60, 'wsd', True, 0, 'from stable.pt, written where the decay began',
     '--init_from=resume --resume_from=OUT/stable.pt --max_iters=160 --lr_decay_iters=160'),
    (80, 80, 'cosine', False, 0, 'Train further (from the directory it was started in):',
     '--init_from=resume --max_iters=160'),
]


@pytest.mark.parametrize('max_iters, decay_iters, schedule, decay_lr, skipped, says, command',
                         FURTHER, ids=['resumed-to-80-of-1500', 'decaying-to-100', 'decayed-cosine',
                                       'float16-skips', 'decayed-wsd', 'constant'])
def test_train_further_follows_the_schedule(tmp_path, max_iters, decay_iters, schedule, decay_lr,
                                            skipped, says, command):
    out = str(tmp_path / 'run')
    os.makedirs(out)
    for name in ('last.pt', 'stable.pt'):  # as a wsd run leaves them (only their presence counts)
        open(os.path.join(out, name), 'w').close()
    settings = {'max_iters': max_iters, 'lr_decay_iters': decay_iters, 'lr_schedule': schedule,
                'decay_lr': decay_lr, 'out_dir': out, 'log_interval': 1}
    config = ({k: {'value': v, 'source': 'command line'} for k, v in settings.items()}
              | {'resolved': {'device': 'cpu', 'dtype': 'float32'}})
    meta = {'command': ['train.py', 'config/tiny.py', f'--out_dir={out}', '--init_from=resume',
                        f'--max_iters={max_iters}']}
    records = ([{'kind': 'start', 'step': 0, 'time': 0.0},
                train_record(max_iters, 1.0) | {'skipped_total': skipped},
                {'kind': 'eval', 'step': max_iters, 'train_loss': 2.0, 'val_loss': 2.1},
                {'kind': 'test', 'step': max_iters, 'best_iter': max_iters, 'test_loss': None,
                 'total_seconds': 2.0}])
    text = made_up_report(out, config, meta, records)
    assert says in text
    assert train_further(text).endswith(command.replace('OUT', out))
    assert train_further(text).count('--max_iters=') == 1


def test_wall_time_is_the_done_line_s_once_a_run_completes():
    """Test records carry no time: the last save and the test evaluation come after the last
    timestamp, so a completed run's time is its test record's total_seconds (train.log's done
    line), and only a run without one falls back to timestamps (eval records here are untimed, as
    older runs' are)."""
    timed = ([{'kind': 'start', 'step': 0, 'time': 100.0}]
             + [{'kind': 'train', 'step': s, 'time': 100.0 + s} for s in (1, 2)]
             + [{'kind': 'start', 'step': 2, 'time': 900.0}]
             + [{'kind': 'train', 'step': s, 'time': 898.0 + s} for s in (3, 4)])
    ends = [{'kind': 'eval', 'step': 4}, {'kind': 'test', 'step': 4, 'total_seconds': 7.4}]
    assert report.wall_seconds(timed + ends)[0] == 7.4
    assert report.wall_seconds(timed + ends[:1])[0] == 2.0 + 2.0  # killed in its last evaluation
    # completed, then resumed and killed: the test record no longer ends the run
    resumed = [{'kind': 'start', 'step': 4, 'time': 2000.0}, {'kind': 'train', 'step': 5,
                                                               'time': 2001.0}]
    assert report.wall_seconds(timed + ends + resumed)[0] == 2.0 + 2.0 + 1.0
    assert report.wall_seconds([{'kind': 'eval', 'step': 4}]) is None


def test_the_evaluations_share_counts_a_run_killed_before_its_first_train_line():
    # an eval record has its time: a run killed in its second evaluation, before a train line, has
    # a wall time, and its evaluations' share is of it; older runs' untimed evaluations say nothing
    start = {'kind': 'start', 'step': 0, 'time': 100.0}
    evals = [{'kind': 'eval', 'step': 0, 'time': 130.0, 'seconds': 30.0}]
    lines = report.throughput_lines([start] + evals, [], {'resolved': {'device': 'cpu'}}, {})
    assert '- 1 evaluation(s): 30.0 s, 100.0% of the wall time (eval_interval' in '\n'.join(lines)
    untimed = [start, {'kind': 'eval', 'step': 0, 'time': 130.0}] + evals
    lines = report.throughput_lines(untimed, [], {'resolved': {'device': 'cpu'}}, {})
    assert not any('evaluation(s)' in line for line in lines)


def test_compute_hours_count_each_session_s_processes():
    # 3,600 s on one process, then a resume on 2 for 1,800 s: 2 compute hours, not 3 (the last
    # session's count times all of the time)
    records = [{'kind': 'start', 'step': 0, 'time': 0.0, 'world_size': 1},
               {'kind': 'train', 'step': 1, 'time': 3600.0},
               {'kind': 'start', 'step': 1, 'time': 9000.0, 'world_size': 2},
               {'kind': 'train', 'step': 2, 'time': 10800.0}]
    config = {'resolved': {'device': 'cpu'}, 'cost_per_hour': {'value': 3.0}}
    lines = '\n'.join(report.throughput_lines(records, [], config, {'world_size': 2}))
    assert ('1.50 h (5,400 s), from each session' in lines
            and '2.00 compute hours (1 and 2 processes by session)' in lines
            and 'estimated cost 6.00' in lines), lines


def test_fit_and_leakage_reads():
    def evals(*pairs):
        return [{'step': 10 * (i + 1), 'train_loss': t, 'val_loss': v}
                for i, (t, v) in enumerate(pairs)]
    assert report.fit_read(evals((3.0, 3.1), (2.5, 2.6), (2.0, 2.1))).startswith('underfitting')
    assert report.fit_read(evals((3.0, 3.1), (2.5, 2.6), (2.4, 2.65))).startswith('fitting')
    # both rising since the best, as overfit_one_batch's splits do or a rate too high
    assert report.fit_read(evals((3.0, 3.1), (2.5, 2.6), (2.6, 2.8), (3.5, 3.9))).startswith(
        'diverging from iteration 20')
    # a plateau (a run at min_lr) is no divergence
    assert report.fit_read(evals((2.5, 2.6), (2.5, 2.6001), (2.5, 2.6002))).startswith('fitting')
    # train records: the first epoch ends before the first evaluation, or after the last
    repeated, first_epoch = [{'step': 5, 'epoch': 1}], [{'step': 30, 'epoch': 0}]
    assert 'val loss sits 0.5000 below' in report.leakage(evals((2.0, 2.1), (1.5, 1.0)), [])
    tracking = evals((3.0, 3.0001), (2.5, 2.5001), (2.0, 2.0001))
    assert 'tracks train loss' in report.leakage(tracking, repeated)
    # within the first epoch, train text is as new as val text: on a large corpus they track
    assert report.leakage(tracking, first_epoch) is None
    assert report.leakage(evals((3.0, 3.1), (2.5, 2.6), (2.0, 2.1)), repeated) is None

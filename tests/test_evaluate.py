"""evaluate.py: multiple-choice accuracy checked against transformers' GPT2LMHeadModel on random
weights and the same token ids; the same counts on 1, 2 and 3 gloo ranks, replicated and sharded;
bad task files stop with FILE:LINE; the command on a trained run and on a Hugging Face folder.
Nothing is downloaded: the BPE is made here."""
import json
import os
import shutil
import random
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import evaluate
import forked
import hf
import sample
import tokenizer
from conftest import DEVICES, ok, read_metrics, run_train, torchrun, write_ranks
from model import GPT, GPTConfig

MERGES = [b'th', b'he', b'the', b' t', b'in', b'an', b'en', b' the', b'ing', b'oo']
N_VOCAB = 256 + len(MERGES) + 1  # the bytes, the merges and <|endoftext|>
BLOCK = 24  # the positions of the random GPT-2: short, so that many examples are truncated
WORDS = ['the', 'cat', 'then', 'thing', 'in', 'an', 'sees', 'moon', 'road', 'here', 'a', 'dog',
         'sing', 'went']
N_EXAMPLES = 13  # on 2 and 3 ranks with batches of 2, some ranks run fewer batches than others


def words(rng, low, high):
    return ' '.join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def task_lines(seed=0):
    """Examples in both formats, with contexts from 1 to 14 words (many too long for BLOCK), 2 to 5
    endings of 1 to 4 words, and fixed random labels."""
    rng, lines = random.Random(seed), []
    for i in range(N_EXAMPLES):
        context = words(rng, 1, 14)
        if i % 2:  # HellaSwag's layout, with its other fields
            endings = [words(rng, 1, 4) + '.' for _ in range(4)]
            lines.append({'ind': i, 'activity_label': 'test', 'ctx_a': context, 'ctx_b': '',
                          'ctx': context, 'endings': endings, 'label': rng.randrange(4),
                          'split': 'val'})
        else:  # generic: the choice carries its own separator
            choices = [rng.choice([' ', ', ', '']) + words(rng, 1, 4)
                       for _ in range(rng.randint(2, 5))]
            lines.append({'context': context, 'choices': choices,
                          'answer': rng.randrange(len(choices))})
    return lines


def write_jsonl(path, records):
    path.write_text(''.join(json.dumps(r) + '\n' for r in records))
    return str(path)


@pytest.fixture(scope='module')
def bpe(root):
    """(path of a tiny GPT-2-style .tiktoken BPE, its encode)."""
    write_ranks(root / 'tiny.tiktoken', MERGES)
    return str(root / 'tiny.tiktoken'), tokenizer.ranks_file(str(root / 'tiny.tiktoken')).encode


@pytest.fixture(scope='module')
def tiny_gpt2(root):
    """(a random GPT2LMHeadModel in float32, its save_pretrained folder). Every tensor is random, so
    that the losses of the endings are far apart and a wrong mask or position shows."""
    # seconds of imports: only the tests that need it
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    theirs = GPT2LMHeadModel(GPT2Config(vocab_size=N_VOCAB, n_positions=BLOCK, n_embd=32, n_layer=2,
                                        n_head=2))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
    theirs.save_pretrained(str(root / 'tiny-gpt2'))
    return theirs.eval(), str(root / 'tiny-gpt2')


@pytest.fixture(scope='module')
def task(root):
    return write_jsonl(root / 'task.jsonl', task_lines())


def reference_losses(theirs, encode, record):
    """(summed loss, token count) of each ending, scored the plain way: transformers' model, one
    ending at a time, the last BLOCK + 1 tokens of context + ending."""
    if 'ctx' in record:
        context, endings = encode(record['ctx']), [encode(' ' + e) for e in record['endings']]
    else:
        context, endings = encode(record['context']), [encode(c) for c in record['choices']]
    losses = []
    for ending in endings:
        tokens = torch.tensor(context + ending)[-(BLOCK + 1):]
        with torch.no_grad():
            logits = theirs(tokens[None, :-1]).logits[0]  # (T, vocab)
        loss = F.cross_entropy(logits[-len(ending):], tokens[-len(ending):], reduction='sum')
        losses.append((loss.item(), len(ending)))
    return losses


def test_losses_choices_and_accuracies_match_transformers(tiny_gpt2, bpe, task):
    theirs, folder = tiny_gpt2
    encode = bpe[1]
    records = task_lines()
    reference = [reference_losses(theirs, encode, r) for r in records]
    labels = [r.get('label', r.get('answer')) for r in records]
    # the set is as meant: truncated rows, acc and acc_norm choosing differently, no near-ties for
    # rounding to flip
    rows = [len(encode(r.get('ctx', r.get('context')))) + n
            for r, losses in zip(records, reference) for _, n in losses]
    assert (sum(length > BLOCK + 1 for length in rows) >= 10
            and sum(length <= BLOCK + 1 for length in rows) >= 10)
    choice = [min(range(len(ls)), key=lambda c: ls[c][0]) for ls in reference]
    choice_norm = [min(range(len(ls)), key=lambda c: ls[c][0] / ls[c][1]) for ls in reference]
    assert sum(a != b for a, b in zip(choice, choice_norm)) >= 3
    for losses in reference:
        for values in ([s for s, _ in losses], [s / n for s, n in losses]):
            assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1:]) > 1e-3

    args, state, _ = hf.load_gpt2(folder, None, None)
    # dropout on: only eval mode gives the reference's losses
    ours = GPT(GPTConfig(**args, dropout=0.5))
    ours.load_state_dict(state)
    examples = evaluate.read_task(task, encode, BLOCK)
    with torch.inference_mode():
        summed, mean, got_labels = evaluate.choice_losses(ours.eval(), examples, 3, 'cpu',
                                                          nullcontext())
    assert got_labels.tolist() == labels and summed.shape == (N_EXAMPLES, 5)
    for i, losses in enumerate(reference):
        expected = torch.tensor([s for s, _ in losses] + [float('inf')] * (5 - len(losses)))
        assert torch.allclose(summed[i], expected, atol=1e-4, rtol=1e-5)
        assert torch.allclose(mean[i],
                              expected / torch.tensor([n for _, n in losses]
                                                      + [1] * (5 - len(losses))),
                              atol=1e-5, rtol=1e-5)
    assert summed.argmin(1).tolist() == choice and mean.argmin(1).tolist() == choice_norm

    modes = []  # the model's training flag and inference mode, at each forward of score()
    hook = ours.register_forward_hook(lambda module, args, out: modes.append(
        (module.training, torch.is_inference_mode_enabled())))
    result = evaluate.score(ours.train(), examples, 3, 'cpu', nullcontext())
    hook.remove()
    # 13 examples in batches of 3; train mode given back
    assert ours.training and modes == [(False, True)] * 5
    correct = sum(c == label for c, label in zip(choice, labels))
    correct_norm = sum(c == label for c, label in zip(choice_norm, labels))
    chance = sum(1 / len(losses) for losses in reference) / N_EXAMPLES
    assert result == {'examples': N_EXAMPLES, 'correct': correct, 'correct_norm': correct_norm,
                      'acc': correct / N_EXAMPLES, 'acc_norm': correct_norm / N_EXAMPLES,
                      'chance': chance}
    # one batch, other padding
    assert evaluate.score(ours, examples, 13, 'cpu', nullcontext()) == result


def test_rows_keep_the_ending_and_the_last_context_tokens(tmp_path):
    encode = lambda text: [ord(c) for c in text]  # a character per token
    path = write_jsonl(tmp_path / 't.jsonl', [
        {'ctx': 'abcdefghij', 'endings': ['xy', 'z'], 'label': 1},  # HellaSwag: ' ' + ending
        # 7 tokens: 1 of context is left
        {'context': 'abcdefghij', 'choices': ['1234567', '12'], 'answer': 0},
        # generic, with a label of its own: it was refused as a HellaSwag line without ctx
        {'context': 'abcdefghij', 'choices': ['1234567', '12'], 'answer': 0, 'label': 'B'},
    ])
    first, second, third = evaluate.read_task(path, encode, block_size=7)
    assert first == evaluate.Example([encode('fghij xy'), encode('efghij z')], [3, 2], 1)
    assert second == third == evaluate.Example([encode('j1234567'), encode('efghij12')], [7, 2], 0)
    assert len(evaluate.read_task(path, encode, block_size=100, max_examples=1)) == 1


@pytest.mark.parametrize('line, message', [
    ('{"ctx": "a", "endings": ["b", "c"], "label": 0', "not valid JSON"),
    # a traceback before
    ('{"x": ' + '[' * 10**5 + ']' * 10**5 + '}', "not valid JSON (maximum recursion depth"),
    ('["a", "b"]',
     "neither HellaSwag's fields (ctx, endings, label) nor the generic ones (context, choices, "
                   "answer)"),
    ('{"question": "a"}', "neither HellaSwag's fields"),
    ('{"ctx": "a", "endings": ["b", "c"]}',
     "the field 'label' is missing: a HellaSwag line needs ctx, endings, "
                                            "label"),
    ('{"context": "a", "answer": 0}',
     "the field 'choices' is missing: a generic line needs context, choices, answer"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": 2}',
     "label=2 is not an index of the 2 endings: use an int from 0 "
                                                        "to 1"),
    ('{"context": "a", "choices": ["b", "c"], "answer": -1}',
     "answer=-1 is not an index of the 2 choices"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": "1"}', "label='1' is not an index"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": true}', "label=True is not an index"),
    ('{"ctx": "a", "endings": ["b"], "label": 0}', "endings must be a list of at least 2 strings"),
    ('{"context": "a", "choices": "bc", "answer": 0}',
     "choices must be a list of at least 2 strings"),
    ('{"ctx": "a", "endings": ["b", ""], "label": 0}',
     "endings[1] is '': every candidate must be a non-empty"),
    ('{"context": "a", "choices": ["b", 3], "answer": 0}',
     "choices[1] is 3: every candidate must be a non-empty"),
    ('{"context": "", "choices": ["b", "c"], "answer": 0}', "context must be a non-empty string"),
    # a tokenizer's traceback before
    ('{"context": "a", "choices": ["b", "\\udc00"], "answer": 0}',
     "a lone surrogate '\\udc00' is not text: fix or drop that line"),
    ('{"context": "a", "choices": ["b", "123456789"], "answer": 0}',
     "an ending of 9 tokens leaves no room for context in block_size=8: shorten it"),
])
def test_a_bad_line_is_named_with_its_file_and_line(tmp_path, line, message):
    good = '{"context": "a", "choices": ["b", "c"], "answer": 0}\n'
    path = tmp_path / 'task.jsonl'
    path.write_text(good + '\n' + line + '\n' + good)  # line 3, after a blank line
    with pytest.raises(evaluate.TaskError) as e:
        evaluate.read_task(str(path), lambda text: [ord(c) for c in text], block_size=8,
                           max_examples=1)
    assert (str(e.value).startswith(f"{path}:3: ") and message in str(e.value)
            and '\n' not in str(e.value))


def test_an_empty_or_missing_task_file_or_two_of_one_name_are_errors(tmp_path):
    (tmp_path / 'empty.jsonl').write_text('\n\n')
    for name, message in (('empty.jsonl', 'holds no examples'),
                          ('none.jsonl', 'cannot read the task file')):
        with pytest.raises(evaluate.TaskError, match=message):
            evaluate.read_task(str(tmp_path / name), list, 8)
    with pytest.raises(evaluate.TaskError, match='no task file'):
        evaluate.read_tasks(' , ', list, 8)
    # two files of one name (or one named twice) would share one name in metrics.jsonl
    (tmp_path / 'other').mkdir()
    (tmp_path / 'other' / 'empty.jsonl').write_text('\n')
    for paths in (f'{tmp_path}/empty.jsonl,{tmp_path}/other/empty.jsonl',
                  f'{tmp_path}/none.jsonl, {tmp_path}/none.jsonl'):
        with pytest.raises(evaluate.TaskError, match="two task files in tasks='.*' are named "
                                                     "'(empty|none)': their scores would share"):
            evaluate.read_tasks(paths, list, 8)


def test_characters_a_char_vocabulary_lacks_are_named_once_per_task_file(tmp_path, capsys):
    tok = tokenizer.char(sorted(set('the cat sees a bird.')))
    task = write_jsonl(tmp_path / 'marks.jsonl', [
        {'context': 'the cat é', 'choices': [' sees [a]', ' sees {a}'], 'answer': 0},
        {'context': 'the cat', 'choices': [' sees a bird.', ' sees a cat.'], 'answer': 1},
        {'ctx': 'the cat', 'endings': ['sees é', 'sees a'], 'label': 1}])
    clean = write_jsonl(tmp_path / 'clean.jsonl', [
        {'context': 'the cat', 'choices': [' sees a bird.', ' sees a cat.'], 'answer': 1}])
    tasks = evaluate.read_tasks(f'{task},{clean}', tok.encode, 32, unknown=tok.unknown)
    assert capsys.readouterr().err == (
        f"warning: {task}: characters not in the vocabulary, scored as the unknown id 0, in 2 of "
        f"3 examples: 'é', '[', ']', '{{', '}}'\n")
    # scored as before: the unknown id 0
    assert tasks[task] == evaluate.read_task(task, tok.encode, 32)
    assert tasks[task][0].rows[0][8] == 0
    # only the examples scored count; ten characters named at most
    evaluate.read_task(task, tok.encode, 32, max_examples=2, unknown=tok.unknown)
    assert 'in 1 of 2 examples' in capsys.readouterr().err
    many = write_jsonl(tmp_path / 'many.jsonl', [
        {'context': 'the ABCDEFGHIJKL', 'choices': [' a', ' b'], 'answer': 0}])
    evaluate.read_task(many, tok.encode, 32, unknown=tok.unknown)
    assert capsys.readouterr().err.endswith(
        "in 1 of 1 examples: 'A', 'B', 'C', 'D', 'E', 'F', 'G', 'H', 'I', 'J' and 2 more\n")


def test_rank_batches_cover_every_example_once_in_equal_numbers_of_batches():
    for n in range(1, 14):
        for world_size in (1, 2, 3, 4):
            for batch_size in (1, 2, 3, 5):
                ranks = [evaluate.rank_batches(list(range(n)), batch_size, rank, world_size)
                         for rank in range(world_size)]
                real = [x for batches in ranks for batch in batches
                        for x in batch if x is not evaluate.DUMMY]
                assert sorted(real) == list(range(n))
                assert (len({len(batches) for batches in ranks}) == 1
                        and all(map(len, sum(ranks, []))))
                assert all(len(batch) <= batch_size for batches in ranks for batch in batches)
                if world_size == 1:
                    assert not any(x is evaluate.DUMMY for batch in ranks[0] for x in batch)


def test_wilson_interval_and_the_printed_line():
    # the textbook values: 0 of 10 -> [0, 0.2775], 5 of 10 -> [0.2366, 0.7634]
    assert ([round(x, 4) for x in evaluate.wilson_interval(0, 10) + evaluate.wilson_interval(5, 10)]
            == [0.0, 0.2775, 0.2366, 0.7634])
    low, high = evaluate.wilson_interval(10, 10)
    assert round(high, 4) == 1.0 and round(low, 4) == 0.7225
    result = {'examples': 10, 'correct': 5, 'correct_norm': 0, 'acc': 0.5, 'acc_norm': 0.0,
              'chance': 0.3}
    assert evaluate.describe('t.jsonl', result) == ('t.jsonl: 10 examples, acc 0.5000 [0.2366, '
                                                    '0.7634], acc_norm 0.0000 [0.0000, 0.2775] '
                                                    '(95% Wilson intervals), chance 0.3000')


@pytest.mark.slow
def test_one_two_and_three_ranks_give_the_same_counts(tiny_gpt2, bpe, task, tmp_path):
    model, tok = evaluate.load_pretrained(tiny_gpt2[1], bpe[0], 'cpu')
    one = evaluate.score(model, evaluate.read_task(task, tok.encode, BLOCK), 2, 'cpu',
                         nullcontext())
    def start(rank, world_size, parallel):
        store = str(tmp_path / f'store-{world_size}-{parallel}')  # the process group's rendezvous
        return forked.Process('tests/evaluate_ranks.py', tiny_gpt2[1], bpe[0], task, '2', str(rank),
                              str(world_size), store, parallel)
    runs = {(world_size, parallel): [start(rank, world_size, parallel)
                                     for rank in range(world_size)]
            # all 8 processes at once
            for world_size, parallel in ((2, 'ddp'), (3, 'ddp'), (3, 'fsdp'))}
    for procs in runs.values():
        outputs = [proc.communicate(timeout=120) for proc in procs]
        assert all(proc.returncode == 0 for proc in procs), outputs
        assert json.loads(outputs[0][0]) == one


@pytest.mark.slow
@pytest.mark.parametrize('device', DEVICES)
def test_command_on_a_trained_run_and_a_hugging_face_folder(data_dir, tiny_gpt2, bpe, task,
                                                            tmp_path, device):
    run = str(tmp_path / 'run')
    run_train(run, data_dir, '--max_iters=10', '--lr_decay_iters=10', '--eval_interval=10')
    rng = random.Random(1)
    sentences = [('the cat', [' sees the moon.', ' sees a small bird.', ' loves his letter.']),
                 ('my friend finds', [' the old road.', ' the sea.'])]
    generic = write_jsonl(tmp_path / 'generic.jsonl', [
        {'context': c, 'choices': ends, 'answer': rng.randrange(len(ends))} for _ in range(4)
        for c, ends in sentences])
    hellaswag = write_jsonl(tmp_path / 'hellaswag.jsonl', [
        {'ctx': c, 'endings': [e.strip() for e in ends], 'label': 0} for c, ends in sentences])
    model, saved = sample.load_model(os.path.join(run, 'best.pt'), 'cpu')
    encode = tokenizer.load(saved['dataset']['tokenizer']).encode

    def expected(path, model=model, encode=encode):
        examples = evaluate.read_task(path, encode, model.config.block_size)
        return evaluate.describe(path,
                                 evaluate.score(model, examples, 3, 'cpu', nullcontext())) + '\n'

    def command(*args):  # the same counts on a GPU as the CPU's here: the choices are far from ties
        return forked.run('evaluate.py', *args, '--batch_size=3', f'--device={device}', timeout=120)
    result = command(f'--out_dir={run}', f'--tasks={generic},{hellaswag}', '--dtype=float32')
    assert (result.returncode == 0
            and result.stdout == expected(generic) + expected(hellaswag)), result.stderr
    assert f" on {'cuda:0' if device == 'cuda' else 'cpu'} " in result.stderr
    # dtype 'auto'
    result = command(f'--ckpt={run}/last.pt', f'--tasks={generic}', '--max_examples=3')
    assert (result.returncode == 0
            and result.stdout.startswith(f'{generic}: 3 examples, acc ')), result.stderr
    result = command(f'--init_from={tiny_gpt2[1]}', f'--tokenizer={bpe[0]}', f'--tasks={task}',
                     '--dtype=float32')
    model, tok = evaluate.load_pretrained(tiny_gpt2[1], bpe[0], 'cpu')
    assert (result.returncode == 0
            and result.stdout == expected(task, model=model, encode=tok.encode)), result.stderr


@pytest.mark.slow
def test_command_mistakes_are_one_line_with_exit_2(tiny_gpt2, bpe, task, tmp_path):
    bad = write_jsonl(tmp_path / 'bad.jsonl',
                      [{'ctx': 'the cat', 'endings': ['sees', 'loves'], 'label': 0},
                                               {'ctx': 'a', 'endings': ['b'], 'label': 0}])
    gpt2 = [f'--init_from={tiny_gpt2[1]}', f'--tokenizer={bpe[0]}']
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'metrics.jsonl').write_text('')  # a train.py run's folder
    (tmp_path / 'empty').mkdir()
    for args, message in (
            # the weights are checked before GPT-2's tokenizer, which an offline machine lacks
            ([f'--init_from={tmp_path}/run', f'--tasks={task}'],
             f"error: init_from='{tmp_path}/run' is a train.py run's folder: evaluate its best.pt "
             f"with out_dir={tmp_path}/run"),
            ([f'--init_from={tmp_path}/empty', f'--tasks={task}'],
             f"error: {tmp_path}/empty is not a Hugging Face model folder"),
            # but a tokenizer file that is not there comes first: the weights may be a download
            ([f'--init_from={tmp_path}/empty', f'--tokenizer={tmp_path}/typo.tiktoken',
              f'--tasks={task}'], f"error: tokenizer file {tmp_path}/typo.tiktoken does not exist"),
            ([*gpt2, f'--tasks={task},{bad}'],
             f"error: {bad}:2: endings must be a list of at least 2 strings"),
            ([f'--out_dir={tmp_path}', f'--tasks={task}'],
             f"error: checkpoint {tmp_path}/best.pt does not exist"),
            ([*gpt2, '--tasks='], "error: tasks='' names no task file"),
            ([*gpt2, f'--tasks={task}', '--threads=100000'],  # a segmentation fault
             "error: threads=100000 is more than this machine's"),
            ([*gpt2, f'--tasks={task}', '--tokenizer=char'],
             "error: tokenizer='char': with init_from use gpt2"),
            ([*gpt2, f'--tasks={task}', '--max_exampels=3'],
             "error: unknown config key 'max_exampels'")):
        result = forked.run('evaluate.py', *args, timeout=120)
        assert (result.returncode == 2 and result.stdout == ''
                and result.stderr.count('\n') == 1), result.stderr
        assert result.stderr.startswith(message), result.stderr


def test_weights_and_a_tokenizer_of_another_vocabulary_are_refused(tiny_gpt2, root):
    write_ranks(root / 'smaller.tiktoken', MERGES[:-1])
    with pytest.raises(hf.HFError,
                       match=f"know {N_VOCAB} tokens, tokenizer .*smaller.tiktoken "
                             f"{N_VOCAB - 1}: "):
        evaluate.load_pretrained(tiny_gpt2[1], str(root / 'smaller.tiktoken'), 'cpu')


def toy_task(path, count=13, seed=1):
    """A generic task on the toy corpus's sentences: the subject given, which of three endings the
    corpus has."""
    rng = random.Random(seed)
    subjects = ['the cat', 'a dog', 'my friend', 'the king']
    endings = [' sees the moon.', ' finds xq zz.', ' keeps qq vv.']
    return write_jsonl(path,
                       [{'context': rng.choice(subjects), 'choices': rng.sample(endings, 3),
                         'answer': 0}
                              for _ in range(count)])


@pytest.mark.slow
def test_accuracy_in_the_loop_on_one_and_two_ranks(data_dir, tmp_path):
    """At every evaluation each task's acc and acc_norm, as evaluate.py computes them on the same
    weights; on 2 ranks (13 examples: not divisible) the same counts; best_by=acc_norm picks best.pt
    by accuracy; report.md and curves.png show it beside chance level."""
    task = toy_task(tmp_path / 'toy_task.jsonl')
    args = ['--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10', f'--eval_tasks={task}',
            '--dtype=float32', '--best_by=acc_norm', '--write_report=True',
            '--gradient_accumulation_steps=2']
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    result = run_train(one, data_dir, *args)
    ok(torchrun(two, data_dir, *args))
    evals = read_metrics(one, 'eval')
    assert ([e['step'] for e in evals] == [10, 20]
            and all(e['toy_task/chance'] == pytest.approx(1 / 3) for e in evals))
    # the counts of 2 ranks are one process's: the losses differ by rounding only, the choices not
    # at all
    counts = [[(e['toy_task/examples'], e['toy_task/acc'], e['toy_task/acc_norm'])
               for e in read_metrics(run, 'eval')]
              for run in (one, two)]
    assert counts[0] == counts[1] and all(count[0] == 13 for count in counts[0])
    # each checkpoint scored again by evaluate.py gives the recorded figures
    for name in ('best.pt', 'last.pt'):
        model, saved = sample.load_model(os.path.join(one, name), 'cpu')
        examples = evaluate.read_task(task, tokenizer.load(saved['dataset']['tokenizer']).encode,
                                      32)
        scored = evaluate.score(model, examples, 8, 'cpu', nullcontext())
        recorded = next(e for e in evals if e['step'] == saved['iter_num'])
        assert ((scored['acc'], scored['acc_norm'])
                == (recorded['toy_task/acc'], recorded['toy_task/acc_norm']))
    best = torch.load(os.path.join(one, 'best.pt'), weights_only=True)['iter_num']
    assert best == max(evals, key=lambda e: (e['toy_task/acc_norm'], -e['step']))['step']
    # the last line names what chose best.pt, its acc_norm, and its val loss (not the lowest one's)
    chosen = next(e for e in evals if e['step'] == best)
    assert (f"best acc_norm {chosen['toy_task/acc_norm']:.4f} at iteration {best}, "
            f"val loss {chosen['val_loss']:.4f} there") in result.stdout
    assert '- toy_task: acc ' in open(os.path.join(one, 'report.md')).read()
    # how many: evaluate.py scores all of a task's by default, eval_tasks_examples the first ones
    assert (f"toy_task acc_norm {evals[-1]['toy_task/acc_norm']:.4f} on 13 examples (chance 0.33)"
            in result.stdout)
    # best.pt was chosen by these examples: a resume that scores others is refused (a file edited
    # in place was resumed), one that names the same by another path goes on
    (tmp_path / 'moved').mkdir()
    moved = shutil.copy(task, tmp_path / 'moved' / 'toy_task.jsonl')
    with open(task) as f:
        lines = f.readlines()
    with open(task, 'w') as f:
        f.writelines(lines[:-1])
    resume = [*args, '--max_iters=22', '--init_from=resume']
    result = run_train(one, data_dir, *resume, check=False)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] + '\n' == (
        f"error: {one}/last.pt scored other task examples than eval_tasks does here "
        f"(best_by='acc_norm' chose its best.pt by them): use the checkpoint's settings and data, "
        f"or a new out_dir\n"), result.stderr
    run_train(one, data_dir, *resume, f'--eval_tasks={moved}')


def test_a_bad_task_file_stops_the_run_before_anything_is_written(data_dir, tmp_path):
    bad = tmp_path / 'bad.jsonl'
    bad.write_text('{"context": "the cat", "choices": [" a", " b"], "answer": 0}\n{"context": "x", '
                   '"choices": []}\n')
    out = tmp_path / 'never'
    result = run_train(str(out), data_dir, f'--eval_tasks={bad}', check=False)
    assert (result.returncode == 2 and result.stderr.startswith(f'error: {bad}:2: ')
            and result.stderr.count('\n') == 1)
    assert not out.exists()
    result = run_train(str(out), data_dir, '--best_by=acc_norm', check=False)
    assert result.returncode == 2 and 'needs eval_tasks' in result.stderr and not out.exists()

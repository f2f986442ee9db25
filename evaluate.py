"""
Evaluation: the mean loss over a split (loss(), what train.py evaluates), and benchmark accuracy on
multiple-choice tasks, as llm.c and build-nanogpt measure HellaSwag: each ending is scored by the
model's loss on the ending's tokens given the context. acc: the ending with the lowest summed loss
is the answer; acc_norm: the lowest mean loss per ending token. A run's checkpoint (with its own
tokenizer) or GPT-2's weights:

    python evaluate.py --out_dir=out/tiny --tasks=mytask.jsonl              # out/tiny/best.pt
    python evaluate.py --init_from=gpt2 --tasks=hellaswag_val.jsonl         # GPT-2's tokenizer
    python evaluate.py --ckpt=out/tiny/last.pt --tasks=a.jsonl,b.jsonl --max_examples=500

A task file is jsonl, one example a line, in either format (per line):
- HellaSwag's published file as it is: {"ctx": str, "endings": [str, ...], "label": int}; the ending
  is scored as " " + ending after the context, as llm.c and build-nanogpt render it.
- generic: {"context": str, "choices": [str, ...], "answer": int}; each choice follows the context
  exactly as written, so a choice carries its own separator (" Paris", not "Paris").
A context too long for block_size loses its first tokens; an ending is never cut. Characters a
character-level vocabulary lacks are scored as its unknown id 0, and a warning per file names them.
Per task, stdout gets one line: the example count, acc and acc_norm with 95% intervals, and chance
level. What was loaded, and how long it took, goes to stderr.
"""
import hashlib
import json
import math
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

import checkpoint
import data
import distributed
import hf
import precision
import sample
import tokenizer as tokenizers  # 'tokenizer' is a config key below
from configurator import ConfigError, configure
from exits import check
from model import GPT, GPTConfig
from runlog import log, progress

# -----------------------------------------------------------------------------
out_dir = 'out'  # evaluates out_dir/best.pt
ckpt = ''  # a checkpoint file instead of out_dir/best.pt, e.g. out/tiny/last.pt
# GPT-2 weights instead: gpt2, gpt2-medium, ..., a Hugging Face folder or .safetensors file
init_from = ''
# with init_from: 'gpt2' (the default) or PATH.tiktoken; a checkpoint brings its run's own
tokenizer = ''
tasks = ''  # task files (jsonl), comma-separated
max_examples = 0  # > 0: only the first max_examples of each file, the same ones every time; 0: all
batch_size = 8  # examples per forward, each with all its endings
device = 'auto'  # 'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...
# 'auto' (train.py's choice for this model on this device), 'float32', 'bfloat16', 'float16'
dtype = 'auto'
threads = 0  # torch's CPU threads; 0: its own count, capped by a container's CPU quota
# True: a checkpoint's trained weights even where it also holds their EMA (train.py's ema_decay)
raw_weights = False
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]

# the fields of each format, in the order context, endings, answer
HELLASWAG = ('ctx', 'endings', 'label')
GENERIC = ('context', 'choices', 'answer')
Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


class TaskError(Exception):
    """A bad task file; the one-line message names FILE:LINE and the fix."""


class Example(NamedTuple):
    rows: list  # per ending: its context's ids, then its own; at most block_size + 1 ids
    ending_lengths: list  # per ending: how many ids at the end of its row are the ending's
    label: int  # the index of the right ending; -1 in DUMMY


# a forward that counts nothing: pads a rank that has fewer batches than the others (see
# rank_batches)
DUMMY = Example(rows=[[0, 0]], ending_lengths=[1], label=-1)

# -----------------------------------------------------------------------------
# reading a task


def parse_line(line, where, encode, block_size, unknown):
    """One jsonl line (at where, 'FILE:LINE') as an Example, its context left-truncated so each row
    fits, and the characters of its texts that unknown(text) names (the vocabulary lacks)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's stack
        raise TaskError(f"{where}: not valid JSON ({e}): write one JSON object per line") from None
    if not isinstance(record, dict) or not any(k in record for k in HELLASWAG + GENERIC):
        raise TaskError(f"{where}: neither HellaSwag's fields ({', '.join(HELLASWAG)}) nor the "
                        f"generic ones ({', '.join(GENERIC)}): write each line as a JSON object "
                        f"with one of these sets")
    # a generic line may carry a 'label' of its own (sets converted from other formats do)
    hellaswag = any(k in record for k in HELLASWAG) and not all(k in record for k in GENERIC)
    fields = HELLASWAG if hellaswag else GENERIC
    name = 'HellaSwag' if fields is HELLASWAG else 'generic'
    missing = [k for k in fields if k not in record]
    if missing:
        raise TaskError(f"{where}: the field '{missing[0]}' is missing: a {name} line needs "
                        f"{', '.join(fields)}")
    context, endings, label = (record[k] for k in fields)
    context_key, endings_key, label_key = fields
    if not isinstance(context, str) or not context:
        raise TaskError(f"{where}: {context_key} must be a non-empty string: give the text the "
                        f"endings continue")
    if not isinstance(endings, list) or len(endings) < 2:
        raise TaskError(f"{where}: {endings_key} must be a list of at least 2 strings: give every "
                        f"candidate")
    for i, ending in enumerate(endings):
        if not isinstance(ending, str) or not ending:
            raise TaskError(f"{where}: {endings_key}[{i}] is {ending!r}: every candidate must be a "
                            f"non-empty string")
    for text in (context, *endings):
        try:
            text.encode('utf-8')
        except UnicodeEncodeError as e:  # JSON's \ud800 escapes can name half a character
            raise TaskError(f"{where}: a lone surrogate {text[e.start]!r} is not text: fix or drop "
                            f"that line") from None
    if type(label) is not int or not 0 <= label < len(endings):
        raise TaskError(f"{where}: {label_key}={label!r} is not an index of the {len(endings)} "
                        f"{endings_key}: use an int from 0 to {len(endings) - 1}")
    if fields is HELLASWAG:
        endings = [' ' + ending for ending in endings]  # llm.c's and build-nanogpt's rendering
    context_ids, ending_ids = encode(context), [encode(ending) for ending in endings]
    longest = max(len(ids) for ids in ending_ids)
    if longest > block_size:
        raise TaskError(f"{where}: an ending of {longest} tokens leaves no room for context in "
                        f"block_size={block_size}: shorten it, or evaluate a model with a larger "
                        f"block_size")
    # the input is row[:-1]: context and ending together may take block_size + 1 ids, the context at
    # least one
    rows = [context_ids[-(block_size + 1 - len(ids)):] + ids for ids in ending_ids]
    return (Example(rows, [len(ids) for ids in ending_ids], label),
            unknown(context + ''.join(endings)))


def read_task(path, encode, block_size, max_examples=0, unknown=None):
    """The examples of a task file as token ids (encode: str -> list[int], the model's tokenizer).
    Every line is checked, also past max_examples, so a bad file fails at once; max_examples > 0
    then keeps the first ones. unknown: the tokenizer's (Tokenizer.unknown), None for one that
    spells any text; characters a char vocabulary lacks are scored as its unknown id 0, which one
    warning says (rank 0's, as every log line)."""
    unknown = unknown or (lambda text: [])
    try:
        with open(path, encoding='utf-8') as f:
            parsed = [parse_line(line, f"{path}:{number}", encode, block_size, unknown)
                      for number, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise TaskError(f"cannot read the task file {path} ({e.strerror}): fix the path") from None
    except UnicodeDecodeError:
        raise TaskError(f"{path} is not UTF-8 text: save it as UTF-8 jsonl") from None
    if not parsed:
        raise TaskError(f"{path} holds no examples: write one JSON object per line")
    parsed = parsed[:max_examples or None]  # the ones scored
    lacking = [chars for _, chars in parsed if chars]
    if lacking:
        chars = list(dict.fromkeys(c for example_chars in lacking for c in example_chars))
        more = f" and {len(chars) - 10} more" if len(chars) > 10 else ''
        log(f"warning: {path}: characters not in the vocabulary, scored as the unknown id 0, in "
            f"{len(lacking)} of {len(parsed)} examples: {', '.join(map(repr, chars[:10]))}"
            f"{more}", sys.stderr)
    return [example for example, _ in parsed]


def read_tasks(paths, encode, block_size, max_examples=0, unknown=None):
    """{path: examples} of comma-separated task files, all read (and checked) before any is
    evaluated; unknown as read_task takes it."""
    names = [p.strip() for p in paths.split(',') if p.strip()]
    if not names:
        raise TaskError(f"no task file in tasks='{paths}': name one or more jsonl files, "
                        f"comma-separated")
    for i, path in enumerate(names):  # metrics.jsonl names a task's scores by task_name
        if task_name(path) in map(task_name, names[:i]):
            raise TaskError(f"two task files in tasks='{paths}' are named '{task_name(path)}': "
                            f"their scores would share one name; rename one, or name it once")
    return {path: read_task(path, encode, block_size, max_examples, unknown) for path in names}


def tasks_digest(tasks):
    """A digest of read_tasks' {path: examples}: each task's name, and its examples' token ids and
    answers. Every checkpoint keeps it: best_by='acc_norm' chose best.pt by these examples, and a
    resume that scores others is refused, whatever path names their files."""
    scored = repr([(task_name(path), examples) for path, examples in tasks.items()])
    return hashlib.sha256(scored.encode()).hexdigest()[:16]


def task_name(path):
    """What a task is called in logs and metrics: its file's name without folder or extension."""
    return os.path.splitext(os.path.basename(path))[0]

# -----------------------------------------------------------------------------
# scoring


def rank_batches(examples, batch_size, rank=0, world_size=1):
    """This rank's examples, rank::world_size, in batches of batch_size. Every rank gets as many
    batches as the fullest one, a short rank a [DUMMY] batch per missing one: under FSDP each
    forward is a collective of all ranks."""
    part = examples[rank::world_size]
    batches = [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    fullest = -(-len(examples) // world_size)  # examples of the fullest rank, rounded up
    return batches + [[DUMMY]] * (-(-fullest // batch_size) - len(batches))


def choice_losses(model, examples, batch_size, device, autocast, rank=0, world_size=1):
    """Every ending's summed and mean loss over its own tokens, in float32: (summed, mean, labels)
    of shapes (E, C), (E, C) and (E,), on device, over this rank's batches in order (a DUMMY has
    label -1). C is the most endings of any example; an example with fewer has +inf in the rest.
    Call it in eval mode under inference_mode, as score() does. All endings of an example go into
    one forward, right-padded; padding is never a target."""
    num_choices = max(len(e.rows) for e in examples)
    summed, mean, labels = [], [], []
    for batch in progress(rank_batches(examples, batch_size, rank, world_size), 'tasks'):
        rows = [row for e in batch for row in e.rows]
        lengths = [n for e in batch for n in e.ending_lengths]
        T = max(len(row) for row in rows) - 1
        idx = torch.tensor([row[:-1] + [0] * (T + 1 - len(row)) for row in rows])  # (R, T)
        # the ending's n tokens are predicted at input positions len(row) - 1 - n ... len(row) - 2
        positions = [r * T + p for r, (row, n) in enumerate(zip(rows, lengths))
                     for p in range(len(row) - 1 - n, len(row) - 1)]  # in (R * T)
        targets = [t for row, n in zip(rows, lengths) for t in row[len(row) - n:]]
        owners = [r for r, n in enumerate(lengths) for _ in range(n)]  # the row of each target
        slots = [i * num_choices + c
                 for i, e in enumerate(batch) for c in range(len(e.rows))]  # rows in (E, C)
        positions, targets, owners, slots, lengths_t, batch_labels = (
            torch.tensor(x).to(device, non_blocking=True)
            for x in (positions, targets, owners, slots, lengths, [e.label for e in batch]))
        with autocast:
            logits = model(idx.to(device, non_blocking=True))  # (R, T, vocab)
        losses = F.cross_entropy(logits.flatten(0, 1)[positions].float(), targets,
                                 reduction='none')  # (M,)
        row_sums = torch.zeros(len(rows), device=device).index_add_(0, owners, losses)  # (R,)
        for table, values in ((summed, row_sums), (mean, row_sums / lengths_t)):
            empty = torch.full((len(batch) * num_choices,), math.inf, device=device)
            table.append(empty.index_copy_(0, slots, values)
                         .view(len(batch), num_choices))  # (B, C)
        labels.append(batch_labels)
    return torch.cat(summed), torch.cat(mean), torch.cat(labels)


def loss(model, loader, device, autocast, label='eval'):
    """Mean loss over a split's evaluation windows (loader: over a data.EvalSampler), every target
    token counted once across ranks: sums on the device, one all-reduce, one host sync. In
    model.eval() and inference_mode. A shard that changed under the run, met by any rank, raises
    data.DataError with its message on every rank after the all-reduce, which carries a fault flag:
    the rank that met it runs its other batches all the same (a sharded model's forward is a
    collective)."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, tokens, faults
        # a batch that cannot be read becomes an empty one of the same shape: no second compile
        batches = data.Batches(loader, loader.batch_sampler.batch_size)
        for x, y, _ in progress(batches, label, len(loader)):  # what it does when it takes long
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                sums[0] += model(x, y, reduction='sum')
            sums[1] += (y != data.IGNORE_INDEX).sum()
        sums[2] = batches.fault is not None
        loss_sum, count, faults = distributed.sum_over_ranks(sums).tolist()
    model.train(was_training)
    if faults:  # a collective: every rank is here
        raise data.DataError(next(m for m in distributed.gather(batches.fault) if m))
    return loss_sum / count


def score(model, examples, batch_size, device, autocast, rank=0, world_size=1):
    """acc and acc_norm of the model on examples, each counted once across ranks: rank r scores
    examples r::world_size, and the counts meet in one all_reduce (distributed.sum_over_ranks,
    when there is a group), then one host sync. Runs in model.eval() and torch.inference_mode() and
    gives the model back in the mode it came in. Ties go to the first ending. Returns {'examples',
    'correct', 'correct_norm', 'acc', 'acc_norm', 'chance'}; chance is the mean of 1 / number of
    endings, the accuracy of a uniform guess."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        summed, mean, labels = choice_losses(model, examples, batch_size, device, autocast, rank,
                                             world_size)
        # correct, correct_norm, examples (DUMMY has label -1)
        counts = torch.stack([(summed.argmin(1) == labels).sum(), (mean.argmin(1) == labels).sum(),
                              (labels >= 0).sum()])
        correct, correct_norm, count = distributed.sum_over_ranks(counts).tolist()
    model.train(was_training)
    return {'examples': count, 'correct': correct, 'correct_norm': correct_norm,
            'acc': correct / count, 'acc_norm': correct_norm / count,
            'chance': sum(1 / len(e.rows) for e in examples) / len(examples)}


def score_tasks(model, tasks, batch_size, device, autocast, rank=0, world_size=1):
    """score() of each task ({path: examples}, as read_tasks gives them), by task_name, and the mean
    acc_norm over the tasks (0.0 without any): what train.py records at every evaluation, and what
    best_by='acc_norm' compares."""
    accuracy = {task_name(path): score(model, examples, batch_size, device, autocast, rank,
                                       world_size)
                for path, examples in tasks.items()}
    return accuracy, (sum(a['acc_norm'] for a in accuracy.values()) / len(accuracy) if accuracy
                      else 0.0)


def task_fields(accuracy):
    """score_tasks' accuracy as metrics fields: TASK/acc, TASK/acc_norm, TASK/chance,
    TASK/examples."""
    return {f'{task}/{k}': a[k] for task, a in accuracy.items()
            for k in ('acc', 'acc_norm', 'chance', 'examples')}


def tasks_line(accuracy, whose=''):
    """score_tasks' accuracy for the eval line: ', TASK acc_norm A on N examples (chance C)' per
    task, '' without tasks; whose ('EMA ') names weights other than the trained ones. N says how
    many were scored: train.py's eval_tasks_examples takes a file's first N, evaluate.py all of
    them by default."""
    return ''.join(f", {whose}{task} acc_norm {a['acc_norm']:.4f} on {a['examples']} examples "
                   f"(chance {a['chance']:.2f})" for task, a in accuracy.items())


def wilson_interval(correct, n, z=Z_95):
    """The Wilson score interval of a proportion correct / n: unlike the normal approximation
    (p +- z sqrt(p(1-p)/n)), it stays within [0, 1] and keeps its coverage at small n and at
    accuracies near 0 or 1."""
    p, z2 = correct / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # clamped: rounding at 0 and n can step outside
    return max(0.0, center - half), min(1.0, center + half)


def describe(name, result):
    """One line for a score() result: the example count, acc and acc_norm with 95% Wilson intervals,
    and chance level."""
    n = result['examples']
    acc_low, acc_high = wilson_interval(result['correct'], n)
    norm_low, norm_high = wilson_interval(result['correct_norm'], n)
    return (f"{name}: {n} examples, acc {result['acc']:.4f} [{acc_low:.4f}, {acc_high:.4f}], "
            f"acc_norm {result['acc_norm']:.4f} [{norm_low:.4f}, {norm_high:.4f}] (95% Wilson "
            f"intervals), chance {result['chance']:.4f}")

# -----------------------------------------------------------------------------
# the command


def load_pretrained(source, tokenizer_spec, device):
    """(GPT in eval mode on device, tokenizer.Tokenizer) of GPT-2 weights and a tiktoken tokenizer
    of their vocabulary. The weights first: a folder that holds none is said as such, not as the
    tokenizer an offline machine lacks."""
    # all the positions, the weights' vocabulary
    model_args, state, _ = hf.load_gpt2(source, None, None)
    try:
        tok = (tokenizers.gpt2() if tokenizer_spec == 'gpt2'
               else tokenizers.ranks_file(tokenizer_spec))
    except tokenizers.TokenizerError as e:  # offline: GPT-2's ranks, written once, serve as well
        raise tokenizers.TokenizerError(f"{e}, or pass --tokenizer=gpt2.tiktoken (README.md, "
                                        f"Finetune GPT-2)") from None
    if model_args['vocab_size'] != tok.vocab_size:
        raise hf.HFError(f"the weights of {source} know {model_args['vocab_size']} tokens, "
                         f"tokenizer {tokenizer_spec} {tok.vocab_size}: pass the tokenizer they "
                         f"were trained with (gpt2 or PATH.tiktoken)")
    model = GPT(GPTConfig(**model_args))
    model.load_state_dict(state)
    return model.to(device).eval(), tok


def load(config, device):
    """(model in eval mode on device, its tokenizer.Tokenizer, what it is) as the config names it;
    mistakes exit 2."""
    if config['init_from']:
        check(not config['ckpt'], "both ckpt and init_from are set: evaluate one, a checkpoint or "
                                  "GPT-2 weights")
        check(hf.is_source(config['init_from']), f"init_from='{config['init_from']}': use a GPT-2 "
              f"name ({', '.join(hf.GPT2_NAMES)}) or the path of a Hugging Face model folder or "
              f".safetensors file (a checkpoint of a run: ckpt=PATH)")
        run = config['init_from']
        check(not os.path.isfile(os.path.join(run, 'metrics.jsonl')),
              f"init_from='{run}' is a train.py run's folder: evaluate its best.pt with "
              f"out_dir={run}")
        spec = config['tokenizer'] or 'gpt2'
        check(spec == 'gpt2' or spec.endswith('.tiktoken'),
              f"tokenizer='{spec}': with init_from use gpt2 (GPT-2's own) or the path of a "
              f".tiktoken file")
        # before the weights, which may take a download of gigabytes
        check(spec == 'gpt2' or os.path.isfile(spec),
              f"tokenizer file {spec} does not exist: pass an existing .tiktoken file, or gpt2")
        try:
            return *load_pretrained(config['init_from'], spec, device), config['init_from']
        except (hf.HFError, tokenizers.TokenizerError) as e:
            check(False, e)
    check(not config['tokenizer'], f"tokenizer='{config['tokenizer']}' is for init_from: a "
                                   f"checkpoint is evaluated with its run's tokenizer; leave "
                                   f"tokenizer unset")
    path = config['ckpt'] or os.path.join(config['out_dir'], 'best.pt')
    state = 'is a folder' if os.path.isdir(path) else 'does not exist'
    check(os.path.isfile(path), f"checkpoint {path} {state}: set out_dir to a run's folder, ckpt "
                                f"to a .pt file, or init_from to GPT-2 weights")
    try:
        model, saved = sample.load_model(path, device, config['raw_weights'])
        tok = tokenizers.load(saved['dataset']['tokenizer'])
        return model, tok, sample.weights_name(path, saved)
    except (checkpoint.CheckpointError, tokenizers.TokenizerError) as e:
        check(False, e)


def main(config):
    check(config['tasks'], "tasks='' names no task file: pass --tasks=FILE.jsonl (comma-separated "
                           "for several)")
    try:
        # train.py's: the threads, the current GPU and TF32 for what autocast leaves in float32
        device, device_type = distributed.setup(config['device'], None, False, 'auto',
                                                config['threads'])
    except ValueError as e:
        check(False, e)
    model, tok, source = load(config, device)
    try:
        tasks = read_tasks(config['tasks'], tok.encode, model.config.block_size,
                           config['max_examples'], tok.unknown)
    except TaskError as e:
        check(False, e)
    try:  # train.py's rule, for this model's shape on this device
        dtype = precision.resolve_dtype(config['dtype'], device,
                                        {**vars(model.config), 'dropout': 0.0},
                                        config['batch_size'])[0]
    except ValueError as e:
        check(False, e)
    autocast = precision.autocast(device_type, dtype)
    # after every check: a mistake is one line
    if busy := distributed.busy_warning(torch.get_num_threads(), distributed.cpu_use()):
        print(busy, file=sys.stderr)
    print(f"evaluating {source} on {device} {dtype}", file=sys.stderr)
    for path, examples in tasks.items():
        start = time.perf_counter()
        result = score(model, examples, config['batch_size'], device, autocast)
        seconds = time.perf_counter() - start
        print(describe(path, result), flush=True)
        print(f"{path}: {seconds:.1f} s, {len(examples) / seconds:.1f} examples/s", file=sys.stderr)


if __name__ == '__main__':
    try:
        main(configure({k: globals()[k] for k in config_keys}, sys.argv[1:],
                       choices={'dtype': ('auto', *precision.DTYPES)},
                       minimums={'batch_size': 1})[0])
    except ConfigError as e:
        check(False, e)

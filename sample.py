"""
Sample from a trained model with the run's own tokenizer:

    python sample.py --out_dir=out/tiny --start="def " --num_samples=3
    python sample.py --out_dir=out/tiny --start=FILE:prompt.txt --top_k=1   # greedy
    # a folder transformers loads (GPT2LMHeadModel, tokenizer):
    python sample.py --out_dir=out/tiny --export_hf=out/tiny/hf

Samples go to stdout, each followed by a line of dashes; what was loaded goes to stderr. The same
--seed gives the same samples. An empty prompt starts where documents start: a newline for a
character tokenizer, end-of-text for a BPE one, and a newline (nanoGPT's) for a dataset that has no
end-of-text, one text cut into splits by position.
"""
import os
import re
import sys

import torch
from torch.optim.swa_utils import AveragedModel

import checkpoint
import distributed
import hf
import precision
import runlog
import tokenizer
from configurator import ConfigError, configure, fail
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
out_dir = 'out'
ckpt = ''  # a checkpoint file instead of out_dir/best.pt, e.g. out/tiny/last.pt
start = ''  # the prompt, or FILE:path to read it from a file
num_samples = 3
max_new_tokens = 200
temperature = 0.8  # below 1 sharpens the distribution, above 1 flattens it
top_k = 200  # sample among the k likeliest tokens only; 1 is greedy decoding
seed = 1337  # sample i uses seed + i, so it does not depend on num_samples
device = 'auto'  # 'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...
threads = 0  # torch's CPU threads; 0: its own count, capped by a container's CPU quota
# 'auto' (as train.py decides it, for this model on this device), 'float32', 'bfloat16', 'float16'
dtype = 'auto'
# True: a checkpoint's trained weights even where it also holds their EMA (train.py's ema_decay)
raw_weights = False
# write the weights to this single .pt file (e.g. from an fsdp run's shards) and exit without
# sampling
export = ''
# write a Hugging Face GPT2LMHeadModel folder (config.json, model.safetensors, the tokenizer) here
# and exit
export_hf = ''
# -----------------------------------------------------------------------------


def load_model(path, device, raw_weights=False):
    """(GPT in eval mode on device, the checkpoint dict) from a checkpoint file: the moving average
    of its weights where it holds one (train.py's ema_decay) unless raw_weights; raises
    checkpoint.CheckpointError. The tokenizer is the dataset's:
    tokenizer.load(checkpoint['dataset']['tokenizer']). An older checkpoint is migrated as it loads,
    which a line on stderr says."""
    saved = checkpoint.load(path)
    if 'migrated' in saved:
        print(saved['migrated'], file=sys.stderr)
    # a sharded run's EMA is in its shards folder
    holds_ema = 'ema' in saved or ('shards' in saved and saved['config'].get('ema_decay', 0) > 0)
    weights = 'ema' if holds_ema and not raw_weights else 'model'
    saved['weights'] = weights
    try:
        model = GPT(GPTConfig(**saved['model_args']))
        # an fsdp run's checkpoint: gather its shards into whole tensors, in this one process
        if 'shards' in saved:
            template = AveragedModel(model) if weights == 'ema' else model  # the shards' names
            state = {weights: template.state_dict()}
            checkpoint.load_shards(state, path, saved['shards'])
            saved[weights] = state[weights]
        # checkpoints saved from a torch.compile or DDP wrapper elsewhere carry these prefixes, and
        # an EMA its AveragedModel's, beside its count of averaged steps
        model.load_state_dict({re.sub(r'^((_orig_mod|module)\.)+', '', k): v
                               for k, v in saved[weights].items() if k != 'n_averaged'})
        if 'kind' not in saved['dataset']['tokenizer']:  # every use needs the dataset's tokenizer
            raise KeyError('tokenizer')
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # ValueError: GPTConfig's checks
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise checkpoint.CheckpointError(f"{path} is not a train.py checkpoint ({first_line}): "
                                         f"pass the best.pt or last.pt of a run")
    return model.to(device).eval(), saved


def weights_name(path, saved):
    """'path (iteration N, the EMA of its weights)': which weights load_model gave, as every
    script's first line says."""
    which = ', the EMA of its weights' if saved['weights'] == 'ema' else ''
    return f"{path} (iteration {saved.get('iter_num', '?')}{which})"


def sample_pieces(model, tok, start, max_new_tokens, temperature, top_k, seed, device):
    """The non-empty text start, then its continuation piece by piece as the tokens are drawn: a
    sample of minutes shows from its first token. A piece ends on a whole character (a BPE token can
    end inside one: its decoding ends in U+FFFD until the next token completes it), so each piece
    decodes alone. Draws from its own generator, so the global RNG (and with it a training run's
    random stream) is left as it was."""
    prompt = tok.encode(start)
    yield tok.decode(prompt)
    was_training, waiting = model.training, []  # waiting: the ids of a character not yet whole
    try:
        model.eval()
        for token in model.generate_tokens(
                torch.tensor([prompt], dtype=torch.long, device=device),  # (1, T)
                max_new_tokens, temperature, top_k,
                torch.Generator(device=device).manual_seed(seed)):
            waiting.append(token.item())
            if not tok.decode(waiting).endswith('\ufffd'):
                yield tok.decode(waiting)
                waiting = []
    finally:
        model.train(was_training)
    yield tok.decode(waiting)  # what a final U+FFFD held back


def empty_prompt(tok, dataset):
    """The prompt of an empty start, where the documents of dataset (a checkpoint's record of it)
    start: the tokenizer's (Tokenizer.start), or a newline, as nanoGPT's, where each split is one
    document (prepare.py's cut of a single text by position), which ends in no end-of-text."""
    documents = dataset.get('documents') or {}  # older checkpoints and llm.c's data: not known
    return '\n' if documents and set(documents.values()) == {1} else tok.start


def run_end_sample(model, weights, dataset, new_tokens, seed, device, autocast, sharded):
    """train.py's sample at a run's end from model (weights: the words that name them), logged as
    its tokens come. The tokenizer loads only now: GPT-2's is a one-time download, which an offline
    GPU node may lack, and then the run says so and ends as it would have. A sharded model's
    forward needs every rank: all sample, or none."""
    try:
        tok, no_sample = tokenizer.load(dataset['tokenizer']), ''
    except tokenizer.TokenizerError as e:
        tok, no_sample = None, f"no sample: {e}"
    if sharded and distributed.any_rank(no_sample, device):
        no_sample = no_sample or "no sample: another rank could not load the tokenizer"
    if no_sample:
        return runlog.log(no_sample)
    runlog.log(f"a sample from {weights}:")
    with autocast:
        runlog.log_pieces(sample_pieces(model, tok, empty_prompt(tok, dataset), new_tokens, 0.8,
                                        200, seed, device))


if __name__ == '__main__':
    config_keys = [k for k, v in globals().items()
                   if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
    try:
        globals().update(configure({k: globals()[k] for k in config_keys}, sys.argv[1:],
                                   choices={'dtype': ('auto', *precision.DTYPES)},
                                   minimums=dict.fromkeys(('num_samples', 'max_new_tokens',
                                                           'top_k'), 1))[0])
    except ConfigError as e:
        fail(e)
    if temperature < 1e-6:  # 0 divides by 0, and the logits over a tiny one overflow float32
        fail(f"temperature={temperature} must be at least 1e-6: for greedy decoding use top_k=1")
    if seed + num_samples > 2**64:  # torch's generators take seeds below 2**64
        fail(f"seed={seed} is too large: sample i draws with seed + i, which must be below 2**64")
    if export and export_hf:
        fail("export and export_hf are both set: give one (each writes the weights and exits)")
    if export and os.path.exists(export):
        fail(f"export={export} exists: name a new file (an export never overwrites one)")
    if export and not os.path.isdir(os.path.dirname(os.path.abspath(export))):
        fail(f"export={export}: its folder does not exist: create it, or name a file in an "
             f"existing folder")
    try:
        # train.py's: the threads, the current GPU and TF32 for what autocast leaves in float32
        device, device_type = distributed.setup(device, None, False, 'auto', threads)
    except ValueError as e:
        fail(e)

    prompt_file = start.startswith('FILE:')
    if prompt_file:
        try:
            # newline='': the file's line endings as they are (a CRLF corpus trains on them)
            with open(start[len('FILE:'):], encoding='utf-8', newline='') as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read the prompt file ({e}): fix the path after FILE: or save it as UTF-8")
    try:
        start.encode('utf-8')
    except UnicodeEncodeError as e:  # a byte of another encoding on the command line
        fail(f"the prompt holds {start[e.start]!r}, which is not text: pass it in UTF-8, or in a "
             f"UTF-8 file as --start=FILE:PATH")

    ckpt_path = ckpt or os.path.join(out_dir, 'best.pt')
    if not os.path.isfile(ckpt_path):
        state = 'is a folder' if os.path.isdir(ckpt_path) else 'does not exist'
        fail(f"checkpoint {ckpt_path} {state}: set out_dir to a run's folder, or ckpt to a .pt "
             f"file")
    try:
        # an export stays on the CPU: its tensors must load anywhere; a large run's shards may not
        # fit a GPU
        model, saved = load_model(ckpt_path, 'cpu' if export or export_hf else device, raw_weights)
    except checkpoint.CheckpointError as e:
        fail(e)
    if export:
        try:
            checkpoint.save_file({'format': checkpoint.FORMAT, 'model': model.state_dict(),
                                  'model_args': saved['model_args'],
                                  'dataset': saved['dataset'], 'config': saved['config'],
                                  'iter_num': saved['iter_num']}, export)
        except OSError as e:  # a folder not ours to write, a full disk: nothing is left there
            fail(f"cannot write {export} ({e.strerror or e}): name a file in a folder you can "
                 f"write, with room for the weights")
        print(f"wrote the weights of {weights_name(ckpt_path, saved)} to {export}", file=sys.stderr)
        sys.exit(0)
    if export_hf:
        try:
            eot_id, tokenizer_files = tokenizer.hf_export(saved['dataset']['tokenizer'])
            hf.export_gpt2(model, export_hf, eot_id, tokenizer_files)
        except (tokenizer.TokenizerError, hf.HFError) as e:
            fail(e)
        with_tokenizer = ("with its tokenizer" if tokenizer_files else
                          "(its tokenizer: AutoTokenizer.from_pretrained('gpt2'))")
        print(f"wrote {weights_name(ckpt_path, saved)} as a GPT2LMHeadModel {with_tokenizer} to "
              f"{export_hf}", file=sys.stderr)
        sys.exit(0)
    try:
        tok = tokenizer.load(saved['dataset']['tokenizer'])
    except tokenizer.TokenizerError as e:
        fail(e)
    # a prompt file as written, but for a vocabulary that cannot spell '\r' (an LF char corpus's),
    # whose CRLF line endings are '\n', as Python reads text (refused, they would be its unknown)
    if prompt_file and tok.unknown('\r'):
        start = start.replace('\r\n', '\n')
    try:  # train.py's rule, for this model's shape on this device
        dtype = precision.resolve_dtype(
            dtype, device, {**saved['model_args'], 'dropout': 0.0}, 1)[0]
    except ValueError as e:
        fail(e)
    autocast = precision.autocast(device_type, dtype)
    # as id 0, which the model met only as train's unknown: a sample of another prompt than asked.
    # The default, '\n', is not the user's: where train has none it is id 0, as in train.py's sample
    if unknown := tok.unknown(start):  # a FILE: prompt may hold many: the first ten
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ''
        fail(f"the prompt holds characters the vocabulary lacks: "
             f"{', '.join(map(repr, unknown[:10]))}{more}: write it with the dataset's characters "
             f"(its meta.json's tokenizer 'chars')")
    start = start or empty_prompt(tok, saved['dataset'])
    # after every check: a mistake is one line
    if busy := distributed.busy_warning(torch.get_num_threads(), distributed.cpu_use()):
        print(busy, file=sys.stderr)
    print(f"sampling {weights_name(ckpt_path, saved)} on {device} {dtype}", file=sys.stderr)
    for i in range(num_samples):
        with autocast:
            for piece in sample_pieces(model, tok, start, max_new_tokens, temperature, top_k,
                                       seed + i, device):
                print(piece, end='', flush=True)
        print('\n' + '-' * 40)

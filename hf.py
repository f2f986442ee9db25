"""
GPT-2 in and out of the Hugging Face format. In: OpenAI's GPT-2 by name (from the Hugging Face
cache, downloaded once when online), a GPT2LMHeadModel folder, or a single .safetensors file, as
this repo's GPT. Out: a GPT as a folder (config.json, model.safetensors, and the tokenizer's files
if given) that transformers loads as GPT2LMHeadModel.

The two models are the same network under other names: GPT-2's blocks are h.N instead of blocks.N,
its files carry a 'transformer.' prefix (or none, in OpenAI's originals), and its Conv1D layers
store their weights as (in, out) where nn.Linear has (out, in). transformers itself is not needed
for either direction.
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from model import padded_vocab

GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')
GPT2_HEADS = {768: 12, 1024: 16, 1280: 20, 1600: 25}  # their widths' head counts: heads of 64
# GPTConfig.activation -> config.json's activation_function (a name in transformers' ACT2FN)
HF_ACTIVATION = {'gelu': 'gelu', 'gelu_tanh': 'gelu_new'}
# and back, with transformers' other name for the tanh approximation
FROM_HF_ACTIVATION = ({hf: ours for ours, hf in HF_ACTIVATION.items()}
                      | {'gelu_pytorch_tanh': 'gelu_tanh'})
SHAPE_KEYS = ('n_layer', 'n_head', 'n_embd', 'bias', 'activation')  # what GPT-2's weights decide
CONV1D_WEIGHTS = ('attn.c_attn.weight', 'attn.c_proj.weight',
                  'mlp.c_fc.weight', 'mlp.c_proj.weight')  # stored (in, out)
# config.json settings this GPT has no switch for: they must have GPT-2's values
GPT2_FIXED = {'model_type': 'gpt2', 'layer_norm_epsilon': 1e-5, 'scale_attn_weights': True,
              'scale_attn_by_inverse_layer_idx': False, 'add_cross_attention': False,
              'tie_word_embeddings': True}


class HFError(Exception):
    """A user mistake; the one-line message says what is wrong and how to fix it."""


def is_source(init_from):
    """Whether train.py's init_from names GPT-2 weights: a GPT-2 name or an existing path."""
    return init_from in GPT2_NAMES or os.path.exists(init_from)


def gpt2_shapes(n_layer, n_embd, vocab_size, n_positions):
    """Every tensor of a GPT2LMHeadModel file (prefix and tied head left out) -> its shape."""
    C = n_embd
    shapes = {'wte.weight': (vocab_size, C), 'wpe.weight': (n_positions, C), 'ln_f.weight': (C,),
              'ln_f.bias': (C,)}
    for i in range(n_layer):
        shapes |= {f'h.{i}.{name}': shape for name, shape in (
            ('ln_1.weight', (C,)), ('ln_1.bias', (C,)), ('attn.c_attn.weight', (C, 3 * C)),
            ('attn.c_attn.bias', (3 * C,)), ('attn.c_proj.weight', (C, C)),
            ('attn.c_proj.bias', (C,)),
            ('ln_2.weight', (C,)), ('ln_2.bias', (C,)), ('mlp.c_fc.weight', (C, 4 * C)),
            ('mlp.c_fc.bias', (4 * C,)), ('mlp.c_proj.weight', (4 * C, C)),
            ('mlp.c_proj.bias', (C,)))}
    return shapes


def layout_differences(tensors, expected):
    """What keeps tensors {key: tensor} from being exactly the expected {key: shape}: a short
    description, or ''."""
    missing = [k for k in expected if k not in tensors]
    extra = [k for k in tensors if k not in expected]
    wrong = [f"{k} {tuple(tensors[k].shape)} vs {expected[k]}" for k in expected
             if k in tensors and tuple(tensors[k].shape) != expected[k]]
    parts = [f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
             for what, keys in (('missing', missing), ('unexpected', extra), ('shapes', wrong))
             if keys]
    return '; '.join(parts)


def file_sha256(path):
    with open(path, 'rb') as f:
        return hashlib.file_digest(f, 'sha256').hexdigest()

# -----------------------------------------------------------------------------
# in


def fetch(name):
    """config.json and model.safetensors of OpenAI's GPT-2 `name`: from the Hugging Face cache, else
    downloaded into it (huggingface_hub honours HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE)."""
    how = (f"get them once online: pip install huggingface_hub, then hf download {name} "
           f"config.json model.safetensors (or any run with init_from={name}); or put those two "
           f"files of {name} in a folder and pass init_from=FOLDER")
    try:
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    except ImportError:
        raise HFError(f"init_from={name} looks GPT-2 up in the Hugging Face cache with the "
                      f"huggingface_hub package, which is not installed: {how}") from None
    files = ('config.json', 'model.safetensors')
    # cached: no request at all (GPT-2's files never change); not cached, or a broken cache:
    # downloaded below
    with contextlib.suppress(Exception):
        return [hf_hub_download(name, filename, local_files_only=True) for filename in files]
    try:
        # one request without retries first: out of reach, a download retries for about 25 s
        get_hf_file_metadata(hf_hub_url(name, files[0]))
        return [hf_hub_download(name, filename) for filename in files]
    except Exception as e:  # offline, no network, a broken cache: the advice is the same
        why = ('HF_HUB_OFFLINE is set' if constants.HF_HUB_OFFLINE
               else (str(e).strip().splitlines() or [type(e).__name__])[0][:120])
        raise HFError(f"GPT-2 weights '{name}' are not in the Hugging Face cache "
                      f"{constants.HF_HUB_CACHE} and could not be downloaded ({why}): "
                      f"{how}") from None


def find_files(source):
    """(config.json path or None, weights path) of a GPT-2 name, a model folder or a .safetensors
    file."""
    if source in GPT2_NAMES:
        return fetch(source)
    if os.path.isdir(source):
        weights = [os.path.join(source, f) for f in ('model.safetensors', 'pytorch_model.bin')
                   if os.path.isfile(os.path.join(source, f))]
        if not weights or not os.path.isfile(os.path.join(source, 'config.json')):
            raise HFError(f"{source} is not a Hugging Face model folder: it needs config.json and "
                          f"model.safetensors (or pytorch_model.bin), as save_pretrained writes "
                          f"them")
        return os.path.join(source, 'config.json'), weights[0]
    if not source.endswith('.safetensors'):
        raise HFError(f"init_from={source} is neither a GPT-2 name, a model folder nor a "
                      f".safetensors file: use one of {', '.join(GPT2_NAMES)} or such a path")
    config = os.path.join(os.path.dirname(source), 'config.json')  # optional beside a single file
    return (config if os.path.isfile(config) else None), source


def read_tensors(path):
    try:
        if path.endswith('.safetensors'):
            return load_file(path)
        return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise HFError(f"cannot read the weights in {path} ({first_line}): download the file "
                      f"again") from None


def read_config(path):
    """A Hugging Face GPT-2 config.json, as a dict; anything else (a train.py run's config.json
    beside a .safetensors, a damaged file) is refused."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"cannot read {path} ({e}): restore it from the model's files") from None
    n_head = config.get('n_head', 1) if isinstance(config, dict) else None
    if type(n_head) is not int or n_head < 1:
        raise HFError(f"{path} is not a Hugging Face GPT-2 config.json (a dict whose n_head is a "
                      f"positive integer): put the weights in a folder with their own config.json")
    return config


def load_gpt2(source, block_size, vocab_size):
    """GPT-2 weights as (model_args for GPTConfig, state_dict for GPT, a record of where they came
    from). The shape comes from the weights; block_size crops the position embedding, as a finetune
    on short windows needs; vocab_size is the dataset's, which must be the weights'. None for
    either: the weights' own (evaluate.py checks its tokenizer itself). dropout is left to the
    caller."""
    config_path, weights_path = find_files(source)
    hf_config = read_config(config_path) if config_path else {}
    tensors = {re.sub(r'^transformer\.', '', k): v for k, v in read_tensors(weights_path).items()}
    # OpenAI's files also hold each layer's causal mask as attn.bias / attn.masked_bias: buffers,
    # not weights
    tensors = {k: v for k, v in tensors.items()
               if not re.fullmatch(r'h\.\d+\.attn\.(masked_)?bias', k)}
    head = tensors.pop('lm_head.weight', None)
    if 'wte.weight' not in tensors or 'wpe.weight' not in tensors:
        raise HFError(f"{weights_path} holds no GPT-2 embeddings (wte.weight, wpe.weight): pass a "
                      f"GPT-2 model")
    n_vocab, n_embd = tensors['wte.weight'].shape
    n_positions = tensors['wpe.weight'].shape[0]
    n_layer = len({k.split('.')[1] for k in tensors if k.startswith('h.')})
    differences = layout_differences(tensors, gpt2_shapes(n_layer, n_embd, n_vocab, n_positions))
    activation = FROM_HF_ACTIVATION.get(hf_config.get('activation_function', 'gelu_new'))
    unsupported = [f"{k}={hf_config[k]!r}" for k, v in GPT2_FIXED.items()
                   if k in hf_config and hf_config[k] != v]
    if activation is None:
        unsupported.append(f"activation_function={hf_config['activation_function']!r}")
    if head is not None and not torch.equal(head, tensors['wte.weight']):
        unsupported.append('an output head not tied to wte')
    problems = ([differences] if differences else []) + unsupported
    if problems:
        raise HFError(f"{weights_path} is not a GPT-2 this GPT can load ({'; '.join(problems)}): "
                      f"pass a GPT2LMHeadModel with GPT-2's layout")
    block_size, vocab_size = block_size or n_positions, vocab_size or n_vocab
    # a single file without config.json: only OpenAI's four widths say their head count (heads of
    # 64); another width's would be a guess, and a wrong one loads a different network silently
    if 'n_head' not in hf_config and n_embd not in GPT2_HEADS:
        raise HFError(f"{weights_path} has no config.json beside it to give its head count, and "
                      f"its width {n_embd} is none of GPT-2's: put its config.json in its folder")
    n_head = hf_config.get('n_head') or GPT2_HEADS[n_embd]
    if block_size > n_positions:
        raise HFError(f"block_size={block_size} exceeds the {n_positions} positions of the weights "
                      f"in {weights_path}: set block_size={n_positions} or less")
    if vocab_size != n_vocab:
        raise HFError(f"the weights in {weights_path} know {n_vocab} tokens, the dataset "
                      f"{vocab_size}: prepare it with their tokenizer, for GPT-2: prepare.py NAME "
                      f"--input PATH --tokenizer gpt2 (or PATH.tiktoken)")
    if n_embd % n_head:
        raise HFError(f"{weights_path}: n_embd={n_embd} is not divisible by n_head={n_head}: fix "
                      f"n_head in its config.json")
    state = {}
    for key, tensor in tensors.items():
        key = re.sub(r'^h\.', 'blocks.', key)
        state[key] = tensor.t() if key.endswith(CONV1D_WEIGHTS) else tensor
    state['wpe.weight'] = state['wpe.weight'][:block_size]
    # GPT's embedding has padded_vocab rows; the padding rows are never looked up or predicted
    state['wte.weight'] = torch.cat([state['wte.weight'],
                                     torch.zeros(padded_vocab(n_vocab) - n_vocab, n_embd)])
    state['lm_head.weight'] = state['wte.weight']  # tied
    model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                      bias=True, vocab_size=vocab_size, activation=activation)
    origin = {'init_from': source, 'weights': os.path.abspath(weights_path),
              'sha256': file_sha256(weights_path)}
    return model_args, state, origin

# -----------------------------------------------------------------------------
# out


def cannot_hold(config):
    """What of a GPTConfig GPT-2's architecture has no place for, as short phrases (empty: it fits).
    A model option GPT-2 lacks gets a line here; GPT-2's weights are loaded and exported only when
    this is empty."""
    return [reason for reason, lacking in (
        (f"activation='{config.activation}'", config.activation not in HF_ACTIVATION),
        ('an output head not tied to the token embedding (tie_head=False)', not config.tie_head),
        (f"pos_emb='{config.pos_emb}'", config.pos_emb != 'learned'),
        ('qk_norm=True', config.qk_norm),
        (f"logit_softcap={config.logit_softcap}", config.logit_softcap > 0),
    ) if lacking]


def export_gpt2(model, folder, eot_id=None, tokenizer_files=None):
    """Write folder/config.json and folder/model.safetensors, loadable with transformers'
    AutoModelForCausalLM.from_pretrained(folder) as GPT2LMHeadModel with the same outputs, and
    tokenizer_files {name: text} (tokenizer.Tokenizer.hf_files) beside them. A model without biases
    gets zero biases, which compute the same. The folder appears complete or not at all."""
    if os.path.exists(folder) and not (os.path.isdir(folder) and not os.listdir(folder)):
        raise HFError(f"{folder} already exists and is not an empty folder: pick a new path for "
                      f"the export")
    config = model.config
    tensors = {}
    for key, tensor in model.state_dict().items():
        if key == 'lm_head.weight':
            continue  # the tied head: transformers ties it to wte on load
        if key == 'wte.weight':
            tensor = tensor[:config.vocab_size]  # without GPT's padding rows
        key = re.sub(r'^blocks\.', 'h.', key)
        tensors[key] = ((tensor.t() if key.endswith(CONV1D_WEIGHTS) else tensor)
                        .detach().float().cpu().contiguous())
    # GPT-2 has a bias beside every weight but the embeddings'
    for key, tensor in list(tensors.items()):
        if key.endswith('.weight') and key not in ('wte.weight', 'wpe.weight'):
            tensors.setdefault(key[:-len('weight')] + 'bias', torch.zeros(tensor.shape[-1]))
    differences = layout_differences(tensors, gpt2_shapes(config.n_layer, config.n_embd,
                                                          config.vocab_size, config.block_size))
    tied = model.lm_head.weight is model.wte.weight  # a fork may untie them by hand
    problems = (cannot_hold(dataclasses.replace(config, tie_head=tied))
                + ([differences] if differences else []))
    if problems:
        raise HFError(f"GPT-2's architecture cannot hold this model ({'; '.join(problems)}): "
                      f"only models with GPT-2's blocks, learned positions, a tied head, GELU and "
                      f"no QK-norm or soft-cap export")
    hf_config = {
        'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2', 'vocab_size': config.vocab_size,
        'n_positions': config.block_size, 'n_embd': config.n_embd, 'n_layer': config.n_layer,
        'n_head': config.n_head, 'n_inner': None,
        'activation_function': HF_ACTIVATION[config.activation],
        'layer_norm_epsilon': 1e-5, 'resid_pdrop': config.dropout, 'embd_pdrop': config.dropout,
        'attn_pdrop': config.dropout, 'tie_word_embeddings': True, 'bos_token_id': eot_id,
        'eos_token_id': eot_id, 'dtype': 'float32',
    }
    parent = os.path.dirname(os.path.abspath(folder))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:  # a file in the way
        raise HFError(f"cannot make {parent} for the export ({e.strerror}): pick another "
                      f"path") from None
    try:
        work = tempfile.mkdtemp(prefix=f'.{os.path.basename(os.path.abspath(folder))}.', dir=parent)
    except OSError as e:  # a folder not ours to write
        raise HFError(f"cannot write in {parent} ({e.strerror}): pick another path") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(work, 0o777 & ~umask)  # mkdtemp's folder is its owner's alone; save_pretrained's not
    try:
        weights = os.path.join(work, 'model.safetensors')
        # transformers reads only files marked as PyTorch's
        save_file({'transformer.' + k: v for k, v in tensors.items()}, weights,
                  metadata={'format': 'pt'})
        os.chmod(weights, 0o666 & ~umask)  # safetensors makes it its owner's alone
        texts = {'config.json': json.dumps(hf_config, indent=2)} | (tokenizer_files or {})
        for name, text in texts.items():
            with open(os.path.join(work, name), 'w', encoding='utf-8') as f:
                f.write(text)
        for name in ['model.safetensors', *texts]:
            with open(os.path.join(work, name), 'rb') as f:
                os.fsync(f.fileno())
        os.replace(work, folder)  # atomic; replaces an empty folder
    except OSError as e:  # a full disk: nothing is left behind
        shutil.rmtree(work, ignore_errors=True)
        raise HFError(f"cannot write {folder} ({e.strerror or e}): free space, or pick another "
                      f"path") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise

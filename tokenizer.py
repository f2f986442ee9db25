"""
The one tokenizer of a dataset, built from the 'tokenizer' entry of its meta.json: prepare.py
encodes the shards with it, train.py and sample.py encode prompts and decode samples with it,
sample.py --export_hf writes it out.

- char: the characters of the train split get ids 1..n, anything else the unknown id 0 (entry:
  chars, unk_id).
- tiktoken: a byte-level BPE that tiktoken encodes, with GPT-2's pre-tokenization split and
  '<|endoftext|>' after the ranks (entry: encoding, pat_str, eot_id): GPT-2's own ('gpt2', a
  one-time download), or a .tiktoken ranks file (entry: ranks_sha256 too). A relative path is one
  inside the dataset folder: the BPE that prepare.py --tokenizer bpe:N trained on the train split
  (train_bpe; entry: trained, what it was trained on).
"""
import base64
import hashlib
import json
import os

import numpy as np
import tiktoken

EOT = '<|endoftext|>'
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT_ID = 50256  # GPT-2's end-of-text id: known without its files


class TokenizerError(Exception):
    """A user mistake; the one-line message says what is wrong and how to fix it."""


class Tokenizer:
    """entry: the meta['tokenizer'] entry it makes. encode/decode for prompts and samples, ids for
    prepare.py's shards, eot_id (None for char), vocab_size, and start: where documents start, the
    prompt of an empty start."""

    def __init__(self, entry, chars=None, enc=None):
        self.entry, self.enc = entry, enc
        if enc is None:
            self.table = np.zeros(0x110000, dtype=np.uint32)  # one slot per unicode code point
            self.table[[ord(c) for c in chars]] = np.arange(1, len(chars) + 1)
            self.itos = ['\ufffd'] + list(chars)
            self.eot_id, self.vocab_size, self.start = None, len(self.itos), '\n'
        else:
            self.eot_id, self.vocab_size, self.start = enc.eot_token, enc.eot_token + 1, EOT

    def ids(self, text, dtype, end_of_document=False):
        """text's ids as an array of dtype ('<|endoftext|>' in text is text), then end-of-text if
        end_of_document and this tokenizer has one."""
        if self.enc is None:
            return (self.table[np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)]
                    .astype(dtype))
        return np.array(self.enc.encode_ordinary(text) + ([self.eot_id] if end_of_document else []),
                        dtype=dtype)

    def encode(self, text):
        """A prompt's ids: '<|endoftext|>' in it is the end-of-text token."""
        if self.enc is None:
            return self.ids(text, np.int64).tolist()
        return self.enc.encode(text, allowed_special={EOT})

    def unknown(self, text):
        """The characters of text this vocabulary lacks, each once, in order: a char tokenizer's
        unknown id 0. A BPE's bytes spell any text."""
        if self.enc is not None:
            return []
        return list(dict.fromkeys(c for c in text if not self.table[ord(c)]))

    def decode(self, ids):
        if self.enc is None:
            return ''.join(self.itos[i] for i in ids)
        return self.enc.decode(ids)

    def hf_files(self):
        """{file name: text} of this tokenizer in Hugging Face's format:
        AutoTokenizer.from_pretrained loads a folder holding them, and encodes and decodes exactly
        as this does."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        config = {'tokenizer_class': 'PreTrainedTokenizerFast',
                  'clean_up_tokenization_spaces': False}
        if self.enc is None:
            # a character the train split lacks is the unknown id 0, shown as U+FFFD unless that is
            # a character here
            unk = '<unk>' if '\ufffd' in self.itos[1:] else '\ufffd'
            hf = HFTokenizer(models.WordLevel(
                {unk: 0} | {c: i for i, c in enumerate(self.itos) if i}, unk_token=unk))
            # every character alone
            hf.pre_tokenizer = pre_tokenizers.Split(Regex(r'[\s\S]'), 'isolated')
            hf.decoder = decoders.Fuse()
            config['unk_token'] = unk
        else:
            hf = HFTokenizer(models.BPE(*hf_vocab_merges(self.enc._mergeable_ranks),
                                        ignore_merges=True))
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(self.enc._pat_str), 'isolated'),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            hf.decoder = decoders.ByteLevel()
            hf.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
            config |= {'bos_token': EOT, 'eos_token': EOT}
        return {'tokenizer.json': hf.to_str(pretty=True),
                'tokenizer_config.json': json.dumps(config, indent=2)}


def hf_vocab_merges(ranks):
    """tiktoken's ranks {token bytes: rank} as a Hugging Face byte-level BPE (vocab, merges), as
    transformers' TikTokenConverter does it: tokens spelled in GPT-2's byte-to-character table, and
    for each token in rank order every split into two tokens as a merge. With ignore_merges (a piece
    that is a token stays whole, as in tiktoken) it encodes as tiktoken does."""
    printable = [*range(ord('!'), ord('~') + 1), *range(ord('\xa1'), ord('\xac') + 1),
                 *range(ord('\xae'), 256)]
    others = [b for b in range(256) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    spell = lambda token: ''.join(char_of[b] for b in token)
    merges = [(spell(token[:k]), spell(token[k:]))
              for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])
              for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
    return {spell(token): rank for token, rank in ranks.items()}, merges


def char(chars):
    """The character tokenizer of a split's sorted characters."""
    return Tokenizer({'kind': 'char', 'chars': chars, 'unk_id': 0}, chars=chars)


def gpt2():
    try:
        enc = tiktoken.get_encoding('gpt2')
    except Exception:
        raise TokenizerError('could not load the gpt2 tokenizer (tiktoken needs a one-time '
                             'download; offline?): run once where tiktoken can download, with '
                             'the same TIKTOKEN_CACHE_DIR') from None
    return Tokenizer({'kind': 'tiktoken', 'encoding': 'gpt2', 'pat_str': GPT2_PAT_STR,
                      'eot_id': enc.eot_token}, enc=enc)


def read_ranks(path, folder=None, expected_sha256=None):
    """(absolute path, contents, sha256) of the .tiktoken ranks file at path (relative: inside
    folder); refuses a missing file, or one that changed since expected_sha256 was taken."""
    full_path = os.path.abspath(os.path.join(folder or '', path))
    if not os.path.isfile(full_path):  # a dataset's, whose sha256 prepare.py recorded, or given
        fix = 'restore it, or prepare the dataset again' if expected_sha256 else 'check the path'
        raise TokenizerError(f'tokenizer file {full_path} not found: {fix}')
    with open(full_path, 'rb') as f:
        contents = f.read()
    sha256 = hashlib.sha256(contents).hexdigest()
    if expected_sha256 not in (None, sha256):
        raise TokenizerError(f'tokenizer file {full_path} changed since the dataset was prepared: '
                             f'restore it, or re-run prepare.py')
    return full_path, contents, sha256


def ranks_file(path, folder=None, pat_str=GPT2_PAT_STR, expected_sha256=None):
    """The BPE of a .tiktoken ranks file (read_ranks), '<|endoftext|>' after its ranks."""
    full_path, contents, sha256 = read_ranks(path, folder, expected_sha256)
    try:  # tiktoken's own loader would copy the file into its download cache
        ranks = {base64.b64decode(token, validate=True): int(rank)
                 for token, rank in (line.split() for line in contents.splitlines() if line)}
        # tiktoken would raise OverflowError, or panic (a BaseException: tokenizer processes die)
        if outside := [rank for rank in ranks.values() if not 0 <= rank < 2**32 - 1]:
            raise ValueError(f'rank {outside[0]} is outside 0 to 2**32 - 2')
        if len(set(ranks.values())) < len(ranks):
            raise ValueError('two tokens have the same rank')
        # tiktoken panics on a byte of the text it has no token for; UTF-8 never holds 0xC0, 0xC1
        # or 0xF5 to 0xFF
        text_bytes = [i for i in range(0xF5) if i not in (0xC0, 0xC1)]
        if missing := [i for i in text_bytes if bytes([i]) not in ranks]:
            raise TokenizerError(f'tokenizer file {full_path} lacks {len(missing)} of the '
                                 f'{len(text_bytes)} single bytes UTF-8 text holds (e.g. '
                                 f'{bytes(missing[:1])!r}), without which some text cannot be '
                                 f'encoded: use a byte-level BPE\'s whole ranks file')
        # the largest rank, not the count: a file with a gap in its ranks must not give a token's id
        # to EOT
        enc = tiktoken.Encoding(name=os.path.basename(full_path).removesuffix('.tiktoken'),
                                pat_str=pat_str, mergeable_ranks=ranks,
                                special_tokens={EOT: max(ranks.values()) + 1})
    except ValueError as e:
        raise TokenizerError(f'tokenizer file {full_path} is not a tiktoken ranks file ({e}): '
                             f'each line must be "base64(token bytes) rank"') from None
    return Tokenizer({'kind': 'tiktoken', 'encoding': path, 'ranks_sha256': sha256,
                      'pat_str': pat_str, 'eot_id': enc.eot_token}, enc=enc)


def load(entry, folder=None):
    """The Tokenizer of a meta['tokenizer'] entry; folder: the dataset's, where a relative ranks
    file lives."""
    if entry['kind'] == 'char':
        if 'chars' not in entry:
            raise TokenizerError("the char tokenizer's characters are missing from the dataset's "
                                 "meta.json: prepare the dataset again with prepare.py")
        return char(entry['chars'])
    if entry['encoding'] == 'gpt2':
        return gpt2()
    return ranks_file(entry['encoding'], folder, entry.get('pat_str', GPT2_PAT_STR),
                      entry.get('ranks_sha256'))


def resolve(entry, folder):
    """entry with its ranks file's path absolute, after checking the file is there and unchanged;
    char and gpt2 entries as they are. Reads the file, never the network."""
    if entry['kind'] == 'char' or entry['encoding'] == 'gpt2':
        return entry
    return {**entry, 'encoding': read_ranks(entry['encoding'], folder,
                                            entry.get('ranks_sha256'))[0]}


def hf_export(entry):
    """(end-of-text id or None, {file name: text}) to export with a model trained on a dataset with
    this tokenizer entry. GPT-2's needs no file (a download): its id is known and transformers has
    it by name, 'gpt2'."""
    if entry['kind'] == 'tiktoken' and entry['encoding'] == 'gpt2':
        return GPT2_EOT_ID, {}
    tok = load(entry)
    return tok.eot_id, tok.hf_files()


def train_bpe(texts, vocab_size, path):
    """Learn a byte-level BPE of vocab_size ids (vocab_size - 1 ranks, then '<|endoftext|>') from
    the strings texts with rustbpe, pre-tokenized by GPT-2's split, and write it to path as a
    .tiktoken ranks file. rustbpe streams texts and counts the distinct pieces: its memory grows
    with their number, not with the text's size. Merges are the pairs of the highest count, a tie
    going to the lowest pair of ids: the same texts in any order give the same ranks; fewer than
    asked when the texts hold no more pairs."""
    try:  # imported here: nothing else needs it, and GPU images often lack it
        import rustbpe
    except ImportError:
        raise TokenizerError('training a BPE needs the rustbpe package: pip install -r '
                             'requirements.txt, or use --tokenizer char or gpt2') from None
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(texts, vocab_size - 1, pattern=GPT2_PAT_STR)
    ranks = sorted(trainer.get_mergeable_ranks(), key=lambda token_rank: token_rank[1])
    with open(path, 'w') as f:
        f.writelines(f'{base64.b64encode(bytes(token)).decode()} {rank}\n' for token, rank in ranks)

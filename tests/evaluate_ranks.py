"""One rank of evaluate.score() in a gloo process group, for tests/test_evaluate.py:

    python tests/evaluate_ranks.py HF_FOLDER TOKENIZER TASK BATCH_SIZE RANK WORLD_SIZE STORE_FILE
        ddp|fsdp

Loads GPT-2 weights as evaluate.py's init_from does; 'fsdp' shards them (FSDP2), where every forward
is a collective of all ranks. Rank 0 prints score()'s result as JSON."""
import json
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

# the repo, for evaluate
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evaluate  # noqa: E402
import distributed  # noqa: E402

folder, tokenizer, task, batch_size, rank, world_size, store, parallel = sys.argv[1:]
batch_size, rank, world_size = int(batch_size), int(rank), int(world_size)
dist.init_process_group('gloo', init_method=f'file://{store}', rank=rank, world_size=world_size)
model, tok = evaluate.load_pretrained(folder, tokenizer, 'cpu')
if parallel == 'fsdp':
    model.fully_shard(torch.float32, 'cpu')
examples = evaluate.read_task(task, tok.encode, model.config.block_size)
result = evaluate.score(model, examples, batch_size, 'cpu', nullcontext(), rank, world_size)
if rank == 0:
    print(json.dumps(result))
distributed.destroy_process_group()  # after a pause: gloo frees the last collective's tensors late

# A model and run small enough for a CPU test: seconds per run.
dataset = 'toy'
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32
batch_size = 8
gradient_accumulation_steps = 1
dropout = 0.0
learning_rate = 3e-3
max_iters = 40
lr_decay_iters = 40
warmup_iters = 5
min_lr = 3e-4
eval_interval = 20
eval_iters = 4
log_interval = 1
num_workers = 0
device = 'cpu'  # also where a GPU is present: a test that runs there says --device=cuda
# the end-of-run extras and the smoke test cost seconds per run: the tests of each switch it on
test_eval = False
sample_tokens = 0
write_report = False
smoke_steps = 0

# The default job: a small character-level GPT on this Python's own standard-library source
# (prepared on first use, no network). A few minutes on a 2-core CPU.
out_dir = 'out/tiny'
dataset = 'pystdlib_char'
eval_interval = 250
eval_iters = 20
log_interval = 25

n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0
bias = False

batch_size = 16
gradient_accumulation_steps = 1
num_workers = 0  # batches this small load faster in the training process (docs/benchmarks.md)
learning_rate = 2e-3
max_iters = 1500
lr_decay_iters = 1500
warmup_iters = 100
min_lr = 2e-4
beta2 = 0.99

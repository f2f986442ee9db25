# shakespeare_char on a CPU, float32, the quickest recipe measured here (README: Measured speed).
# It does NOT yet reach nanoGPT's val loss 1.886 in half of nanoGPT's 161 s: see the README.
# Prepare first: python prepare.py shakespeare_char [--input input.txt]
out_dir = 'out-shakespeare-char-cpu'
dataset = 'shakespeare_char'
eval_interval = 500
eval_iters = 110  # x batch_size windows of 64 cover the whole val split: the val loss is exact, not sampled
log_interval = 50
always_save_checkpoint = False

n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
dropout = 0.0
bias = False

batch_size = 16
gradient_accumulation_steps = 1
num_workers = 0  # measured faster here than a worker process for batches this small
learning_rate = 4e-3
max_iters = 1500
lr_decay_iters = 1500
warmup_iters = 50
min_lr = 4e-4
beta2 = 0.99

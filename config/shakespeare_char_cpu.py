# shakespeare_char on a CPU: nanoGPT's val loss 1.886 in less time than nanoGPT's own CPU recipe
# (docs/benchmarks.md). Against that recipe (4 layers, batch 12, lr 1e-3, 2000 steps): 2 layers (at
# this length the loss follows the steps taken, not the depth), a batch of 32 at a 5x learning rate,
# 700 steps.
# Prepare first: python prepare.py shakespeare_char [--input input.txt]
out_dir = 'out-shakespeare-char-cpu'
dataset = 'shakespeare_char'
eval_interval = 350
# x batch_size windows of 64 cover the whole val split: the val loss is exact, not sampled
eval_iters = 55
log_interval = 50
always_save_checkpoint = False

n_layer = 2
n_head = 4
n_embd = 128
block_size = 64
dropout = 0.0
bias = False

batch_size = 32
gradient_accumulation_steps = 1
num_workers = 0  # measured faster here than a worker process for batches this small
learning_rate = 5e-3
max_iters = 700
lr_decay_iters = 700
warmup_iters = 50
min_lr = 5e-4
beta2 = 0.99

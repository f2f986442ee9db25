# shakespeare_char on a CPU, fast: nanoGPT's val loss 1.886 in a quarter of the time of nanoGPT's
# own CPU recipe beside it, or less (docs/benchmarks.md: 4.6-5.3x on a 2-core Xeon with AMX and
# capped at AVX2, and on an AVX512-BF16 EPYC).
# config/shakespeare_char_cpu.py's shape, with the modern recipe: Muon for the blocks' matrices,
# rotary positions, QK-norm, an untied zero-initialized head, soft-capped logits,
# warmup-stable-decay.
# Prepare first: python prepare.py shakespeare_char [--input input.txt]
out_dir = 'out-shakespeare-char-fast'
dataset = 'shakespeare_char'
eval_interval = 210  # at the end only: an evaluation of train and val costs as much as ~25 steps
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
pos_emb = 'rope'
qk_norm = True
# relu2 is as fast here but ended 0.01-0.02 higher in this recipe (docs/benchmarks.md)
activation = 'gelu'
tie_head = False
logit_softcap = 15.0
zero_init = True

batch_size = 32
gradient_accumulation_steps = 1
num_workers = 0  # measured faster here than a worker process for batches this small
optimizer = 'muon'
muon_lr = 0.03  # 0.05 (with learning_rate 8e-3) was worse
learning_rate = 5e-3  # AdamW's: embedding, head, gains
max_iters = 210  # val 1.859-1.875 at the end over 3 seeds, in float32 and bfloat16
lr_schedule = 'wsd'
wsd_decay_frac = 0.4
lr_decay_iters = 210
warmup_iters = 20
min_lr = 5e-4
beta2 = 0.99

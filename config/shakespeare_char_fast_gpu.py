# config/shakespeare_char.py (nanoGPT's GPU recipe: 6 layers of 384, block 256, dropout 0.2)
# with the recipe of config/shakespeare_char_fast.py, at the CPU recipe's rates and half the
# iterations. On one H100 (compile=True) it reached val 1.5 at 60 s and its best, 1.428, at
# iteration 1750, against nanoGPT's own recipe's 68 s and 1.463; on an H200, 81 s and 1.424 at
# 2250 against 80 s (docs/benchmarks.md, GPU). It overfits near the end, as nanoGPT's does:
# best.pt keeps the best. Not tuned on a GPU.
# Prepare first: python prepare.py shakespeare_char [--input input.txt]
out_dir = 'out-shakespeare-char-fast-gpu'
dataset = 'shakespeare_char'
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False

gradient_accumulation_steps = 1
batch_size = 64
block_size = 256

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
pos_emb = 'rope'
qk_norm = True
tie_head = False
logit_softcap = 15.0
zero_init = True

optimizer = 'muon'
muon_lr = 0.03
learning_rate = 5e-3  # AdamW's: embedding, head, gains
max_iters = 2500
lr_schedule = 'wsd'
wsd_decay_frac = 0.4
lr_decay_iters = 2500
warmup_iters = 100
min_lr = 5e-4
beta2 = 0.99

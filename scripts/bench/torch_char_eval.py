# Evaluation throughput of the char-GPT recipe in PyTorch (forward passes in eval mode, no grad):
# the anchor for `tinygpt eval`. Same model as ../../../shared/bench/torch_char_gpt.py (6 layers,
# 6 heads, 384 wide, block 256, batch 64, vocabulary 65); the weights are random, which does not
# change the time. usage: DEVICE=cpu python3 torch_char_eval.py BATCHES
import json, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F

batches = int(sys.argv[1])
V, T, B, C, L, H = 65, 256, 64, 384, 6, 6
dev = os.environ.get("DEVICE", "cpu")
torch.manual_seed(1337)

class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(C, bias=False), nn.LayerNorm(C, bias=False)
        s.qkv, s.proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        s.fc, s.out = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)
    def forward(s, x):
        b, t, c = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(C, 2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + s.out(F.gelu(s.fc(s.ln2(x))))

class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok, s.pos = nn.Embedding(V, C), nn.Embedding(T, C)
        s.blocks = nn.ModuleList(Block() for _ in range(L))
        s.lnf, s.head = nn.LayerNorm(C, bias=False), nn.Linear(C, V, bias=False)
    def forward(s, idx, tgt):
        x = s.tok(idx) + s.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in s.blocks: x = blk(x)
        return F.cross_entropy(s.head(s.lnf(x)).view(-1, V), tgt.view(-1))

model = GPT().to(dev).eval()
x = torch.randint(V, (B, T), device=dev); y = torch.randint(V, (B, T), device=dev)
with torch.no_grad():
    model(x, y)  # warm-up
    t0 = time.time()
    for _ in range(batches): model(x, y).item()
    s = time.time() - t0
print(json.dumps({"batches": batches, "s_per_batch": round(s / batches, 3),
                  "tokens_per_s": round(B * T * batches / s), "threads": torch.get_num_threads()}))

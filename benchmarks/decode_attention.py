"""One decode step's attention at a rollout's shape (Qwen2.5-0.5B's 14 query / 2 key-value heads,
batch 64, cache 768), with a mask: transformers' ``sdpa`` as it runs under ``torch.compile``
(``repeat_kv`` copies each key/value head per query head) against
:func:`lightning_mem.rl.decode.grouped_decode_attention` (each key/value head read once). Same output.

    python benchmarks/decode_attention.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import time, torch
from types import SimpleNamespace
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from lightning_mem.rl.decode import grouped_decode_attention
torch.manual_seed(0)
B, Hq, Hkv, L, D = 64, 14, 2, 768, 64
dt = torch.float32
q = torch.randn(B, Hq, 1, D, dtype=dt); k = torch.randn(B, Hkv, L, D, dtype=dt); v = torch.randn(B, Hkv, L, D, dtype=dt)
mask = torch.rand(B, 1, 1, L) > 0.1
mod = SimpleNamespace(num_key_value_groups=Hq // Hkv, is_causal=True)
a, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=D ** -0.5)
b, _ = grouped_decode_attention(mod, q, k, v, mask, scaling=D ** -0.5)
print("max abs diff", (a - b).abs().max().item())
# transformers 5.24 packs GQA itself outside compile; time what compiled code runs (repeat_kv) by forcing it
import transformers.integrations.sdpa_attention as S
S.is_torchdynamo_compiling = lambda: True
times = {"repeat_kv (as compiled)": [], "grouped": []}
for r in range(5):
    for name, fn in (("repeat_kv (as compiled)", sdpa_attention_forward), ("grouped", grouped_decode_attention)):
        t = time.perf_counter()
        for _ in range(10): fn(mod, q, k, v, mask, scaling=D ** -0.5)
        times[name].append((time.perf_counter() - t) / 10 * 1e3)
for n, t in times.items(): print(f"{n}: {sorted(t)[2]:.2f} ms (median of 5 x 10 calls)")

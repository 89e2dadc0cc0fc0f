"""A 32k-token prompt through a tiny model on CPU, under a peak-memory bound.

The prompt's attention over the compressed cache runs in query and key blocks with an online
softmax, and the mask stays compact (causal, no ``[Lq, S]`` tensor): memory grows with the
packed cache and one block. The scores of a single head over the whole prompt would take
``32768**2 * 4`` bytes = 4 GiB (and a boolean ``[Lq, S]`` mask 1 GiB); the bound below is 768
MiB of growth of the process's peak resident memory during the prefill, far below either, and
well above what the model's own activations need (tens of MiB at hidden size 64).

The prefill runs in a fresh subprocess so that its peak memory is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, resource, torch
from transformers import LlamaConfig, LlamaForCausalLM
from rqlib.hf import compress

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                     max_position_embeddings=40000)
model = LlamaForCausalLM(config).eval()
spec = "turboquant-mse:k3:v3:sink1:win64:wb=8:nm=6"
ids = torch.randint(0, 256, (1, 32768))
with torch.no_grad(), compress(model, spec) as cache:
    model(ids[:, :64], cache=cache)  # warm up: every code path once, at a small size
    cache.reset()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logits = model(ids, cache=cache, logits_to_keep=8).logits
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_kib": after - before, "tokens": cache.get_seq_length(),
                      "finite": bool(torch.isfinite(logits).all()),
                      "stored_kib": cache.nbytes() / 1024}))
"""

BOUND_KIB = 768 * 1024


def test_a_32k_prompt_prefills_in_blocks_under_a_memory_bound():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(report)
    assert report["tokens"] == 32768 and report["finite"]
    assert report["growth_kib"] < BOUND_KIB

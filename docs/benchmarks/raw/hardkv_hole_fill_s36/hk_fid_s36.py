"""Hard-KV fidelity on the embedded model (CPU, fp32) after session 35's hole-filling compaction: budgets 64 / 128 /
256 with the default layout (hole_fill on: rows not time-ordered) and, at each budget, the time-ordered compaction
(hole_fill off, the layout the fidelity table was measured on); one reference, one process."""
import json, sys, time
import torch
sys.path.insert(0, "/work/main")
from kvroll import fidelity as F
from kvroll.policies import hardkv as H
from kvroll.rollout.replay import greedy_reference
from kvroll import CompressionConfig, RolloutEngine

torch.set_num_threads(2)
tokens = 1024
model, tok = F._load("smollm2", "cpu")
prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
           for t in F.load_prompts()]
start = time.time()
ref = RolloutEngine(model, CompressionConfig("full"), max_batch=len(prompts), tokenizer=tok)
ref_tokens, ref_lp = greedy_reference(ref, prompts, tokens)
print(f"reference {time.time() - start:.0f}s", flush=True)
rows = {}
for budget in (64, 128, 256):
    for fill in (True, False):
        H.HardKVPolicy.hole_fill = fill
        name = f"b{budget}_{'hole_fill' if fill else 'time_ordered'}"
        rows[name] = F._measure(model, tok, prompts, "hardkv", budget, ref_tokens, ref_lp)
        print(name, rows[name], flush=True)
        json.dump({"tokens": tokens, "prompt_lengths": [len(p) for p in prompts], "rows": rows},
                  open("/tmp/fid/hk_fid_s36.json", "w"), indent=1)

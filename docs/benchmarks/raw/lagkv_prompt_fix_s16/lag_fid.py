"""LagKV fidelity at budget 64 on the embedded model (CPU, fp32): the prompt-reserve fix against the old rule, one
reference, same process. The old rule runs on the device-read path (what it ran on before session 16)."""
import json, sys, time
import torch
sys.path.insert(0, "/work/main")
from kvroll import fidelity as F
from kvroll.policies import lagkv as L
from kvroll.rollout import engine as E
from kvroll.rollout.replay import greedy_reference
from kvroll import CompressionConfig, RolloutEngine

torch.set_num_threads(2)
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
model, tok = F._load("smollm2", "cpu")
prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
           for t in F.load_prompts()]
print("prompt lengths", [len(p) for p in prompts], flush=True)
start = time.time()
ref = RolloutEngine(model, CompressionConfig("full"), max_batch=len(prompts), tokenizer=tok)
ref_tokens, ref_lp = greedy_reference(ref, prompts, tokens)
print(f"reference {time.time() - start:.0f}s", flush=True)
rows = {}
rows["fixed"] = F._measure(model, tok, prompts, "lagkv", 64, ref_tokens, ref_lp)
print(rows["fixed"], flush=True)
old = L.LagKVPolicy.prompt_keep_idx
def old_rule(self, q, k, keep, scale, generator=None, v=None):
    idx, _ = L.lagkv_select(k, v, 0, keep, 0, self.params)
    return idx
L.LagKVPolicy.prompt_keep_idx = old_rule
E.HostSchedule.for_cache = classmethod(lambda cls, cache, slots: None)
rows["old"] = F._measure(model, tok, prompts, "lagkv", 64, ref_tokens, ref_lp)
print(rows["old"], flush=True)
json.dump({"tokens": tokens, "prompt_lengths": [len(p) for p in prompts], "rows": rows}, open("/tmp/fid/lag_fid.json", "w"), indent=1)

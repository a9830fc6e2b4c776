"""Hard-KV fidelity at budget 64 on the embedded model (CPU, fp32): prompt compression keeping the sinks (session 16)
against the old rule (SnapKV's alone), one reference, same process."""
import json, sys, time
import torch
sys.path.insert(0, "/work/main")
from kvroll import fidelity as F
from kvroll.policies import hardkv as H
from kvroll.policies.snapkv import snapkv_prompt_keep
from kvroll.rollout.replay import greedy_reference
from kvroll import CompressionConfig, RolloutEngine

torch.set_num_threads(2)
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
model, tok = F._load("smollm2", "cpu")
prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
           for t in F.load_prompts()]
start = time.time()
ref = RolloutEngine(model, CompressionConfig("full"), max_batch=len(prompts), tokenizer=tok)
ref_tokens, ref_lp = greedy_reference(ref, prompts, tokens)
print(f"reference {time.time() - start:.0f}s", flush=True)
rows = {"sinks_kept": F._measure(model, tok, prompts, "hardkv", 64, ref_tokens, ref_lp)}
print(rows, flush=True)
H.HardKVPolicy.prompt_keep_idx = lambda self, q, k, keep, scale, generator=None: snapkv_prompt_keep(
    q, k, keep, scale, min(self.params.window, keep - 1), self.params.pool_kernel)
rows["old_rule"] = F._measure(model, tok, prompts, "hardkv", 64, ref_tokens, ref_lp)
print(rows["old_rule"], flush=True)
json.dump({"tokens": tokens, "prompt_lengths": [len(p) for p in prompts], "rows": rows},
          open("/tmp/fid/hk_fid.json", "w"), indent=1)

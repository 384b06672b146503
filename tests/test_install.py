"""A fresh install: kernels.py shares its name with Hugging Face's `kernels` package, which transformers imports when
it loads. The tests and `bench.py peer` import transformers through bench.import_transformers(); these tests run it
in a fresh process, as a user's would, with the package installed (transformers 5 requires it).

Run: python -m pytest -q tests/test_install.py"""
import importlib.metadata
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import sys
import kernels                                    # ours first, as every entry point imports it
import bench
transformers = bench.import_transformers()
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.integrations import hub_kernels
import torch
cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                       num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                       qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=1)
model = DeepseekV3ForCausalLM(cfg).eval()
logits = model(torch.arange(5)[None]).logits
assert logits.shape == (1, 5, 64) and torch.isfinite(logits).all()
model.save_pretrained(sys.argv[1])                # from_pretrained kernelizes by default: it must not reach ours
again = DeepseekV3ForCausalLM.from_pretrained(sys.argv[1]).eval()
assert torch.equal(again(torch.arange(5)[None]).logits, logits)
import kernels as again
assert again is kernels and sys.modules["kernels"] is kernels and hasattr(again, "fast"), "lost our kernels.py"
print(hub_kernels.LayerRepository.__module__)     # bound from Hugging Face's package, not from ours
'''


def test_kernels_distribution_is_installed():
    """The guard below means something only where transformers' `kernels` dependency is present."""
    assert importlib.metadata.version("kernels")


def test_transformers_deepseek_v3_beside_our_kernels_py(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"} | {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("kernels."), proc.stdout


def test_plain_import_would_find_our_file():
    """Why the helper exists: run from the project root, Python resolves `kernels` to kernels.py."""
    proc = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == os.path.join(ROOT, "kernels.py"), proc.stdout

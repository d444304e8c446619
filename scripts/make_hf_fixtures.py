"""Tiny random Hugging Face models and their logits: the oracle that `tests/test_convert.py` checks
`python -m mtjax.convert from-hf` against.

    python3 -m venv /work/hfenv
    /work/hfenv/bin/pip install torch                    # the CPU-only wheel is enough
    /work/hfenv/bin/pip install transformers safetensors
    /work/hfenv/bin/python scripts/make_hf_fixtures.py            # rewrites tests/fixtures/hf/
    /work/hfenv/bin/python scripts/make_hf_fixtures.py mixtral    # rewrites only the fixtures named

Made with transformers 5.23.0 and torch 2.13.0+cpu, the MoE ones, qwen3, mistral and qwen2_yarn with transformers 5.24.0
(recorded in tests/fixtures/hf/versions.json, per fixture where a run made only some).
The script needs torch and transformers; mtjax and its tests need neither.

For each model, `tests/fixtures/hf/<name>/` holds what `save_pretrained` writes (config.json and
model.safetensors, or shards and model.safetensors.index.json) and `expected.safetensors`:
`input_ids` [2, s] (int32) and `logits` [2, s, V] (fp32), s = 64 or 32, as transformers computes them (eager
attention, fp32). Every parameter is redrawn from one seed, biases and norm weights included
(transformers initialises those to 0 and 1, which would hide a bias or norm mapped to the wrong
place). Rerunning rewrites the same files.

  gpt2   GPT2LMHeadModel: tied, gelu_new (= mtjax's gelu_tanh), fused c_attn, Conv1D weights
  llama  LlamaForCausalLM: untied, GQA (4 heads, 2 kv heads), head_dim 16 != h/a = 8,
         llama3 rope scaling (factor 8, low 1, high 4, original 16 positions: it matters at s = 64);
         saved in two shards with model.safetensors.index.json
  qwen2  Qwen2ForCausalLM: q/k/v biases, tied (as the small Qwen2 models are), GQA, rope_theta 1e6
  qwen2_yarn  qwen2 with YaRN rope scaling (factor 4, original 16 positions, so it matters at s = 64;
              rope_theta 100, beta_fast 4, beta_slow 0.5, so that the ramp over head_dim/2 = 4 pairs
              has a middle value), the attention factor derived (0.1 ln 4 + 1)
  gpt2_gelu_untied  GPT-2 with exact gelu, an untied lm_head and n_inner 96, s = 32
  llama_plain       Llama: untied, GQA, unscaled rope, head_dim h/a, s = 32
The last two add exact gelu, an untied GPT-2 output layer, a non-default n_inner, and plain rope.
  mixtral    MixtralForCausalLM: 4 experts, top-2 (renormalised), GQA, s = 32, V = 256
  qwen2_moe  Qwen2MoeForCausalLM: 4 experts, top-2 not renormalised (norm_topk_prob false),
             q/k/v biases, a shared expert (48 wide) behind its sigmoid gate, s = 32
  qwen3_moe  Qwen3MoeForCausalLM: 4 experts, top-2 renormalised (norm_topk_prob true, as the released
             models), QK-norm (q_norm, k_norm over head_dim), head_dim 16 != h/a = 8, GQA, s = 32
  qwen3      Qwen3ForCausalLM: the dense Qwen3, QK-norm, head_dim 16 != h/a = 8, GQA, tied, s = 32
  mistral    MistralForCausalLM: untied, GQA, head_dim 16 != h/a = 8, rms_norm_eps 1e-5, and a
             sliding_window of 32 = s, which transformers' mask applies and which masks nothing
The MoE ones save each expert's matrices as tensors of their own (experts.{j}.w1 / gate_proj ...),
and these four also hold in expected.safetensors `prompt` [5] (the first ids of row 0) and
`generated` [8]: the tokens transformers' greedy search adds to it.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys

import safetensors
import torch
import transformers
from safetensors.torch import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
SEED = 1234
BATCH, SEQ, SHORT = 2, 64, 32
PROMPT, NEW = 5, 8                      # greedy generation: a prompt of the first ids, new tokens
GENERATE = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3")   # the fixtures that also hold `prompt` and `generated`


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, layer_norm_epsilon=1e-5,
        bos_token_id=None, eos_token_id=None))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=False))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=330, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, tie_word_embeddings=True))


def qwen2_yarn():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=330, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                         "original_max_position_embeddings": SEQ // 4, "beta_fast": 4.0, "beta_slow": 0.5},
        use_sliding_window=False, tie_word_embeddings=True))


def gpt2_gelu_untied():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_positions=SHORT, n_embd=32, n_layer=2, n_head=4, n_inner=96, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, layer_norm_epsilon=1e-5,
        bos_token_id=None, eos_token_id=None))


def llama_plain():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SHORT, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SHORT, rms_norm_eps=1e-5, num_local_experts=4,
        num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None))


def qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=200, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=SHORT, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, tie_word_embeddings=False))


# the shapes the later fixtures share: 2 layers of h 32, 4 query and 2 kv heads of 16, f 64
SMALL_GQA = dict(hidden_size=32, intermediate_size=64, head_dim=16, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=SHORT)


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=224, **SMALL_GQA, moe_intermediate_size=16, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
        tie_word_embeddings=False))


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=272, **SMALL_GQA, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=SHORT,
        tie_word_embeddings=False))


def qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=240, **SMALL_GQA, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
        tie_word_embeddings=True))


# name: (build, max_shard_size, s)
MODELS = {"gpt2": (gpt2, None, SEQ), "llama": (llama, "100KB", SEQ), "qwen2": (qwen2, None, SEQ),
          "qwen2_yarn": (qwen2_yarn, None, SEQ),
          "gpt2_gelu_untied": (gpt2_gelu_untied, None, SHORT), "llama_plain": (llama_plain, None, SHORT),
          "mixtral": (mixtral, None, SHORT), "qwen2_moe": (qwen2_moe, None, SHORT),
          "qwen3_moe": (qwen3_moe, None, SHORT), "qwen3": (qwen3, None, SHORT), "mistral": (mistral, None, SHORT)}


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter redrawn: matrices N(0, 0.2^2), embeddings N(0, 0.5^2), biases N(0, 0.1^2),
    norm weights 1 + N(0, 0.1^2). Tied parameters appear once in named_parameters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1:
                is_norm = "ln" in name or "norm" in name
                p.copy_(1.0 + 0.1 * noise if is_norm and name.endswith("weight") else 0.1 * noise)
            elif "wte" in name or "wpe" in name or "embed" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.2 * noise)


def greedy(model, prompt: torch.Tensor) -> dict:
    """`prompt` [p] and the NEW tokens transformers' greedy search (no sampling, no EOS) adds."""
    with torch.no_grad():
        out = model.generate(input_ids=prompt[None], max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=NEW)
    return {"prompt": prompt.to(torch.int32).contiguous(), "generated": out[0, len(prompt):].to(torch.int32).contiguous()}


def make(name: str) -> None:
    build, shard, seq = MODELS[name]
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    model = build().float().eval()
    model.set_attn_implementation("eager")
    randomize(model, gen)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, seq), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    out = os.path.join(ROOT, name)
    shutil.rmtree(out, ignore_errors=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    for extra in set(os.listdir(out)) - {"config.json"}:      # keep only the config and the weights
        if not extra.startswith("model") or not (extra.endswith(".safetensors") or extra.endswith(".json")):
            os.remove(os.path.join(out, extra))
    expected = {"input_ids": ids.to(torch.int32).contiguous(), "logits": logits.contiguous()}
    if name in GENERATE:
        expected |= greedy(model, ids[0, :PROMPT])
    save_file(expected, os.path.join(out, "expected.safetensors"))
    files = sorted(os.listdir(out))
    print(f"{name}: {', '.join(f'{f} ({os.path.getsize(os.path.join(out, f))} B)' for f in files)}")


def main(names: list[str]) -> None:
    os.makedirs(ROOT, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    for name in names or MODELS:
        make(name)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "safetensors": safetensors.__version__, "python": platform.python_version(), "seed": SEED}
    if names:     # only some remade: their versions beside the others'
        with open(os.path.join(ROOT, "versions.json"), encoding="utf-8") as f:
            recorded = json.load(f)
        versions = recorded | {name: versions for name in names}
    with open(os.path.join(ROOT, "versions.json"), "w", encoding="utf-8") as f:
        json.dump(versions, f, indent=2)
        f.write("\n")
    print(json.dumps(versions), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])

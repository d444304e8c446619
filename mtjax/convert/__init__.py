"""Hugging Face <-> mtjax conversion (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE): the library
under the command `python -m mtjax.convert` (`mtjax.commands.convert`, whose `convert_hf` holds `from_hf` and
`to_hf`, each complete or invisible).

  hf_families.py     which family config.json names, its config class's defaults, the tensors it drops
  hf_config.py       config.json <-> the `model` config group
  hf_rope.py         config.json's rotary settings (transformers 4 and 5 spellings) <-> the rope fields
  hf_window.py       config.json's sliding windows: refused unless no layer's window is narrower than the context
  weights.py         HF tensor names and layouts <-> mtjax's parameter leaves (one table per family)
  hf_moe.py          the mixtures of experts: their config.json keys and expert tensors
  safetensors_io.py  reading the weight files (single or sharded), writing one model.safetensors
  checkpoints.py     the mtjax side: a step-0 checkpoint written, a checkpoint's parameters read
  tokenizer_files.py the tokenizer's files copied across, its BOS/EOS ids into config.json
  __main__.py        the entry shim of `python -m mtjax.convert`
"""

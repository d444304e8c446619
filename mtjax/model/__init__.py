"""The GPT / Llama Transformer in Flax, with logical axes on every parameter."""

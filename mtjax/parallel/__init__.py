"""Megatron's intra-layer parallelism written explicitly: operators, layers, vocabulary."""

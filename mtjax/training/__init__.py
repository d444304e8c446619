"""Training: state, optimizer, the sharded step, FLOPs accounting, metrics and the loop."""

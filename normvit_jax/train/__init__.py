"""Training: state, optimizer, the pure jitted steps and the loop."""

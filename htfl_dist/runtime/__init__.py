"""Plumbing: launch detection, transport, placement, the round loop, checkpoints."""

"""Compiler passes over the IR: detect the experts, plan their placement (and verify it), lay
out and emit the bundle."""

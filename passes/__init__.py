"""Compiler passes over the IR: detect experts (plan, quantize, lay out and emit come later)."""

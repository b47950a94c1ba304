"""Readers and writers: SafeTensors, PyTorch, GGUF, model configs (and the bundle, later)."""

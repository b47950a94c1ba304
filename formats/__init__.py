"""Readers and writers: SafeTensors, PyTorch and GGUF checkpoints, model configs, the
quantization schemes and their codecs, hardware and activation profiles, and the bundle."""

"""The runtime: bundle loading and MoE execution. Not implemented yet (see README)."""

"""Tuners: tile sweeps and the fused-MoE tile tuner."""

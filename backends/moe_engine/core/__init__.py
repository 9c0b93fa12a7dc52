"""The serving core: the scheduler and the block manager (what each step runs, which KV blocks hold what), the
sequences, the model runner (inputs, CUDA graphs, forward, sampling, one transfer), the KV cache and its budget,
and the engine's warm-up."""

"""OpenAI-compatible HTTP frontend for MoE models served by Triton.

Routes live in :mod:`openai_frontend.app`; :func:`create_app` is the entry
point the ``moe-serve`` CLI calls.  The frontend never imports torch.
"""

"""Per-architecture config.json parsers: ``model_type`` -> ``parse(raw) -> dict``.

Each parser reads its architecture's keys with the defaults of transformers 5.24's config class and returns
the keyword arguments of ``config.MoEConfig`` with its specs (``rope``, ``attention`` (+ ``mla``), ``router``,
``experts``) as nested dicts; ``config.config_from_dict`` builds and checks the dataclasses. This package
imports nothing from config.py (config.py imports it). No torch import.

Adding an architecture: a module here with its parser, registered in ``PARSERS`` (see config.py's docstring
for the rest).
"""
from __future__ import annotations

from typing import Callable

from . import deepseek, glm4_moe, gpt_oss, mixtral, nemotron_h, olmoe, qwen3_next, qwen_moe

PARSERS: dict[str, Callable[[dict], dict]] = {
    "deepseek_v2": deepseek.parse_deepseek_v2,
    "deepseek_v3": deepseek.parse_deepseek_v3,
    "glm4_moe": glm4_moe.parse_glm4_moe,
    "glm4_moe_lite": glm4_moe.parse_glm4_moe_lite,
    "gpt_oss": gpt_oss.parse,
    "mixtral": mixtral.parse,
    "nemotron_h": nemotron_h.parse,
    "olmoe": olmoe.parse,
    "qwen2_moe": qwen_moe.parse_qwen2_moe,
    "qwen3_moe": qwen_moe.parse_qwen3_moe,
    "qwen3_next": qwen3_next.parse_qwen3_next,
    "qwen3_5_moe": qwen3_next.parse_qwen3_5_moe,
    "qwen3_5_moe_text": qwen3_next.parse_qwen3_5_moe_text,
}

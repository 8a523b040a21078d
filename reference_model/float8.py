"""torchao's float8 training on the reference model, as torchtitan applies it
(torchtitan/components/quantization/float8.py: `convert_to_float8_training` over every
nn.Linear but the output head, with the recipe's Float8LinearConfig; torchao 0.18,
torchao/float8/float8_linear.py). On CPU torch._scaled_mm runs the float8 matmuls."""

from __future__ import annotations

import torch


def convert_float8(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    """Every Linear of the blocks swapped for torchao's Float8Linear of `recipe` (tensorwise or
    rowwise), in place; the head (`lm_head`) stays."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda mod, fqn: fqn != "lm_head")


__all__ = ["convert_float8"]

"""The optimizers, one module each: what each keeps per parameter and per tensor, what its
step allocates, and whether an engine may shard it.

`base` holds the interface (`Optimizer`) and the registry; every other module of this package
defines one optimizer (or a family: `bnb`) and registers it, and this package imports them all,
so a new module is a new optimizer: `adamw` (torch.optim.AdamW), `sgd` (torch.optim.SGD with
and without momentum), `lion` (lion-pytorch), `adafactor` (transformers'), `bnb`
(bitsandbytes' 8-bit and paged AdamW), `muon` (torch.optim.Muon beside AdamW).
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import (DEFAULT, Optimizer, StepView, describe, generation, names, optimizer_named,
                   register, unregister)

# every module of this package that defines an optimizer registers it when imported
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["DEFAULT", "Optimizer", "StepView", "describe", "generation", "names", "optimizer_named",
           "register", "unregister"]

"""Low-bit optimizer classes to name in a config: ``lowbit_compile.optim.AdamW(params, lr=3e-4, fmt="int8")``.

Each class is a subclass of the stock ``torch.optim`` class of the same name whose constructor takes
the stock arguments plus the options of ``lowbit_compile`` and wraps itself, so HF
``optimizer_cls_and_kwargs``, Lightning CLI ``class_path``, Hydra ``_target_`` and torchtune
``_component_`` can select it by import path. ``lowbit_compile(opt)`` turns a stock optimizer into
an instance of the same classes (``opt.__class__`` is swapped; a subclass is made once for an
optimizer of one's own) and ``restore(opt)`` swaps it back, so a wrapped optimizer is still an
instance of its stock class, prints which formats it keeps, and survives ``copy.deepcopy``,
``pickle`` and ``torch.save`` as a wrapped optimizer.
"""

from __future__ import annotations

import torch

from .api import _rebuild, describe, lowbit_class, stock_class  # noqa: F401 (_rebuild: what older pickles name)

# One class per supported stock optimizer (api.REWRITTEN), importable as lowbit_compile.optim.<Name>.
Adam = lowbit_class(torch.optim.Adam)
AdamW = lowbit_class(torch.optim.AdamW)
SGD = lowbit_class(torch.optim.SGD)
RMSprop = lowbit_class(torch.optim.RMSprop)
Adagrad = lowbit_class(torch.optim.Adagrad)
Adamax = lowbit_class(torch.optim.Adamax)
NAdam = lowbit_class(torch.optim.NAdam)
RAdam = lowbit_class(torch.optim.RAdam)
Adadelta = lowbit_class(torch.optim.Adadelta)
ASGD = lowbit_class(torch.optim.ASGD)
Rprop = lowbit_class(torch.optim.Rprop)
Muon = lowbit_class(torch.optim.Muon)
Adafactor = lowbit_class(torch.optim.Adafactor)

__all__ = ["ASGD", "SGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Muon", "NAdam", "RAdam",
           "RMSprop", "Rprop", "lowbit_class", "stock_class"]

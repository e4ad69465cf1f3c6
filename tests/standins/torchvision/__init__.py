"""A stand-in for torchvision in gatherstore's tests: the box helpers torchmetrics'
``MeanAveragePrecision`` calls, and nothing compiled.

PyPI's torchvision is a CUDA build whose compiled ops do not load with the CPU torch
installed here (``import torchvision`` raises "operator torchvision::nms does not
exist"), and torchmetrics imports torchvision wherever it is installed.  The tests
that run MAP, and ``gatherstore bench``'s MAP case, put ``tests/standins`` first on
``sys.path`` before torchmetrics is imported: torchmetrics then finds torchvision
(``RequirementCache("torchvision")`` falls back to importing the module) and MAP runs
on pycocotools.  Only the functions in :mod:`torchvision.ops` work; the model and
transform names torchmetrics imports at load time raise when used.
"""

__version__ = "0.0+gatherstore.standin"

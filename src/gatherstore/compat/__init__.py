"""Drop-in replacements for the distributed helpers of detectron2, mmengine, ignite, vis4d
and virtex, with the originals' names and signatures and objects gathered through
gatherstore, on whatever process group they are given (never torch.distributed's object
collectives).  Import one module in place of the original, or call its ``patch()``
to swap the installed library's object functions in place:

```python
from gatherstore.compat import mmengine as dist      # was: from mmengine import dist
gatherstore.compat.mmengine.patch()                   # or patch mmengine itself
```

Each module imports without its library; only ``patch()`` needs it.
"""

from gatherstore.compat._patching import Patch

__all__ = ["Patch"]

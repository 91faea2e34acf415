"""Where DropIT runs: the converted modules and the operations they call.

- :mod:`.modules`: the DropIT ``Conv2d``, ``ConvTranspose2d``, ``Linear`` and ``ReLU`` modules.
- :mod:`.functions`: the autograd Functions (the eager path) and the layer's input cache.
- :mod:`.library`: the same layers as ``torch.library`` operators, what ``torch.compile`` traces.
- :mod:`.hooked`: the eager convolution as aten's own node with a saved-tensor hook (less host
  time than a Python Function).
- :mod:`.norm`: batch and group norms that keep a packed input.
- :mod:`.pooling`: a max-pool that keeps one byte per output.
"""

from dropit_core.layers.hooked import SavedInputHooks

__all__ = ["SavedInputHooks"]

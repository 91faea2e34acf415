"""Where DropIT runs: the converted modules and the operations they call.

- :mod:`.modules`: the DropIT ``Conv2d``, ``ConvTranspose2d``, ``Linear`` and ``ReLU`` modules.
- :mod:`.functions`: the conv and linear autograd Functions (the eager path) and their backward
  bodies, a large input's weight gradient made over chunks of images.
- :mod:`.relu`: the ReLU that keeps a 1-bit mask, its Function and its backend's choice.
- :mod:`.cache`: a layer's input cache: it packs the input, shares a pack between the layers
  fed one tensor, and holds the draws' keys (on a device too).
- :mod:`.casts`: autocast's weight and bias casts, one copy per forward.
- :mod:`.library`: the same layers as ``torch.library`` operators, what ``torch.compile`` traces.
- :mod:`.hooked`: the eager convolution as aten's own node with a saved-tensor hook (less host
  time than a Python Function).
- :mod:`.norm`: batch and group norms that keep a packed input.
- :mod:`.pooling`: a max-pool that keeps one byte per output.
"""

from dropit_core.layers.hooked import SavedInputHooks

__all__ = ["SavedInputHooks"]

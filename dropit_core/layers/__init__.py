"""Where DropIT runs: one module per converted op, each with its module class, its autograd
Function (the eager path), the backward body the two share and its ``torch.library`` operator
(what ``torch.compile`` traces).

- :mod:`.conv`: ``Conv2d`` and ``ConvTranspose2d``; a large input's weight gradient made over
  chunks of images.
- :mod:`.linear`: ``Linear``.
- :mod:`.relu`: the ReLU that keeps a 1-bit mask, and its backend's choice.
- :mod:`.norm`: batch and group norms that keep a packed input.
- :mod:`.pooling`: a max-pool that keeps one byte per output.
- :mod:`.cache`: a layer's input cache: it packs the input, shares a pack between the layers
  fed one tensor, holds the draws' keys (on a device too), and keeps the pack for a Function.
- :mod:`.casts`: what a conv or linear layer hands its op: autocast's weight and bias casts, one
  copy per forward.
- :mod:`.library`: the operators the traced layers share (the pack, its draw and rebuild), and
  how a conv or linear layer picks its Function or its operator.
"""

"""Where DropIT runs: one module per converted op, each with its module class, its autograd
Function (eager), the backward body the two share and its ``torch.library`` operator (traced).

- :mod:`.conv`: ``Conv2d`` and ``ConvTranspose2d``; :mod:`.linear`: ``Linear``.
- :mod:`.relu`: the ReLU that keeps a 1-bit mask; :mod:`.pooling`: a max-pool keeping a byte.
- :mod:`.norm`: batch and group norms that keep a packed input.
- :mod:`.cache`: a layer's input cache (the pack, shared between layers fed one tensor; the
  draws' keys); :mod:`.casts`: autocast's weight and bias casts, one per forward.
- :mod:`.library`: the operators the traced layers share, and a layer's eager or traced call.
"""

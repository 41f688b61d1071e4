"""Gradient work: collecting an optimizer's gradients, checking and unscaling them.

- :mod:`~ampscaler.grads.collect`: the one walk over an optimizer's gradients, grouped by device
  and dtype (DTensor shards, sparse values, the float16 rule).
- :mod:`~ampscaler.grads.flat`: the opt-in flat-buffer cache in front of it (``flat_grads=True``).
- :mod:`~ampscaler.grads.check`: the inf/NaN check and unscale, and the fused optimizers' route.
- :mod:`~ampscaler.grads.pow2`: knowing on the host that the scale is an exactly invertible power
  of two, without reading it.
"""

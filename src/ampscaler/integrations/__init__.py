"""Glue between ampscaler and training frameworks; each submodule imports its framework.

Importing :mod:`ampscaler` imports none of these, so Lightning and Accelerate stay optional:

- :mod:`ampscaler.integrations.lightning` (``pip install ampscaler[lightning]``): a callback that
  keeps step-interval LR schedulers in step with the optimizer when the scaler skips a step.
- :mod:`ampscaler.integrations.accelerate` (``pip install ampscaler[accelerate]``): installs an
  ampscaler :class:`~ampscaler.GradScaler` into an ``accelerate.Accelerator``.
"""

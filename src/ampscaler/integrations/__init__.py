"""Glue between ampscaler and training frameworks; each submodule imports its framework.

Importing :mod:`ampscaler` imports none of these, so Lightning, Accelerate and transformers stay
optional:

- :mod:`ampscaler.integrations.lightning` (``pip install ampscaler[lightning]``): a callback that
  keeps step-interval LR schedulers in step with the optimizer when the scaler skips a step.
- :mod:`ampscaler.integrations.accelerate` (``pip install ampscaler[accelerate]``): installs an
  ampscaler :class:`~ampscaler.GradScaler` into an ``accelerate.Accelerator``.
- :mod:`ampscaler.integrations.transformers` (``pip install ampscaler[transformers]``): installs
  one into a ``transformers.Trainer`` (through its accelerator), which also makes
  ``fp16=True`` train in fp16 on a CPU.
- :mod:`ampscaler.integrations.megatron` and :mod:`ampscaler.integrations.deepspeed` (the
  engines, installed by you): ``patch_megatron()`` / ``patch_deepspeed()`` make the engines that
  keep a loss scaler of their own build ampscaler's, from their own configuration.
- :mod:`ampscaler.integrations.patch` (no extra): ``patch_torch()``, which makes torch's own
  scaler names build ampscaler's scalers, for frameworks that build torch's themselves, and
  ``setup_hook`` for their worker processes (settings in ``AMPSCALER_PATCH``).
"""

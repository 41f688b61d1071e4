"""Everything that observes steps, one job per module.

- :mod:`~ampscaler.observe.records`: :class:`~ampscaler.StepRecord`, what one iteration did, and
  its JSONL format (the line writer and :func:`~ampscaler.read_log` together);
- :mod:`~ampscaler.observe.sinks`: the :class:`~ampscaler.Sink` protocol and the sinks
  (:class:`~ampscaler.StepHistory`, JSONL, TensorBoard, ``logging``);
- :mod:`~ampscaler.observe.monitor`: the hook that localizes overflows, makes the records and
  hands them to the sinks and callbacks, and lets the collapse watch look;
- :mod:`~ampscaler.observe.localize`: which parameters held inf/NaN on a skipped step, and with
  :class:`~ampscaler.NonFiniteTracer`, which module's backward produced them;
- :mod:`~ampscaler.observe.probe`: :class:`~ampscaler.GradientProbe`, how much of the gradient
  fp16 flushes to zero and how close it is to overflow.

The probe and the tracer are hooks of their own (:mod:`ampscaler.hooks`); they leave what they
found in the iteration's notes, where the monitor reads it. They tap modules through
:mod:`ampscaler.taps`.

Gradients are read through :func:`ampscaler.grads.collect.grad_views`, the one walk over an
optimizer's gradients.
"""

"""How far the tries of a replayed batch back off: the search behind
:meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>`.

A batch's first try runs at the run's scale ``S``; when its scaled gradients overflow, the
policy reacts as it does to any overflow (torch's rule: ``S / 2``) and the second try runs
there, so a batch that one retry gets through (a growth probe that found the ceiling) is
exactly torch's scaler under a replay loop written by hand. A batch that overflows again is
not a probe: its gradients are larger than the run's (an outlier), or the run's scale is far
above its ceiling (a warm-up from 2**16). Halving once per try, as a loop by hand does, spends
every try on one binade and leaves the run's scale as many binades down as the batch took
tries. So:

* when the batch started at the scale the batch before stepped at (its first or second try),
  that scale carries the run's batches and this one is larger: an *outlier*. Its later tries
  run where the policy's further backoffs put them, after ``max_attempts`` it is skipped, as
  torch's scaler skips it (an RL batch with 1000x advantages is not pushed through at scale
  1), and once it is done, stepped or not, the policy's state is what the first try's
  overflow left but with the scale the batch started at: the outlier's backoffs are all the
  batch's. (Left one backoff down, as torch's scaler leaves a skipped batch, a run whose
  outliers overflow keeps losing a binade to each, regrowing only after ``growth_interval``
  clean steps; and whichever outliers happen to overflow decides how low it sits.)
* otherwise the run's scale is a guess no batch carried yet (the first batch under the loop,
  after a growth or a measured policy's jump, after a batch that needed more): the later
  tries *search*, bisecting in binades the distance between the scale that last overflowed
  and a floor of 1 (where float16 training without scaling runs), the last try at the floor
  itself, so a batch that fits float16 unscaled gets through whatever the scale started at.
  Once the batch is done, the policy's state is what the first try's overflow left: one
  backoff below the batch's start, the state a skipped batch leaves without ``attempts()``,
  so a run whose gradients grew for good comes down a backoff per batch. Every search scale
  is the overflowed scale times a power of two (``2**-k``): unscaling stays as exact as at
  the run's own scale.

Example:
    >>> retry_scale(2.0**15, tries_left=1)      # the last try: the floor
    1.0
    >>> retry_scale(2.0**15, tries_left=2)      # halfway, in binades, to the floor
    128.0
    >>> retry_scale(1.0, tries_left=1)          # at the floor already: one more halving
    0.5
"""

from __future__ import annotations

import math

__all__ = ["RETRY_FLOOR", "binades_above", "retry_scale"]

#: The scale the last try of a searched batch runs at, unless the batch overflowed there
#: already: 1, float16 training without loss scaling.
RETRY_FLOOR = 1.0


def binades_above(scale: float, floor: float) -> int:
    """The halvings that take ``scale`` to at most ``floor``: ``ceil(log2(scale / floor))``,
    computed exactly (``floor`` a power of two; ``<= 0`` when ``scale <= floor``).

    Example:
        >>> binades_above(2.0**15, 1.0), binades_above(3000.0, 1.0), binades_above(0.5, 1.0)
        (15, 12, -1)
    """
    mantissa, exponent = math.frexp(scale / floor)  # scale / floor = mantissa * 2**exponent
    return exponent - 1 if mantissa == 0.5 else exponent


def retry_scale(failed: float, tries_left: int, floor: float = RETRY_FLOOR) -> float:
    """The scale of a batch's next try, from the third on.

    ``failed`` is the scale of the try that just overflowed, ``tries_left`` the tries left
    including this one (``>= 1``)::

        d = ceil(log2(failed / floor))      # halvings from failed to the floor
        if d <= 1:          return failed / 2            # at the floor: one more halving
        if tries_left == 1: return failed * 2**-d        # the last try: the floor
        return failed * 2**-ceil(d / 2)                  # bisect the binades between

    Multiplying by a power of two is exact, so the result is too.

    Example:
        >>> [retry_scale(2.0**20, n) for n in (1, 2)]
        [1.0, 1024.0]
        >>> retry_scale(3000.0, 1)    # not a power of two: still the failed scale * 2**-k
        0.732421875
    """
    halvings = binades_above(failed, floor)
    if halvings <= 1:
        return failed * 0.5
    if tries_left <= 1:
        return math.ldexp(failed, -halvings)
    return math.ldexp(failed, -((halvings + 1) // 2))

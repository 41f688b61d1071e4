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
  torch's scaler skips it (an RL batch with 1000x advantages is not pushed through at a scale
  that flushes the run's gradients), and once it is done, stepped or not, the policy's state
  is what the first try's overflow left but with the scale the batch started at: the
  outlier's backoffs are all the batch's. (Left one backoff down, as torch's scaler leaves a
  skipped batch, a run whose outliers overflow keeps losing a binade to each, regrowing only
  after ``growth_interval`` clean steps; and whichever outliers happen to overflow decides
  how low it sits.) In a *warm-up*, before the run skipped any step, the scale has never met
  a ceiling, and a batch over it may be gradients the first optimizer steps grew by a few
  binades: there its later tries *gallop*, each backing off twice as many binades below the
  scale that last overflowed as the one before it did (2, then 4, 8, ...), never below a
  floor of 1 (:func:`gallop_scale`); at torch's rule the third try runs 3 binades below the
  start, so at the default ``max_attempts`` such a batch gets through, and an outlier 10
  binades larger is still skipped.
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
    >>> tries = [2.0**16, 2.0**15]        # an outlier's first two tries, at torch's rule
    >>> for retry in (2, 3, 4, 5):
    ...     tries.append(gallop_scale(tries[-1], retry))
    >>> tries                             # 2, 4, 8 binades below the last, then the floor
    [65536.0, 32768.0, 8192.0, 512.0, 2.0, 1.0]
"""

from __future__ import annotations

import math

__all__ = ["RETRY_FLOOR", "binades_above", "gallop_scale", "retry_scale"]

#: The scale the last try of a searched batch runs at, and the lowest an outlier's gallop
#: reaches, unless the batch overflowed there already: 1, float16 training without loss
#: scaling.
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


def gallop_scale(failed: float, retry: int, floor: float = RETRY_FLOOR) -> float:
    """The scale of an outlier's next try: its ``retry``-th retry (``>= 2``; the first retry
    runs where the policy's backoff put it). ``failed`` is the scale of the try that just
    overflowed::

        d = ceil(log2(failed / floor))              # halvings from failed to the floor
        return failed * 2**-max(1, min(2**(retry - 1), d))

    Each retry backs off twice as many binades as the one before (an exponential search
    for a ceiling of unknown distance: ``k`` binades below the start within about
    ``log2(k) + 2`` tries), never below the floor unless the batch overflowed there already,
    and exactly (a power of two times ``failed``).

    Example:
        >>> gallop_scale(2.0**9, 2), gallop_scale(2.0**7, 3)     # 2**10's outlier: 2**7, 2**3
        (128.0, 8.0)
        >>> gallop_scale(2.0, 4), gallop_scale(1.0, 4)           # the floor, then a halving
        (1.0, 0.5)
    """
    halvings = max(1, min(2 ** (retry - 1), binades_above(failed, floor)))
    return math.ldexp(failed, -halvings)

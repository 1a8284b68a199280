"""Recognising mlx-lm samplers, so mlx-lm scripts keep exact DFlash sampling.

mlx-lm scripts pass ``sampler=make_sampler(temp, top_p, min_p, ...)``: an
opaque closure. DFlash cannot call it (speculative sampling needs the whole
processed distribution, not one sample), but it can read the parameters the
closure holds and sample exactly from the same distribution:

- ``None`` and ``mlx_lm.sample_utils.greedy_sampler`` (what ``make_sampler``
  returns for ``temp == 0``) mean greedy decoding;
- a closure made by the installed mlx-lm's ``make_sampler`` is recognised by
  its code object, and its filters by their lambdas' code objects (each
  compared with one made from a reference ``make_sampler`` call, never by
  name); their closure cells hold temp, top_p, min_p, min_tokens_to_keep,
  top_k and the XTC settings.

Anything else raises `UnsupportedSampler` with the reason, and the caller
falls back to mlx-lm's own decoding. So do the settings DFlash cannot verify
drafts against: XTC (no fixed distribution) and ``min_tokens_to_keep > 1``
(not an option of ``dflash_mlx.stream_generate``).
"""

from __future__ import annotations

from mlx_lm.sample_utils import greedy_sampler, make_sampler

from ..sampling import SamplingSettings


class UnsupportedSampler(ValueError):
    """The sampler cannot run as exact DFlash sampling; the message says why."""


def _cells(fn) -> dict:
    """A function's closure variables by name."""
    code = fn.__code__
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__ or ())}


# One reference sampler with every filter on: its code objects identify the others.
_REFERENCE = make_sampler(1.0, top_p=0.5, min_p=0.1, min_tokens_to_keep=2, top_k=2, xtc_probability=0.5)
_SAMPLER_CODE = _REFERENCE.__code__
_FILTERS = {  # filter lambda code -> the names of the settings it closes over
    method.__code__: frozenset(method.__code__.co_freevars) for method in _cells(_REFERENCE)["sampling_methods"]
}
_TOP_P, _MIN_P, _TOP_K = frozenset({"top_p"}), frozenset({"min_p", "min_tokens_to_keep"}), frozenset({"top_k"})
_XTC = frozenset({"xtc_probability", "xtc_threshold", "xtc_special_tokens"})
if set(_FILTERS.values()) != {_TOP_P, _MIN_P, _TOP_K, _XTC}:  # pragma: no cover - another mlx-lm layout
    _FILTERS = {}


def sampler_settings(sampler) -> SamplingSettings:
    """The `SamplingSettings` an mlx-lm sampler samples with (greedy for None).

    Raises `UnsupportedSampler` for samplers DFlash cannot reproduce exactly.
    """
    if sampler is None or sampler is greedy_sampler:
        return SamplingSettings()
    if getattr(sampler, "__code__", None) is not _SAMPLER_CODE or not _FILTERS:
        name = getattr(sampler, "__qualname__", type(sampler).__name__)
        raise UnsupportedSampler(
            f"the sampler {name} was not made by mlx_lm.sample_utils.make_sampler, so its distribution is unknown"
        )
    cells = _cells(sampler)
    found = {"temperature": cells["temp"]}
    for method in cells["sampling_methods"]:
        kind = _FILTERS.get(getattr(method, "__code__", None))
        values = _cells(method)
        if kind == _TOP_P:
            found["top_p"] = values["top_p"]
        elif kind == _MIN_P:
            found["min_p"] = values["min_p"]
            if values["min_tokens_to_keep"] != 1:
                raise UnsupportedSampler(
                    f"min_tokens_to_keep={values['min_tokens_to_keep']} is not an option of DFlash sampling"
                )
        elif kind == _TOP_K:
            found["top_k"] = values["top_k"]
        elif kind == _XTC:
            raise UnsupportedSampler(
                "XTC sampling (xtc_probability > 0) has no fixed distribution to verify drafts against"
            )
        else:  # pragma: no cover - only if make_sampler's list held something else
            raise UnsupportedSampler("the sampler holds a filter this version does not know")
    try:
        return SamplingSettings(**found)
    except ValueError as e:
        raise ValueError(f"sampler: {e}") from e

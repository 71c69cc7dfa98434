"""Comparing a student's output with the reference, with tolerances calibrated by the reference's own error.

For a floating-point output at dtype d, let r64 be the plain reference evaluated in float64 on the same inputs and
r_d the fast reference at dtype d. The student's output s passes when, elementwise,

    |s - r64| <= multiple * max|r_d - r64| + floor_ulps * eps(d) * max|r64|

so the bar is "as accurate as the reference, within a stated multiple", plus a small floor for outputs the
reference happens to get exactly right. NaN or inf where r64 is finite never passes, and a constant output never
passes where the expected one is not constant.

Values at the end of a training trajectory (gradients and weights after a few optimizer steps) carry the rounding of
every earlier step, whatever their own size, and one fp32 run's error is a noisy estimate of it. For them a grader
passes several legitimate fp32 computations as r_d (the largest error of theirs counts) and, as `scale`, the largest
magnitude among all of the model's values at that point instead of max|r64| (`largest_magnitude`).
"""

from __future__ import annotations

import torch

from grader.checks.outcomes import WrongAnswer


def _relative(error: float, expected: float, scale: float) -> str:
    """The error against the expected value, or, where that is 0 (a relative error would read "inf"), against the
    largest expected magnitude, which is what the floor is measured against: a small value computed as the difference
    of large ones carries their rounding."""
    if expected:
        return f"relative {error / abs(expected):.3g}"
    if scale:
        return f"the expected value is 0 there; the error is {error / scale:.3g} of the largest |expected| {scale:.3g}"
    return "the expected value is 0 there"


def _where(index: int, shape: torch.Size) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(index % size if size else 0)
        index //= size if size else 1
    return tuple(reversed(coords))


# Outputs this small are printed whole in a failure: a student sees every value, not only the worst one.
SHOWN_WHOLE = 16


def inputs_if_small(**tensors: torch.Tensor) -> str:
    """", name=[...]" for each input of at most SHOWN_WHOLE elements, to 7 significant digits (the case's seed
    rebuilds them exactly): a shrunk failing input is read as its values, not only as its shape and seed."""
    def listed(values) -> str:
        if isinstance(values, list):
            return "[" + ", ".join(listed(value) for value in values) + "]"
        return format(values, ".7g") if isinstance(values, float) else str(values)
    return "".join(f", {name}={listed(tensor.detach().cpu().double().tolist())}"
                   for name, tensor in tensors.items() if tensor.numel() <= SHOWN_WHOLE)


def whole_values(actual: torch.Tensor, expected: torch.Tensor) -> str:
    if actual.numel() > SHOWN_WHOLE:
        return ""
    def listed(values: torch.Tensor) -> str:
        return str(values.detach().cpu().tolist())
    return f"\n  got:      {listed(actual)}\n  expected: {listed(expected)}"


def check_tensor_form(actual, expected: torch.Tensor, what: str, context: str) -> None:
    """Type, shape, dtype and device, each reported as itself rather than as a numeric mismatch."""
    if not isinstance(actual, torch.Tensor):
        raise WrongAnswer(f"{what}: expected a tensor, got {type(actual).__name__} ({context})")
    if actual.shape != expected.shape:
        raise WrongAnswer(f"{what}: wrong shape {tuple(actual.shape)}, expected {tuple(expected.shape)} ({context})")
    if actual.dtype != expected.dtype:
        raise WrongAnswer(f"{what}: wrong dtype {actual.dtype}, expected {expected.dtype} ({context})")
    if actual.device.type != expected.device.type:
        raise WrongAnswer(f"{what}: on device {actual.device}, expected {expected.device.type} ({context})")


def assert_contiguous(actual, what: str, context: str) -> None:
    """For an output the contract promises as a new contiguous tensor: a transposed or strided result (say C^T
    computed and returned as a view) has the right values and the wrong layout for its caller."""
    if isinstance(actual, torch.Tensor) and not actual.is_contiguous():
        raise WrongAnswer(f"{what}: not contiguous (strides {actual.stride()} for shape {tuple(actual.shape)}); the "
                          f"contract asks for a new contiguous tensor ({context})")


def assert_close(
    actual,
    expected64: torch.Tensor,
    reference_at_dtype: torch.Tensor,
    *,
    what: str,
    context: str,
    multiple: float,
    floor_ulps: float,
    scale: float | None = None,
) -> None:
    """Raise WrongAnswer unless `actual` matches as the module docstring says. `reference_at_dtype` is one tensor or a
    tuple of legitimate computations at the dtype; `scale` replaces max|r64| in the floor."""
    yardsticks = reference_at_dtype if isinstance(reference_at_dtype, tuple) else (reference_at_dtype,)
    reference_at_dtype = yardsticks[0]
    check_tensor_form(actual, reference_at_dtype, what, context)
    s = actual.detach().to("cpu", torch.float64)
    r64 = expected64.detach().to("cpu", torch.float64)
    rds = [y.detach().to("cpu", torch.float64) for y in yardsticks]
    rd = rds[0]
    if s.numel() == 0:
        return
    finite = torch.isfinite(r64)
    bad = finite & ~torch.isfinite(s)
    if bad.any():
        index = int(bad.flatten().nonzero()[0])
        raise WrongAnswer(
            f"{what}: {int(bad.sum())} non-finite values (e.g. {s.flatten()[index].item()} at "
            f"{_where(index, s.shape)}, expected {r64.flatten()[index].item():.6g}) ({context})"
        )
    # Only where neither the reference at this dtype nor the float64 truth is constant: rounding can make a nearly
    # constant output exact, and where the truth is constant (a gradient that is exactly zero, say) the reference's
    # rounding noise is not a reason to refuse the exact answer; the tolerance below still judges it.
    def varies(values: torch.Tensor) -> bool:
        return bool((values[finite] != values[finite].flatten()[0]).any()) if finite.any() else False

    if s.numel() > 1 and varies(rd) and varies(r64) and bool((s == s.flatten()[0]).all()):
        raise WrongAnswer(
            f"{what}: every value is {s.flatten()[0].item():.6g}, but the expected output is not constant ({context})"
        )
    eps = torch.finfo(reference_at_dtype.dtype).eps if reference_at_dtype.is_floating_point() else 0.0
    reference_error = max(float((r - r64)[finite].abs().max()) for r in rds) if finite.any() else 0.0
    if scale is None:
        scale = float(r64[finite].abs().max()) if finite.any() else 0.0
    bound = multiple * reference_error + floor_ulps * eps * scale
    error = torch.where(finite, (s - r64).abs(), torch.zeros_like(s))
    worst = int(error.flatten().argmax())
    worst_error = float(error.flatten()[worst])
    if worst_error > bound:
        expected_value = float(r64.flatten()[worst])
        count = int((error > bound).sum())
        raise WrongAnswer(
            f"{what}: {count} of {s.numel()} values out of tolerance; largest error {worst_error:.3g} "
            f"({_relative(worst_error, expected_value, scale)}) at {_where(worst, s.shape)}: "
            f"got {float(s.flatten()[worst]):.6g}, "
            f"expected {expected_value:.6g}; allowed {bound:.3g} = {multiple:g} x reference error "
            f"{reference_error:.3g} + {floor_ulps:g} ulp x scale {scale:.3g} ({context})"
            + whole_values(s, r64)
        )


def largest_magnitude(tensors) -> float:
    """The largest |value| among `tensors` (None entries skipped): the floor's scale for values of one trajectory."""
    return max((float(t.detach().abs().max()) for t in tensors if t is not None and t.numel()), default=0.0)


def assert_equal(actual, expected: torch.Tensor, *, what: str, context: str) -> None:
    """Exact comparison, for integer outputs such as indices and counts."""
    check_tensor_form(actual, expected, what, context)
    mismatch = actual.cpu() != expected.cpu()
    if mismatch.any():
        index = int(mismatch.flatten().nonzero()[0])
        where = _where(index, actual.shape)
        raise WrongAnswer(
            f"{what}: {int(mismatch.sum())} of {actual.numel()} values differ; first at {where}: "
            f"got {actual.flatten()[index].item()}, expected {expected.flatten()[index].item()} ({context})"
            + whole_values(actual, expected)
        )


def assert_raises(raised, expected_error: str, call: str) -> None:
    """The student's call, described by `call`, must have raised `expected_error` (a class name; subclasses count).
    `raised` is what Sandbox.raises returned: the StudentError, or None if the call returned."""
    if raised is None or expected_error not in raised.type_names:
        got = f"it raised {raised.raised}" if raised else "it returned normally"
        raise WrongAnswer(f"{call} must raise {expected_error}; {got}")

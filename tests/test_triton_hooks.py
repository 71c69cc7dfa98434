"""Tests of the Triton runtime hooks, under Triton's interpreter on small shapes."""

import pytest
import torch
import triton
import triton.language as tl

from grader.sandbox import triton_hooks
from grader.sandbox.triton_hooks import LaunchRecorder, TritonOutOfBounds
from grader.sandbox.triton_traffic import TRAFFIC

interpreter_only = pytest.mark.skipif(not triton_hooks._interpreting(), reason="needs TRITON_INTERPRET=1")


@pytest.fixture(scope="module", autouse=True)
def hooks_installed():
    # Twice on purpose: installing is idempotent.
    triton_hooks.install_all()
    triton_hooks.install_all()


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def unmasked_load_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs), mask=offs < n)


@triton.jit
def unmasked_store_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n))


@triton.jit
def off_by_one_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x, mask=offs <= n)


@triton.jit
def histogram_kernel(bins_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bins = tl.load(bins_ptr + offs, mask=offs < n)
    tl.atomic_add(counts_ptr + bins, 1, mask=offs < n)


@triton.jit
def shifted_load_kernel(x_ptr, out_ptr, shift, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs + shift), mask=offs < n)


@triton.jit
def strided_copy_kernel(x_ptr, out_ptr, rows, cols, stride_xr, stride_xc, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    r = tl.arange(0, BLOCK_R)[:, None]
    c = tl.arange(0, BLOCK_C)[None, :]
    mask = (r < rows) & (c < cols)
    x = tl.load(x_ptr + r * stride_xr + c * stride_xc, mask=mask)
    tl.store(out_ptr + r * cols + c, x, mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": block}) for block in (16, 32, 64)], key=["n"])
@triton.jit
def autotuned_scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, 2.0 * tl.load(x_ptr + offs, mask=mask), mask=mask)


def _grid_1d(n, block):
    return (triton.cdiv(n, block), )


@interpreter_only
def test_masked_kernel_in_bounds_is_correct():
    x_RC, y_RC = torch.randn(4, 25), torch.randn(4, 25)
    out_RC = torch.empty(4, 25)
    add_kernel[_grid_1d(100, 32)](x_RC, y_RC, out_RC, 100, BLOCK=32)
    torch.testing.assert_close(out_RC, x_RC + y_RC, rtol=0, atol=0)


@interpreter_only
def test_unmasked_load_past_end_raises():
    x_RC, out_RC = torch.randn(4, 100), torch.empty(4, 100)
    with pytest.raises(TritonOutOfBounds) as info:
        unmasked_load_kernel[_grid_1d(400, 32)](x_RC, out_RC, 400, BLOCK=32)
    message = str(info.value)
    assert "unmasked_load_kernel" in message and "load" in message
    # 400 = 12 * 32 + 16: the last program has 16 lanes past the end; the first
    # of them reads the 4 bytes right after the tensor.
    assert "16 of 32 active lanes" in message
    assert "4 bytes past the end of `x_ptr` (shape (4, 100), float32" in message


@interpreter_only
def test_unmasked_store_past_end_raises_and_names_keyword_argument():
    x_N, out_N = torch.randn(40), torch.zeros(40)
    with pytest.raises(TritonOutOfBounds) as info:
        unmasked_store_kernel[_grid_1d(40, 32)](x_N, out_ptr=out_N, n=40, BLOCK=32)
    message = str(info.value)
    assert "unmasked_store_kernel" in message and "store" in message
    assert "`out_ptr`" in message


@interpreter_only
def test_off_by_one_store_mask_raises():
    x_N, out_N = torch.randn(40), torch.zeros(40)
    with pytest.raises(TritonOutOfBounds) as info:
        off_by_one_kernel[_grid_1d(40, 16)](x_N, out_N, 40, BLOCK=16)
    message = str(info.value)
    assert "off_by_one_kernel" in message and "store" in message
    assert "1 of 9 active lanes" in message


@interpreter_only
def test_atomic_add_out_of_bounds_raises():
    bins_N = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32)
    counts_B = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(TritonOutOfBounds) as info:
        histogram_kernel[(1, )](bins_N, counts_B, 6, BLOCK=8)
    message = str(info.value)
    assert "histogram_kernel" in message and "atomic" in message
    assert "`counts_ptr`" in message


@interpreter_only
def test_atomic_add_in_bounds_is_correct():
    bins_N = torch.tensor([0, 1, 1, 4, 4, 4], dtype=torch.int32)
    counts_B = torch.zeros(5, dtype=torch.int32)
    histogram_kernel[(1, )](bins_N, counts_B, 6, BLOCK=8)
    assert counts_B.tolist() == [1, 2, 0, 0, 3]


@interpreter_only
def test_address_before_start_is_described():
    x_N, out_N = torch.randn(8), torch.empty(8)
    with pytest.raises(TritonOutOfBounds, match="8 bytes before the start of `x_ptr`"):
        shifted_load_kernel[(1, )](x_N, out_N, -2, 8, BLOCK=8)


@interpreter_only
def test_wild_address_raises_instead_of_crashing():
    # Without the check this reads ~4 TiB past the tensor and kills the process.
    x_N, out_N = torch.randn(8), torch.empty(8)
    with pytest.raises(TritonOutOfBounds, match="shifted_load_kernel"):
        shifted_load_kernel[(1, )](x_N, out_N, 1 << 40, 8, BLOCK=8)


@interpreter_only
def test_transposed_view_inside_bounds_passes():
    base_CR = torch.randn(5, 3)
    x_RC = base_CR.t()  # (3, 5), strides (1, 3): not contiguous
    out_RC = torch.empty(3, 5)
    strided_copy_kernel[(1, )](x_RC, out_RC, 3, 5, x_RC.stride(0), x_RC.stride(1), BLOCK_R=4, BLOCK_C=8)
    torch.testing.assert_close(out_RC, x_RC, rtol=0, atol=0)


@interpreter_only
def test_sliced_view_inside_bounds_passes_and_outside_raises():
    base_RC = torch.randn(6, 10)
    x_RC = base_RC[1:4, 2:7]  # (3, 5) window in the middle of the buffer
    out_RC = torch.empty(3, 5)
    strided_copy_kernel[(1, )](x_RC, out_RC, 3, 5, x_RC.stride(0), x_RC.stride(1), BLOCK_R=4, BLOCK_C=8)
    torch.testing.assert_close(out_RC, x_RC, rtol=0, atol=0)
    # One row too many: memory that exists in the base tensor but not in the view.
    with pytest.raises(TritonOutOfBounds, match="`x_ptr` \\(shape \\(3, 5\\)"):
        strided_copy_kernel[(1, )](x_RC, torch.empty(4, 5), 4, 5, x_RC.stride(0), x_RC.stride(1), BLOCK_R=4,
                                   BLOCK_C=8)


@interpreter_only
def test_autotuned_kernel_runs_first_config_without_benchmarks():
    x_N = torch.randn(100)
    out_N = torch.empty(100)
    autotuned_scale_kernel[lambda meta: _grid_1d(100, meta["BLOCK"])](x_N, out_N, 100)
    torch.testing.assert_close(out_N, 2.0 * x_N, rtol=0, atol=0)
    assert autotuned_scale_kernel.best_config.kwargs == {"BLOCK": 16}


def test_launch_recorder_counts_plain_and_autotuned_launches():
    device = "cpu" if triton_hooks._interpreting() else "cuda"
    recorder = LaunchRecorder()
    recorder.install()
    recorder.install()
    x_N = torch.randn(50, device=device)
    out_N = torch.empty(50, device=device)
    recorder.names.append("stale")
    recorder.reset()
    add_kernel[_grid_1d(50, 32)](x_N, x_N, out_N, 50, BLOCK=32)
    autotuned_scale_kernel[lambda meta: _grid_1d(50, meta["BLOCK"])](x_N, out_N, 50)
    # A new tuning key, so a GPU run benchmarks all three configs again.
    autotuned_scale_kernel[lambda meta: _grid_1d(49, meta["BLOCK"])](x_N, out_N, 49)
    add_kernel[_grid_1d(50, 32)](x_N, x_N, out_N, 50, BLOCK=32)
    assert recorder.names == ["add_kernel", "autotuned_scale_kernel", "autotuned_scale_kernel", "add_kernel"]
    assert triton_hooks.LAUNCHES.names[-4:] == recorder.names


# --- what the launches touched (grader.sandbox.triton_traffic) ------------------------------------------------------


def _traffic_of(call, by_address: bool):
    """Run call() with the traffic recorder on, and torch's copies shown to it as the worker's recorder does."""
    from grader.sandbox.allowed_ops import ALLOWED_OPS
    from grader.sandbox.guards import ForbiddenOpRecorder

    TRAFFIC.start(by_address=by_address)
    try:
        with ForbiddenOpRecorder((), ALLOWED_OPS):
            result = call()
    finally:
        TRAFFIC.stop()
    return result


@interpreter_only
def test_traffic_names_the_elements_no_launch_read_or_wrote():
    x, out = torch.arange(10.0), torch.zeros(10)
    _traffic_of(lambda: strided_copy_kernel[(1,)](x, out, 1, 9, 0, 1, BLOCK_R=1, BLOCK_C=16), by_address=True)
    assert TRAFFIC.unread({"x": x}) == ["x: 1 of 10 elements"]
    assert TRAFFIC.unwritten({"out": out}) == ["out: 1 of 10 elements"]


@interpreter_only
def test_traffic_follows_torch_copies_into_and_out_of_kernels():
    row = torch.arange(8.0, dtype=torch.float16)
    x = row.expand(3, 8)  # stride 0: every element of the row is read through its copy

    def call():
        buffer = torch.empty(3, 8)
        strided_copy_kernel[(1,)](x.contiguous(), buffer, 3, 8, 8, 1, BLOCK_R=4, BLOCK_C=8)
        return buffer.to(torch.float16)  # a cast of what the kernel stored

    out = _traffic_of(call, by_address=True)
    assert TRAFFIC.unread({"x": x}) == []
    assert TRAFFIC.unwritten({"out": out}) == []
    assert TRAFFIC.unwritten({"made by torch": torch.ones(3)}) == ["made by torch: 3 of 3 elements"]


@interpreter_only
def test_traffic_counts_every_load_lane_masked_or_repeated():
    """Two programs of 16 lanes load x and y over 10 elements: 64 lanes counted, though 20 were read."""
    x, out = torch.arange(10.0), torch.zeros(10)
    _traffic_of(lambda: add_kernel[(2,)](x, x, out, 10, BLOCK=16), by_address=True)
    assert TRAFFIC.loaded_lanes == 2 * 2 * 16
    assert TRAFFIC.loaded.unique().size == 10


def test_traffic_by_argument_counts_what_each_launch_was_given():
    # The GPU's evidence (launch arguments, no addresses), here on the interpreter's CPU tensors.
    x, out, other = torch.arange(10.0), torch.zeros(10), torch.ones(4)
    _traffic_of(lambda: add_kernel[(1,)](x, x, out, 10, BLOCK=16), by_address=False)
    assert TRAFFIC.unread({"x": x, "other": other}) == ["other"]
    assert TRAFFIC.unwritten({"out": out[2:], "other": other}) == ["other"]


@interpreter_only
def test_traffic_keeps_the_widest_block_a_kernel_held():
    x, out = torch.zeros(4, 200), torch.zeros(4, 200)
    _traffic_of(lambda: strided_copy_kernel[(1,)](x, out, 4, 200, 200, 1, BLOCK_R=4, BLOCK_C=256), by_address=True)
    assert TRAFFIC.widest_block == ("strided_copy_kernel", (4, 256))


def test_widest_block_is_read_from_triton_ir():
    TRAFFIC.start(by_address=False)
    TRAFFIC.note_ir("k", "%1 = tt.load %0 : tensor<64x32x!tt.ptr<f16>>\n%2 = tt.dot %a, %b : tensor<64x256xf32>\n"
                         "%3 = tt.make_range {end = 512 : i32} : tensor<512xi32>")
    TRAFFIC.stop()
    assert TRAFFIC.widest_block == ("k", (64, 256))  # blocks of one dimension are not counted
